"""Encoder releases: export the frozen encoder of the current server state and wrap
it in a ``release`` message (manifest + sha256 + the ONNX bytes and, when the method
shares parameters outside the encoder, the global heads file's bytes; a sequence number
and an expiry; signed with the coordinator's key when it has one) for head-tier agents,
and publish it so that agents joining later, after this coordinator exited too, get it.
From the second release of a run on, the same release also goes out as a delta against the
previous one (protocol 1.7) to the head agents that have that one installed."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.atomic import write_bytes, write_json
from edgepfl.codecs import CodecSpec
from edgepfl.config import RunConfig
from edgepfl.methods import ServerState
from edgepfl.protocol import (
    Message,
    MessageType,
    ProtocolError,
    ReleaseDelta,
    ReleaseMeta,
    ReleaseRef,
    bounded_json,
    decode,
    encode,
)
from edgepfl.protocol.manifest import release_tensors
from edgepfl.protocol.signing import Signer
from edgepfl.release_delta import ReleaseDeltaParts, make_release_delta
from edgepfl.state import CheckpointMeta

from ..fleet import SENDER, Fleet
from .head_releases import DeltaRelease, RestoreRelease

log = logging.getLogger("edgepfl.coordinator")

SEQUENCE_FILE = "sequence.json"
#: the frame of the last release published (what a resumed coordinator names and sends again)
CURRENT_FILE = "current.frame"
#: the frame of the release before it (what a rollback goes back to)
PREVIOUS_FILE = "previous.frame"
#: the frame of the release before that one: what ``previous`` becomes again when a rollback
#: goes back to it (a release halted at a stage and rolled back leaves the fleet where it was,
#: and the operator's rollback still has somewhere to go)
EARLIER_FILE = "earlier.frame"
#: how many retained part topics the last published release occupies (0: retained whole)
PUBLISHED_FILE = "published.json"
#: the random stream of a release delta's stochastic rounding (with the run's seed and the round)
RELEASE_DELTA_STREAM = 0x5E1EA5E


def next_sequence(releases_dir: Path, now: float | None = None) -> int:
    """The next release's sequence number, recorded in ``releases_dir`` before it is used.

    The wall clock in ms, and at least one more than the last number this run directory
    used: monotonic across restarts of a run (the record) and across fresh run
    directories of the federation (the clock), as long as the clock is not set back
    past the last release; agents refuse a release that is not above the one they have.
    """
    path = Path(releases_dir) / SEQUENCE_FILE
    last = bounded_json.loads(path.read_text())["last"] if path.is_file() else -1
    sequence = max(int((time.time() if now is None else now) * 1000), int(last) + 1)
    write_json(path, {"last": sequence})
    return sequence


@dataclass(frozen=True)
class BuiltRelease:
    """A release ready to publish."""

    release_id: str
    #: the whole release: retained, and sent to head agents without its delta's base
    frame: bytes
    #: the same release as a delta against the previous one, for head agents that have it
    delta: DeltaRelease | None = None

    def sizes(self) -> str:
        """``0.74 MB`` or ``0.74 MB, 0.10 MB as a delta``: for the progress line."""
        delta = f", {len(self.delta.frame) / 1e6:.2f} MB as a delta" if self.delta is not None else ""
        return f"{len(self.frame) / 1e6:.2f} MB{delta}"


def build_release(state: ServerState, meta: CheckpointMeta, releases_dir: Path, config: RunConfig,
                  signer: Signer | None = None) -> BuiltRelease:
    """Export to ``releases_dir/<round>/`` and build the release's frames.

    After the first release of a run directory, with ``compression.release_delta`` set, what
    is released is the previous release plus the exported encoder's weight changes,
    quantized (:mod:`edgepfl.release_delta`), and :attr:`BuiltRelease.delta` carries it as a
    delta against the previous release; the whole frame carries the same artifact."""
    from edgepfl.export.onnx_export import export_state

    out = Path(releases_dir) / f"round-{meta.round:04d}"
    previous = published_release(releases_dir)
    made: list[ReleaseDeltaParts] = []
    rebase = None
    codec = config.compression.release_delta
    if previous is not None and codec != "none":
        base_meta, base_artifact = previous
        spec = CodecSpec.from_name(codec, block=config.compression.block)
        rng = np.random.default_rng([config.seed, max(meta.round, 0), RELEASE_DELTA_STREAM])

        def rebase(exported: bytes) -> bytes:
            parts = make_release_delta(base_artifact, exported, spec, rng)
            if parts is None:
                log.info("round %d's encoder differs from release %s outside its weights: released whole",
                         meta.round, base_meta.release_id)
                return exported
            made.append(parts)
            return parts.artifact

    export_state(state, meta, out, rebase=rebase)
    frame, meta_msg, tensors = _whole_release(out, releases_dir, config, meta.round, signer)
    manifest = meta_msg.manifest
    if not made or previous is None:
        return BuiltRelease(manifest.release_id, frame)
    parts, base_meta = made[0], previous[0]
    delta_meta = meta_msg.model_copy(update={"delta": ReleaseDelta(
        base=base_meta.ref(), base_sha256=base_meta.sha256, runs=list(parts.runs), codec=parts.encoded.header)})
    delta_tensors = {**parts.encoded.arrays(), **{k: v for k, v in tensors.items() if k == "global_heads"}}
    delta_frame = encode(MessageType.RELEASE, federation=config.federation, sender=SENDER, round=meta.round,
                         meta=delta_meta, tensors=delta_tensors, signer=signer)
    log.info("release %s: %d bytes whole, %d as a %s delta against %s (%.1f %%)", manifest.release_id, len(frame),
             len(delta_frame), codec, base_meta.release_id, 100 * len(delta_frame) / len(frame))
    return BuiltRelease(manifest.release_id, frame, DeltaRelease(base_meta.ref(), delta_frame, codec))


def _whole_release(export_dir: Path, releases_dir: Path, config: RunConfig, round: int,
                   signer: Signer | None) -> tuple[bytes, ReleaseMeta, dict[str, np.ndarray]]:
    """The whole release frame of an export directory, its meta and tensors (next sequence)."""
    from edgepfl.export.onnx_export import read_global_heads, read_release

    manifest, artifact = read_release(export_dir)
    # the global heads: what a DualFed / FedPick head is fitted around (PROTOCOL.md §12)
    tensors = release_tensors(artifact, read_global_heads(export_dir, manifest))
    now = time.time()
    meta_msg = ReleaseMeta(release_id=manifest.release_id, manifest=manifest,
                           sha256=hashlib.sha256(artifact).hexdigest(), size_bytes=len(artifact),
                           sequence=next_sequence(Path(releases_dir), now), expires=now + config.release_ttl_s)
    frame = encode(MessageType.RELEASE, federation=config.federation, sender=SENDER, round=round,
                   meta=meta_msg, tensors=tensors, signer=signer)
    return frame, meta_msg, tensors


def release_of_export(export_dir: Path, releases_dir: Path, config: RunConfig,
                      signer: Signer | None = None) -> BuiltRelease:
    """A release of an encoder exported before (``edgepfl export``, or another run's): sent
    whole, as the round its manifest names."""
    from edgepfl.export.onnx_export import read_release

    manifest, _ = read_release(export_dir)
    frame, _, _ = _whole_release(Path(export_dir), releases_dir, config, manifest.round, signer)
    return BuiltRelease(manifest.release_id, frame)


@dataclass(frozen=True)
class RollbackRelease:
    """A release published again under a new sequence: whole (retained, and for agents that
    do not hold it) and as a restore (for those that do)."""

    ref: ReleaseRef
    frame: bytes
    restore: bytes
    round: int
    #: the release ids whose holders keep this release: itself, and the releases installed after it
    holders: frozenset[str]


def rollback_release(frame: bytes, releases_dir: Path, config: RunConfig, signer: Signer | None = None,
                     rolled_back: Iterable[str] = ()) -> RollbackRelease:
    """``frame``'s release again, with the next sequence and a fresh expiry (PROTOCOL.md §12,
    "Rollbacks"): installed, it makes every release published since refused as a rollback.
    ``rolled_back``: the releases installed after it that head agents are going back from (the
    one published last is one of them)."""
    current = fleet_current(releases_dir)
    holders = frozenset(rolled_back) | ({current.release_id} if current is not None else set())
    message = decode(frame)
    meta = message.meta_as(ReleaseMeta)
    now = time.time()
    again = meta.model_copy(update={"sequence": next_sequence(Path(releases_dir), now), "delta": None,
                                    "expires": now + config.release_ttl_s})
    round = message.header.round

    def framed(m: ReleaseMeta, tensors: dict[str, np.ndarray]) -> bytes:
        return encode(MessageType.RELEASE, federation=config.federation, sender=SENDER, round=round, meta=m,
                      tensors=tensors, signer=signer)

    return RollbackRelease(again.ref(), framed(again, dict(message.tensors)),
                           framed(again.model_copy(update={"restore": True}), {}), round,
                           holders | {meta.release_id})


def published_frame(releases_dir: Path, previous: bool = False) -> bytes | None:
    """The whole frame of the last release published from ``releases_dir`` (or, with
    ``previous``, of the one before it); None when there is none."""
    return _frame(Path(releases_dir) / (PREVIOUS_FILE if previous else CURRENT_FILE))


def published_release(releases_dir: Path) -> tuple[ReleaseMeta, bytes] | None:
    """The meta and artifact of the last release published from ``releases_dir`` (None: none,
    or a record that does not decode)."""
    path = Path(releases_dir) / CURRENT_FILE
    if not path.is_file():
        return None
    try:
        message = decode(path.read_bytes())
        artifact = message.tensors["artifact"]
        return message.meta_as(ReleaseMeta), artifact.tobytes()
    except (ProtocolError, KeyError, ValueError) as exc:
        log.warning("the last release's record %s is unreadable (%s): the next release is sent whole", path, exc)
        return None


def publish_release(fleet: Fleet, release: BuiltRelease | RollbackRelease, round: int, releases_dir: Path,
                    have: Iterable[str] = ()) -> int:
    """Publish a release through ``fleet``, named by reference in the coordinator's
    presence; returns the retained part topics it occupies.

    The whole frame and the count are recorded in ``releases_dir`` (atomically, after
    publishing): the next release, of this session or of a restarted coordinator of the
    run, clears the parts it does not overwrite and is made a delta against it, and a
    resumed coordinator names the release again (:func:`resume_release`). The release it
    replaces is kept as the previous one (what ``edgepfl release rollback`` goes back to),
    and the one before that as well: a rollback to the previous release makes that one the
    previous again (after a release halted at its canary, the fleet is where it was before
    it, with the same release to go back to). Head agents that do not hold what a rollback
    goes back to are sent it whole.
    """
    releases_dir = Path(releases_dir)
    path = releases_dir / PUBLISHED_FILE
    earlier = int(bounded_json.loads(path.read_text())["parts"]) if path.is_file() else 0
    ref = decode(release.frame).meta_as(ReleaseMeta).ref()  # named in the presence (PROTOCOL.md §12)
    if isinstance(release, RollbackRelease):
        parts = fleet.releases.publish(release.frame, round, earlier_parts=earlier, ref=ref,
                                      restore=RestoreRelease(release.restore, release.holders), have=have)
        previous, earlier_frame = published_frame(releases_dir, previous=True), _frame(releases_dir / EARLIER_FILE)
        if previous is not None and _release_id(previous) == ref.release_id and earlier_frame is not None:
            write_bytes(releases_dir / PREVIOUS_FILE, earlier_frame)
        else:
            (releases_dir / PREVIOUS_FILE).unlink(missing_ok=True)
        (releases_dir / EARLIER_FILE).unlink(missing_ok=True)
    else:
        parts = fleet.releases.publish(release.frame, round, earlier_parts=earlier, ref=ref, delta=release.delta,
                                      have=have)
        if (current := published_frame(releases_dir)) is not None:
            if (previous := published_frame(releases_dir, previous=True)) is not None:
                write_bytes(releases_dir / EARLIER_FILE, previous)
            write_bytes(releases_dir / PREVIOUS_FILE, current)
    write_bytes(releases_dir / CURRENT_FILE, release.frame)
    write_json(path, {"parts": parts, "round": round})
    return parts


def _frame(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _release_id(frame: bytes) -> str:
    return decode(frame).meta_as(ReleaseMeta).release_id


def fleet_current(releases_dir: Path) -> ReleaseRef | None:
    """The release published last from ``releases_dir``, by reference."""
    frame = published_frame(releases_dir)
    return decode(frame).meta_as(ReleaseMeta).ref() if frame is not None else None


def resume_release(fleet: Fleet, releases_dir: Path,
                   on_current: Callable[[ReleaseRef], None] | None = None) -> ReleaseRef | None:
    """Give a coordinator's ``fleet`` the fleet's current release: as this run published it
    before a restart (still retained at the broker), or, for a run that has published none,
    the one the broker retains from an earlier run (which the head agents run; it is adopted
    as it arrives, :meth:`~.channel.ReleaseChannel.adopt_retained`). Either way the presence
    names it, head agents that lack it are sent it, the next release is a delta against it,
    a staged rollout's gate pairs the devices' reports on it and a halt rolls back to it.
    ``on_current`` is told the release once it is known. Returns the run's own release, or
    None (none yet, or one still to be adopted)."""
    path, frame_path = Path(releases_dir) / PUBLISHED_FILE, Path(releases_dir) / CURRENT_FILE
    if not (path.is_file() and frame_path.is_file()):
        fleet.releases.adopt_retained(lambda frame, message, parts: _adopt(fleet, Path(releases_dir), frame, message,
                                                                           parts, on_current))
        return None
    frame = frame_path.read_bytes()
    ref = decode(frame).meta_as(ReleaseMeta).ref()
    fleet.releases.resume(frame, int(bounded_json.loads(path.read_text()).get("round", -1)), ref)
    log.info("the run's current release is %s (published before the restart)", ref.release_id)
    if on_current is not None:
        on_current(ref)
    return ref


def _adopt(fleet: Fleet, releases_dir: Path, frame: bytes, message: Message, parts: int,
           on_current: Callable[[ReleaseRef], None] | None) -> None:
    """Record an earlier run's retained release as this run's current one (the frame, then
    the record: the commit), as if this run had published it: its ``parts`` retained topics
    are the ones the next release clears what it does not overwrite of."""
    ref = message.meta_as(ReleaseMeta).ref()
    write_bytes(releases_dir / CURRENT_FILE, frame)
    write_json(releases_dir / PUBLISHED_FILE, {"parts": parts, "round": message.header.round})
    fleet.releases.resume(frame, message.header.round, ref, announce=True)
    if on_current is not None:
        on_current(ref)
