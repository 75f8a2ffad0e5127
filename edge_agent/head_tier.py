"""Head tier: a frozen ONNX encoder and a personal head, without torch.

A head agent (a Raspberry Pi, say) never trains the encoder. For each encoder release
it receives, :class:`HeadRuntime`:

1. verifies the artifact against the release's sha256 and the manifest, opens it with
   onnxruntime and checks its input shape against the local data — a mismatched or
   corrupt release is refused with a logged error and the current one stays in use;
2. computes features of the local train and held-out samples (images, series or vectors);
3. fits its head — built by the release's method (:meth:`edgepfl.methods.Method.make_head`),
   so a device gets exactly the estimator the method itself uses, and refused when the
   method offers no head of that kind — or loads a head fitted offline for exactly this
   encoder (``head.offline.onnx`` in the state directory; head kind ``onnx`` requires one);
4. evaluates on the held-out split, keeps encoder + head on disk (atomic writes, files
   named by content so a crash never mixes two releases) and serves predictions.

Labels: a device whose class names are all among the federation's (an image folder
whose sub-folders sort in another order, say) is fitted in the federation's numbering;
other data is a new task in its own. Either way the head file records the name of each
class (:mod:`edgepfl.heads.labels`), so ``edgepfl predict`` prints the right names.

Only numpy and onnxruntime are imported here: the head is fitted and exported in a short
child process (:mod:`.head_fit`), so the agent never holds scikit-learn or scipy
(tests assert it, and that torch never is loaded for the generic heads). Out of memory —
while restoring, opening the encoder, computing features or fitting — raises
:class:`~edgepfl.errors.OutOfMemory`, never a refusal: the release is good and is tried
again when memory allows (the agent exits with its own code and its service restarts it).
A method's own head
(``dualfed``, ``fedpick``) is trained with torch around the federation's global heads,
which a release carries beside the encoder (checked against the manifest's sha256 and kept
with the installed release): a device with torch fits it on receipt, a device without
torch fits it elsewhere (``edgepfl fit-head``) and installs it as an offline head.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgepfl.atomic import write_bytes, write_json
from edgepfl.data.client import ClientData
from edgepfl.data.preprocess import ChannelAffine, channel_order, conversion
from edgepfl.errors import OutOfMemory, out_of_memory
from edgepfl.export.heads import OnnxHead
from edgepfl.export.predict import OnnxEncoder
from edgepfl.heads import OFFLINE_HEAD_KIND, HeadRelease
from edgepfl.heads.labels import FEDERATION, LabelSpace, label_space_for
from edgepfl.protocol.envelope import SIGNATURE_BYTES, Header, encode_body
from edgepfl.protocol.manifest import ReleaseManifest, release_tensors
from edgepfl.protocol.messages import ReleaseMeta
from edgepfl.protocol.signing import verify_signed_part
from edgepfl.protocol.validation import first_validation_error
from edgepfl.service import notifier, uninterruptible

from . import head_fit

if TYPE_CHECKING:  # pragma: no cover
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from edgepfl.heads.estimators import HeadEstimator

log = logging.getLogger("edgepfl.agent.head")

STATE_FILE = "release.json"
OFFLINE_HEAD = "head.offline.onnx"
#: the files an install writes before its record (named by content); :meth:`HeadRuntime.remove_strays`
STRAY_PATTERNS = ("encoder-*.onnx", "head-*.onnx", "global-heads-*.safetensors", "release-*.proof")
#: how far the device clock may lag before a release is wrongly taken as unexpired, or lead before
#: a fresh one is wrongly taken as expired
MAX_CLOCK_SKEW_S = 300.0
#: manifest fields that name or describe a release, not what a device computes with it
RELEASE_IDENTITY_FIELDS = frozenset({"release_id", "round", "created", "edgepfl_version", "parity_max_abs"})


def computes_alike(a: ReleaseManifest, b: ReleaseManifest) -> bool:
    """Whether a device computes the same with ``a`` as with ``b``: equal in every field but
    those that name the release (:data:`RELEASE_IDENTITY_FIELDS`): preprocessing, label order,
    channels, method and options, the encoder and its variants. A release that changes only
    its manifest's preprocessing carries the same encoder and yet changes every prediction."""
    return a.model_dump(exclude=set(RELEASE_IDENTITY_FIELDS)) == b.model_dump(exclude=set(RELEASE_IDENTITY_FIELDS))


class ReleaseRefused(ValueError):
    """A release that cannot be installed; the previous one stays in use."""


class HeadFit(BaseModel):
    """What fitting the personal head on a release measured on this device's own data."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    release_id: str
    head: str = Field(description="the head kind fitted (or the offline head's)")
    accuracy: float = Field(description="on the device's held-out samples")
    eval_correct: int
    num_train: int
    num_test: int
    train_accuracy: float | None = Field(description="None without training samples")
    fit_seconds: float
    feature_seconds: float
    latency_ratio: float | None = Field(
        None, description="the encoder's time per sample over the previously installed encoder's, both timed "
                          "interleaved on the same local samples at install (None: no previous encoder to time)")

    def values(self) -> dict[str, float]:
        """The numeric figures, for a ``metrics`` report's ``values``."""
        return {k: float(v) for k, v in self.model_dump().items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class InstalledRelease(BaseModel):
    """``release.json``: the installed release and the files it is made of, written last
    (the switch from the previous release) and re-verified on restart."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    release_id: str
    manifest: ReleaseManifest
    encoder_file: str
    encoder_sha256: str
    head_file: str
    head_sha256: str
    metrics: HeadFit
    global_heads_file: str | None = None
    global_heads_sha256: str | None = None
    #: when it was installed (Unix time)
    installed: float
    sequence: int | None = None
    #: the signed prefix + header + signature as received (None: an unsigned release)
    proof_file: str | None = None
    #: the release installed before this one, its files kept (since protocol 1.8): a rollback
    #: to it (``release.restore``) switches back without a download or a fit
    previous: InstalledRelease | None = None

    def files(self) -> set[str]:
        """The files in the state directory this release (and the one kept before it) uses."""
        own = {n for n in (self.encoder_file, self.head_file, self.proof_file, self.global_heads_file) if n}
        return own | (self.previous.files() if self.previous is not None else set())

    def held(self, manifest: ReleaseManifest, global_heads_sha256: str | None) -> bool:
        """Whether this record is of ``manifest``'s encoder with these global heads (or installed
        without global heads: what was fitted then did not need them), and computes as
        ``manifest`` says (:func:`computes_alike`): what a head kept as fitted may be reused for."""
        return self.encoder_sha256 == manifest.encoder.sha256 and \
            self.global_heads_sha256 in (None, global_heads_sha256) and computes_alike(self.manifest, manifest)


class HeadRuntime:
    """Encoder release -> features -> personal head -> metrics and predictions, torch-free.

    ``head_kind``: a kind of the release's method's ``head_kinds`` (fitted on device with
    ``head_params`` overriding the method's parameters, unless a matching offline head is
    present) or ``"onnx"`` (only an offline head, e.g. DualFed / FedPick heads fitted with
    ``edgepfl fit-head``). ``data``: the device's own samples (any input kind), normalized as the
    federation's (the manifest's preprocessing).
    """

    def __init__(self, state_dir: str | Path, head_kind: str, data: ClientData, *, threads: int | None = None,
                 head_params: dict[str, Any] | None = None, coordinator_key: Ed25519PublicKey | None = None):
        self.state_dir = Path(state_dir)
        #: pinned: releases must be signed by it, sequenced and unexpired, and the installed one
        #: is re-verified against it on restart
        self.coordinator_key = coordinator_key
        self.head_kind = head_kind
        self.data = data
        self.threads = threads
        self.head_params = dict(head_params or {})
        self.encoder: OnnxEncoder | None = None
        self.head: OnnxHead | None = None
        self.record: InstalledRelease | None = None
        self._adapt: _LocalToRun | None = None
        #: the refusals logged so far, (release, sequence, reason): one offered again (a retained
        #: copy, each reconnect's presence) is logged once, not at ERROR each time
        self._refusals_logged: set[tuple[str, int | None, str]] = set()

    # ---------------------------------------------------------------- state
    @property
    def release_id(self) -> str | None:
        return self.record.release_id if self.record else None

    @property
    def ready(self) -> bool:
        return self.encoder is not None and self.head is not None

    def load(self) -> HeadFit:
        """Restore the last installed release from disk; returns its metrics.

        Raises ``FileNotFoundError`` when nothing was installed yet and ``ValueError``
        when the files on disk do not match their record.
        """
        installed = open_installed(self.state_dir, threads=self.threads, coordinator_key=self.coordinator_key)
        record = installed.record
        self.encoder, self.head, self.record = installed.encoder, installed.head, record
        self._adapt = _local_to_run(self.data, record.manifest, installed=True)
        log.info("restored release %s with a %s head (accuracy %.4f)", record.release_id, record.metrics.head,
                 record.metrics.accuracy)
        return record.metrics

    def installed_artifact(self) -> bytes | None:
        """The installed release's encoder file as received (what a release delta applies to),
        or None when none is installed and usable."""
        if self.record is None or not self.ready:
            return None
        try:
            return (self.state_dir / self.record.encoder_file).read_bytes()
        except OSError:
            return None

    # ---------------------------------------------------------------- releases
    def _release_refusal(self, sequence: int | None, expires: float | None, digest: str) -> str | None:
        """Why a release with this ``sequence`` and ``expires`` must not replace the installed one
        (a rollback, expired, unsequenced where a coordinator key is pinned), or None."""
        if self.coordinator_key is not None and (sequence is None or expires is None):
            return "unsequenced: a signed release must carry a sequence and an expiry"
        if expires is not None and time.time() > expires + MAX_CLOCK_SKEW_S:
            return f"expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(expires))} UTC"
        installed = self.record.sequence if self.record else None
        if sequence is not None and installed is not None and sequence <= installed:
            if sequence == installed and self.record and self.record.encoder_sha256 == digest:
                return None  # the installed release again (a late re-send): nothing to refuse
            return f"rollback: sequence {sequence} is not above the installed {installed}"
        return None

    def install_release(self, manifest: ReleaseManifest, artifact: bytes, expected_sha256: str, *,
                        sequence: int | None = None, expires: float | None = None,
                        proof: bytes | None = None, global_heads: bytes | None = None) -> HeadFit:
        """Verify, install and fit on a new encoder release; returns what the fit measured.

        Raises :class:`ReleaseRefused` (after logging why) and keeps the current release
        when the artifact does not match its sha256, is not a loadable ONNX encoder, or
        does not fit this device's data; or when its ``sequence`` is not above the installed
        release's (a rollback), it is past ``expires``, or, with a pinned coordinator key, it
        lacks either. ``proof`` (the signed frame's prefix, header and signature) is kept to
        re-verify the release on restart. ``global_heads``: the bytes of the manifest's
        global heads file as the release carried them (a release from a 1.1 coordinator
        carries none: then only heads that do not need them can be fitted); refused when
        they do not match the manifest's sha256 or the manifest names no such file.
        """
        release_id = manifest.release_id
        current = self.release_id

        def refuse(reason: str) -> ReleaseRefused:
            # an older release than the installed one is refused as it must be (a canary on a held
            # release sees the fleet's current one offered again): a warning, not an error
            level = logging.WARNING if reason.startswith("rollback") else logging.ERROR
            key = (release_id, sequence, reason)
            log.log(logging.DEBUG if key in self._refusals_logged else level, "release %s refused: %s; keeping %s",
                    release_id, reason, f"release {current}" if current else "no release (none installed yet)")
            self._refusals_logged.add(key)
            return ReleaseRefused(f"release {release_id} refused: {reason}")

        digest = _sha(artifact)
        if digest != expected_sha256:
            raise refuse(f"sha256 mismatch: artifact is {digest[:16]}…, release says {expected_sha256[:16]}…")
        declared = manifest.encoder.sha256
        if declared != digest:
            raise refuse(f"sha256 mismatch: artifact is {digest[:16]}…, manifest says {declared[:16]}…")
        refusal = self._release_refusal(sequence, expires, digest)
        if refusal is not None:
            raise refuse(refusal)
        heads_entry = manifest.global_heads
        if global_heads is not None and heads_entry is None:
            raise refuse("it carries global heads its manifest does not name")
        if global_heads is not None and heads_entry is not None and _sha(global_heads) != heads_entry.sha256:
            raise refuse(f"sha256 mismatch: global heads are {_sha(global_heads)[:16]}…, manifest says "
                         f"{heads_entry.sha256[:16]}…")
        if self.coordinator_key is not None and proof is None:
            raise refuse("unsigned")
        # the installed encoder and global heads in a newer release: the head as fitted holds, unless
        # the manifest changes what the device computes (preprocessing, labels): then fitted again and
        # measured, as any release whose predictions differ must be at a rollout's gate
        if self.record and self.record.encoder_sha256 == digest and self.ready and \
                self.record.global_heads_sha256 == (_sha(global_heads) if global_heads is not None else None) and \
                computes_alike(self.record.manifest, manifest):
            if (release_id, sequence) == (self.record.release_id, self.record.sequence):
                log.info("release %s already installed", release_id)
                return self.record.metrics
            return self._adopt(manifest, sequence, proof)
        want = list(self.data.input_shape)
        got = list(manifest.run.data.input_shape)
        if got != want:
            raise refuse(f"input shape mismatch: encoder takes {got}, local data is {want}")
        try:
            encoder = OnnxEncoder(artifact, manifest, threads=self.threads, expected_sha256=digest)
        except Exception as exc:  # onnxruntime raises its own types for a corrupt graph
            if out_of_memory(exc):
                raise OutOfMemory(f"opening the encoder of release {release_id}", exc) from exc
            raise refuse(f"not a loadable ONNX encoder ({type(exc).__name__}: {str(exc)[:200]})") from None
        try:  # named channels are taken by name: a log's columns in the run's order, whatever the file's
            adapt = _local_to_run(self.data, manifest)
        except ValueError as exc:
            raise refuse(f"channel mismatch: {exc}") from None
        if adapt is not None:
            log.info("local data (channels %s, normalized with %s) to the encoder's (channels %s, %s): converting",
                     self.data.channel_names, self.data.normalization, manifest.run.data.channel_names,
                     manifest.run.data.normalization)
        log.info("installing release %s: features of %d + %d local samples, then a %s head", release_id,
                 self.data.num_train, self.data.num_test, self.head_kind)
        try:
            start = time.perf_counter()
            f_train = _features(encoder, _apply(adapt, self.data.x_train))
            f_test = _features(encoder, _apply(adapt, self.data.x_test))
            feature_seconds = time.perf_counter() - start
        except Exception as exc:
            if out_of_memory(exc):
                raise OutOfMemory(f"computing features with the encoder of release {release_id}", exc) from exc
            raise refuse(f"encoder failed on local data ({type(exc).__name__}: {str(exc)[:200]})") from None
        if not (np.isfinite(f_train).all() and np.isfinite(f_test).all()):
            raise refuse("encoder produced NaN or Inf features on local data")
        latency_ratio = self._latency_ratio(encoder, adapt)

        labels, to_labels = label_space_for(self.data.class_names, manifest.run.data.class_names)
        y_train, y_test = to_labels[self.data.y_train], to_labels[self.data.y_test]
        # named by content like the encoder; a refused release's file is removed again
        heads_path = None
        keep = self.record.global_heads_file if self.record else None
        if global_heads is not None:
            heads_path = self.state_dir / f"global-heads-{_sha(global_heads)[:16]}.safetensors"
            write_bytes(heads_path, global_heads)
        # the fit child runs beside this process: while it does, this one holds no encoder session
        # (the new one is opened again from its bytes after, the installed ones from disk if the fit
        # fails), so the device's peak is this agent's floor plus the child (docs/BENCHMARKS.md,
        # "A whole head device in 150 MB")
        del encoder
        try:
            with self._sessions_closed():
                head_bytes, head_name, fit_seconds = self._head_for(manifest, digest, f_train, y_train, labels,
                                                                    refuse, heads_path)
        except (ReleaseRefused, MemoryError):  # MemoryError: OutOfMemory, the release is tried again
            if heads_path is not None and heads_path.name != keep:
                heads_path.unlink(missing_ok=True)
            raise
        try:
            encoder = OnnxEncoder(artifact, manifest, threads=self.threads, expected_sha256=digest)
        except Exception as exc:  # it opened a moment ago: memory may be short now, nothing else differs
            if out_of_memory(exc):
                raise OutOfMemory(f"opening the encoder of release {release_id} again", exc) from exc
            raise
        # named by its own content, not the encoder's: a release that keeps the encoder and changes
        # the preprocessing fits another head, which must not overwrite the one kept for a rollback
        head_path = self.state_dir / f"head-{_sha(head_bytes)[:16]}.onnx"
        write_bytes(head_path, head_bytes)
        head = OnnxHead(head_path, self.threads).fit()
        notifier().watchdog()  # the head is fitted and saved: progress

        pred_train = head.predict(f_train)
        pred_test = head.predict(f_test)
        correct = int((pred_test == y_test).sum())
        metrics = HeadFit(
            release_id=release_id, head=head_name, accuracy=correct / max(1, self.data.num_test), eval_correct=correct,
            num_train=int(self.data.num_train), num_test=int(self.data.num_test),
            train_accuracy=float((pred_train == y_train).mean()) if self.data.num_train else None,
            fit_seconds=fit_seconds, feature_seconds=feature_seconds, latency_ratio=latency_ratio)
        enc_name = f"encoder-{digest[:16]}.onnx"
        write_bytes(self.state_dir / enc_name, artifact)
        old = self.record
        proof_file = self._keep_proof(proof)
        record = InstalledRelease(
            release_id=release_id, manifest=manifest, encoder_file=enc_name, encoder_sha256=digest,
            head_file=head_path.name, head_sha256=_sha(head_bytes), metrics=metrics,
            global_heads_file=heads_path.name if heads_path is not None else None,
            global_heads_sha256=_sha(global_heads) if global_heads is not None else None,
            installed=time.time(), sequence=sequence, proof_file=proof_file,
            previous=old.model_copy(update={"previous": None}) if old is not None else None)
        self._switch(record, old, (encoder, head, adapt))
        log.info("release %s installed: %s head, held-out accuracy %.4f (%d/%d), fit %.2f s", release_id, head_name,
                 metrics.accuracy, correct, self.data.num_test, fit_seconds)
        return metrics

    def _latency_ratio(self, encoder: OnnxEncoder, adapt: _LocalToRun | None) -> float | None:
        """The new ``encoder``'s time per sample over the installed one's, on the same local
        samples, timed in alternation (:func:`interleaved_ratio`): the rollout's latency gate
        compares the two encoders under the same load, which a time measured at each install
        (minutes apart, another process busy or not) cannot. None without an installed encoder
        or samples, or when the old one fails now (its failure is not this release's)."""
        if self.encoder is None or self.record is None:
            return None
        x = self.data.x_test if len(self.data.x_test) else self.data.x_train
        if not len(x):
            return None
        x = x[:LATENCY_SAMPLES]
        old, old_adapt = self.encoder, self._adapt
        try:
            return interleaved_ratio(lambda: encoder.features(_apply(adapt, x)),
                                     lambda: old.features(_apply(old_adapt, x)))
        except Exception as exc:  # onnxruntime's own types; the gate then falls back to the install times
            log.warning("timing the installed encoder beside the new one failed (%s); no latency ratio",
                        type(exc).__name__)
            return None

    def _switch(self, record: InstalledRelease, old: InstalledRelease | None,
                loaded: tuple[OnnxEncoder, OnnxHead, _LocalToRun | None] | None = None) -> None:
        """Make ``record`` the installed release, on disk and in memory as one step, and remove
        what ``old`` held that ``record`` does not: the manifest beside the encoder, then the
        record (the switch, written last), then the ``loaded`` encoder, head and input
        renormalization in memory (None: the ones in use stay). A stop (SIGTERM) waits for it:
        manifest and record always agree."""
        with uninterruptible():
            # for `edgepfl predict --encoder <state>/encoder-….onnx`, which reads the manifest beside it
            write_json(self.state_dir / "manifest.json", record.manifest.model_dump(mode="json"))
            write_json(self.state_dir / STATE_FILE, record.model_dump(mode="json"))  # the switch: written last
            self.record = record
            if loaded is not None:
                self.encoder, self.head, self._adapt = loaded
            self._remove_old(old, record)

    @contextlib.contextmanager
    def _sessions_closed(self) -> Iterator[None]:
        """Close the installed release's sessions and give freed memory back to the system for
        the body (a head fit in a child process); reopen them from disk if it raises (the
        installed release stays in use), leave them closed if it returns (the caller
        switches to the new release's)."""
        held = self.encoder is not None or self.head is not None
        self.encoder = self.head = None
        head_fit.return_freed_memory()
        try:
            yield
        except BaseException:
            if held:
                try:
                    installed = open_installed(self.state_dir, threads=self.threads,
                                               coordinator_key=self.coordinator_key)
                    self.encoder, self.head = installed.encoder, installed.head
                except (OSError, ValueError, MemoryError) as exc:  # the agent restarts into load()
                    log.error("cannot reopen the installed release %s after a failed install: %s",
                              self.release_id, exc)
            raise

    def _keep_proof(self, proof: bytes | None) -> str | None:
        """Write a release's proof (named by its content, so a crash before the record switch
        leaves the installed release's own proof in place); its file name."""
        if proof is None:
            return None
        name = f"release-{_sha(proof)[:16]}.proof"
        write_bytes(self.state_dir / name, proof)
        return name

    def _adopt(self, manifest: ReleaseManifest, sequence: int | None, proof: bytes | None) -> HeadFit:
        """The installed encoder and global heads again, in a newer release that computes alike (a
        coordinator that released an unchanged state): recorded under the new release, the head kept as fitted,
        so that the agent names the release it has as the coordinator does (PROTOCOL.md §12)."""
        old = self.record
        assert old is not None  # only called with a release installed
        metrics = old.metrics.model_copy(update={"release_id": manifest.release_id})
        record = old.model_copy(update={"release_id": manifest.release_id, "manifest": manifest, "sequence": sequence,
                                        "metrics": metrics, "installed": time.time(),
                                        "proof_file": self._keep_proof(proof)})
        self._switch(record, old)
        log.info("release %s carries the installed encoder of %s: recorded under it, head kept", manifest.release_id,
                 old.release_id)
        return metrics

    def restore_release(self, manifest: ReleaseManifest, sha256: str, *, sequence: int | None,
                        expires: float | None = None, proof: bytes | None = None) -> HeadFit:
        """Install again, under a new ``sequence``, a release this device holds: the installed one
        (recorded under the new sequence) or the one before it (switched back to, its encoder and
        head as they were: no download, no fit). What a rollback sends (protocol 1.8); a release
        with a sequence below this one's, the release rolled back from included, is refused from
        then on. Raises :class:`ReleaseRefused` when this device holds no such release, or for the
        reasons :meth:`install_release` gives about a sequence, an expiry or a missing signature.
        """
        release_id = manifest.release_id
        heads = manifest.global_heads.sha256 if manifest.global_heads is not None else None

        def refuse(reason: str) -> ReleaseRefused:
            log.warning("release %s to restore refused: %s; keeping %s", release_id, reason, self.release_id)
            return ReleaseRefused(f"release {release_id} refused: {reason}")

        if manifest.encoder.sha256 != sha256:
            raise refuse(f"sha256 mismatch: release says {sha256[:16]}…, manifest {manifest.encoder.sha256[:16]}…")
        refusal = self._release_refusal(sequence, expires, sha256)
        if refusal is not None:
            raise refuse(refusal)
        if self.coordinator_key is not None and proof is None:
            raise refuse("unsigned")
        current = self.record
        if current is not None and self.ready and current.held(manifest, heads):
            return self._adopt(manifest, sequence, proof)
        previous = current.previous if current is not None else None
        if previous is None or not previous.held(manifest, heads):
            raise refuse("not held: neither the installed release nor the one before it (its encoder with this "
                         "manifest's preprocessing, labels and method)")
        try:
            enc_bytes = (self.state_dir / previous.encoder_file).read_bytes()
            if _sha((self.state_dir / previous.head_file).read_bytes()) != previous.head_sha256:
                raise ValueError(f"{previous.head_file} does not match its record")
            encoder = OnnxEncoder(enc_bytes, manifest, threads=self.threads, expected_sha256=sha256)
            head = OnnxHead(self.state_dir / previous.head_file, self.threads).fit()
        except Exception as exc:
            if out_of_memory(exc):
                raise OutOfMemory(f"opening the kept release {release_id}", exc) from exc
            raise refuse(f"not held: the kept files do not open ({type(exc).__name__}: {str(exc)[:200]})") from None
        metrics = previous.metrics.model_copy(update={"release_id": release_id})
        record = previous.model_copy(update={"release_id": release_id, "manifest": manifest, "sequence": sequence,
                                             "metrics": metrics, "installed": time.time(),
                                             "proof_file": self._keep_proof(proof), "previous": None})
        assert current is not None  # a previous release is kept only beside an installed one
        self._switch(record, current, (encoder, head, _local_to_run(self.data, manifest, installed=True)))
        log.info("release %s restored from the kept files (sequence %s), release %s removed; held-out accuracy %.4f",
                 release_id, sequence, current.release_id, metrics.accuracy)
        return metrics

    def new_head(self, release: HeadRelease) -> HeadEstimator:
        """The unfitted head this device fits on an encoder ``release``, from the release's method
        (:func:`.head_fit.new_head`; the agent fits it in a child process, :meth:`_head_for`).

        Raises ``ValueError`` (or ``KeyError`` for an unknown method) when the method
        offers no head of this device's kind or cannot build it here.
        """
        return head_fit.new_head(release, self.head_kind, self.head_params)

    def _head_for(self, manifest: ReleaseManifest, encoder_sha: str, f_train: np.ndarray, y_train: np.ndarray,
                  labels: LabelSpace, refuse: Callable[[str], ReleaseRefused],
                  global_heads: Path | None = None) -> tuple[bytes, str, float]:
        """(ONNX bytes, kind, seconds its fit took) of the head for this encoder: the offline one
        if it matches (0 s: fitted elsewhere), else fitted on ``y_train`` (labels in ``labels``,
        which the head records) around the release's ``global_heads`` file where the head needs
        it, timed by the child that fits it (its start-up and imports are not the fit)."""
        offline = self.state_dir / OFFLINE_HEAD
        if offline.is_file():
            try:
                cand = OnnxHead(offline, self.threads).fit()
            except Exception as exc:
                log.warning("ignoring %s: %s", offline, exc)
            else:
                if cand.encoder_sha256_ != encoder_sha or cand.n_features_in_ != f_train.shape[1]:
                    log.warning("%s was fitted for another encoder (%s); not used", offline,
                                (cand.encoder_sha256_ or "unknown")[:12])
                elif not _names_agree(cand, labels):
                    log.warning("%s names its classes %s, this device's labels are %s; not used", offline,
                                cand.class_names_, list(labels.names))
                else:
                    log.info("using the offline %s head %s", cand.head_kind_, offline)
                    return offline.read_bytes(), cand.head_kind_, 0.0
        if self.head_kind == OFFLINE_HEAD_KIND:
            raise refuse(f"head kind {OFFLINE_HEAD_KIND!r} needs {offline} fitted for encoder {encoder_sha[:12]} "
                         "(edgepfl fit-head --encoder … --out head.onnx)")
        release = HeadRelease.from_manifest(manifest)
        request = head_fit.FitRequest(
            method=release.method, method_options=dict(release.method_options), head_kind=self.head_kind,
            head_params=self.head_params, label_names=list(labels.names), label_kind=labels.kind,
            encoder_sha256=encoder_sha, global_heads=str(global_heads) if global_heads is not None else None)
        try:  # in a child process: the fitting libraries never stay in this one (the module's docstring)
            data, seconds = head_fit.fit_in_child(request, f_train, y_train, self.state_dir)
        except head_fit.FitRefused as exc:
            raise refuse(str(exc)) from None
        return data, self.head_kind, seconds

    def remove_strays(self) -> list[str]:
        """Delete the release files no installed release uses: those of an install that a
        stop or a crash cut short (its record was never written, so it is not installed).
        Nothing when a record is there but was not loaded (unusable: left for the operator).
        Returns the names removed."""
        if self.record is None and (self.state_dir / STATE_FILE).exists():
            return []
        keep = self.record.files() if self.record else set()
        removed = []
        for pattern in STRAY_PATTERNS:
            for path in sorted(self.state_dir.glob(pattern)):
                if path.name not in keep and path.is_file():
                    path.unlink()
                    removed.append(path.name)
        if removed:
            log.info("removed %d files of an install that did not finish: %s", len(removed), ", ".join(removed))
        return removed

    def _remove_old(self, old: InstalledRelease | None, current: InstalledRelease) -> None:
        """Delete the files of the ``old`` record that the ``current`` one does not use."""
        if old is None:
            return
        for name in old.files() - current.files():
            (self.state_dir / name).unlink(missing_ok=True)

    # ---------------------------------------------------------------- serving
    def _installed(self) -> tuple[OnnxEncoder, OnnxHead]:
        """The installed encoder and head; RuntimeError before the first release."""
        if self.encoder is None or self.head is None:
            raise RuntimeError("no encoder release installed yet")
        return self.encoder, self.head

    def features(self, x: np.ndarray) -> np.ndarray:
        """Encoder features of inputs (N, *input_shape) normalized like the local data."""
        encoder, _ = self._installed()
        return encoder.features(_apply(self._adapt, x))

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Class probabilities (N, K) for normalized inputs (N, *input_shape); columns: :attr:`classes`."""
        _, head = self._installed()
        return head.predict_proba(self.features(x))

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted labels for normalized inputs (N, *input_shape)."""
        _, head = self._installed()
        return head.predict(self.features(x))

    @property
    def classes(self) -> np.ndarray:
        _, head = self._installed()
        return head.classes_

    @property
    def class_names(self) -> list[str]:
        """The name of each of :attr:`classes` (column of :meth:`predict_proba`), as the head records it."""
        _, head = self._installed()
        return list(head.class_names_ or [str(c) for c in head.classes_])


@dataclass(frozen=True)
class InstalledModel:
    """The installed release opened for inference: its record, encoder and head."""

    record: InstalledRelease
    encoder: OnnxEncoder
    head: OnnxHead


def read_installed(state_dir: str | Path) -> InstalledRelease:
    """The installed release's record (``release.json``) in a head agent's state directory.

    Raises ``FileNotFoundError`` when nothing was installed yet and ``ValueError`` when
    the record is not one.
    """
    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no release installed in {state_dir}")
    try:  # pydantic-core's parser: bounded nesting, like every reader of bytes we did not just write
        return InstalledRelease.model_validate_json(path.read_bytes())
    except ValidationError as exc:
        raise ValueError(f"{path}: {first_validation_error(exc)}") from None


def open_installed(state_dir: str | Path, *, threads: int | None = None,
                   coordinator_key: Ed25519PublicKey | None = None) -> InstalledModel:
    """Open the release installed in ``state_dir`` (the head agent's, or ``edgepfl serve``'s
    view of it): encoder and head checked against the sha256s their record names, and, with
    ``coordinator_key``, the release re-verified against the coordinator's signature.

    Raises ``FileNotFoundError`` when nothing was installed yet (or a file the record names
    is gone: a newer install removed it) and ``ValueError`` when a file does not match it.
    """
    state_dir = Path(state_dir)
    record = read_installed(state_dir)
    enc_bytes = (state_dir / record.encoder_file).read_bytes()
    head_bytes = (state_dir / record.head_file).read_bytes()
    if _sha(head_bytes) != record.head_sha256:
        raise ValueError(f"{record.head_file} does not match {STATE_FILE}")
    if coordinator_key is not None:
        _check_proof(state_dir, record, enc_bytes, coordinator_key)
    encoder = OnnxEncoder(enc_bytes, record.manifest, threads=threads, expected_sha256=record.encoder_sha256)
    head = OnnxHead(state_dir / record.head_file, threads).fit()  # named by content: the bytes checked
    return InstalledModel(record, encoder, head)


def _check_proof(state_dir: Path, record: InstalledRelease, encoder: bytes, key: Ed25519PublicKey) -> None:
    """Re-verify the installed release as received: the coordinator's signature over its
    header, which binds the encoder bytes (through the body's sha256) and the sequence."""
    name = record.proof_file
    path = state_dir / name if name else None
    if path is None or not path.is_file():
        raise ValueError("no proof file: the installed release cannot be verified against the coordinator key")
    proof = path.read_bytes()
    signed, signature = proof[:-SIGNATURE_BYTES], proof[-SIGNATURE_BYTES:]
    try:
        header = Header.model_validate_json(signed[8:])
        meta = ReleaseMeta.model_validate(header.meta)
    except ValueError as exc:
        raise ValueError(f"{path.name} is not a release header ({exc})") from None
    reason = verify_signed_part(signed, signature, header.signer, key)
    if reason is not None:
        raise ValueError(f"installed release fails its signature check: {reason}")
    global_heads = _stored_global_heads(state_dir, record)
    if meta.delta is None and not meta.restore:  # a whole release: its body was these very bytes
        bound = encode_body(release_tensors(encoder, global_heads)).sha256 == header.body_sha256
    else:  # its body was a delta or nothing: the signed meta names the artifact's and the heads' hashes
        heads = meta.manifest.global_heads  # kept only where the release carried them (and the head used them)
        bound = global_heads is None or (heads is not None and heads.sha256 == _sha(global_heads))
    if not bound or _sha(encoder) != meta.sha256 or meta.sha256 != record.encoder_sha256 \
            or meta.sequence != record.sequence:
        raise ValueError("installed encoder or sequence differs from the signed release")


def _stored_global_heads(state_dir: Path, record: InstalledRelease) -> bytes | None:
    """The installed release's global heads bytes, checked against their record, or None."""
    name = record.global_heads_file
    if not name:
        return None
    data = (state_dir / name).read_bytes()
    if _sha(data) != record.global_heads_sha256:
        raise ValueError(f"{name} does not match {STATE_FILE}")
    return data


def _names_agree(head: OnnxHead, labels: LabelSpace) -> bool:
    """Whether an offline head's labels mean what this device's labels mean.

    A head that records no names predates them; it was fitted in the federation's numbering.
    """
    if head.class_names_ is None:
        return labels.kind == FEDERATION
    try:
        return head.class_names_ == labels.column_names(head.classes_)
    except ValueError:
        return False


def _renormalization(local: dict[str, Any], manifest: ReleaseManifest) -> ChannelAffine | None:
    """The per-channel map turning the local normalization into the encoder's
    (:func:`edgepfl.data.preprocess.conversion`), or None if they agree or either is unknown."""
    if not local or not local.get("mean") or manifest.run.data.normalization is None:
        return None
    try:
        return conversion(local, manifest.run.data)
    except ValueError:  # another channel count: the input shape check refuses the release
        return None


@dataclass(frozen=True)
class _LocalToRun:
    """Local inputs as a release's encoder takes them: channels in the run's order, then the
    run's normalization (either step may be absent)."""

    order: np.ndarray | None
    affine: ChannelAffine | None

    def apply(self, x: np.ndarray) -> np.ndarray:
        if self.order is not None:
            x = x[:, self.order]
        return x if self.affine is None else self.affine.apply(x)


def _local_to_run(data: ClientData, manifest: ReleaseManifest, *, installed: bool = False) -> _LocalToRun | None:
    """How this device's data becomes ``manifest``'s encoder's input; None when it already is.
    Raises ``ValueError`` when the data's channel names are not the run's, unless the release
    is ``installed`` already (it passed this check then; the data cannot have changed)."""
    try:
        order = channel_order(data.channel_names, manifest.run.data.channel_names)
    except ValueError:
        if not installed:
            raise
        order = None
    norm = data.normalization
    if order is not None and norm.get("mean") and norm.get("std"):
        norm = {**norm, "mean": [norm["mean"][i] for i in order], "std": [norm["std"][i] for i in order]}
    affine = _renormalization(norm, manifest)
    return None if order is None and affine is None else _LocalToRun(order, affine)


def _apply(adapt: _LocalToRun | None, x: np.ndarray) -> np.ndarray:
    return x if adapt is None else adapt.apply(x)


#: samples per step of an install's feature pass; each step done feeds systemd's watchdog
FEATURE_STEP = 1024


def _features(encoder: OnnxEncoder, x: np.ndarray) -> np.ndarray:
    """``encoder.features(x)`` in steps, feeding the service watchdog after each: an install
    that takes minutes on a slow board is alive while it advances, and one that hangs is not."""
    if len(x) <= FEATURE_STEP:
        features = encoder.features(x)
        notifier().watchdog()
        return features
    parts = []
    for i in range(0, len(x), FEATURE_STEP):
        parts.append(encoder.features(x[i : i + FEATURE_STEP]))
        notifier().watchdog()
    return np.concatenate(parts)


#: local samples an install times both encoders on, and how many times each in alternation
LATENCY_SAMPLES = 64
LATENCY_REPEATS = 5


def interleaved_ratio(new: Callable[[], object], old: Callable[[], object], repeats: int = LATENCY_REPEATS) -> float:
    """Median time of ``new`` over median time of ``old``, each run ``repeats`` times in
    alternation (the order swapped every repeat, after one untimed warm-up each): load that
    comes and goes during the measurement falls on both alike."""
    new(), old()
    times: dict[int, list[float]] = {0: [], 1: []}
    calls = (new, old)
    for i in range(repeats):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            start = time.perf_counter()
            calls[which]()
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]) / max(statistics.median(times[1]), 1e-9)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = ["HeadRuntime", "InstalledModel", "InstalledRelease", "ReleaseRefused", "open_installed", "read_installed"]
