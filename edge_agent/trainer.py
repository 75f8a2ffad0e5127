"""Trainer tier: full local training for any registered method (torch, CPU or CUDA).

:class:`TrainerRuntime` turns one task message into one update — the same object
serves the MQTT agent process and the in-process simulator, so both run the
identical method code. torch is imported here, never by ``edge_agent/__init__``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from edgepfl._torch import nn, torch
from edgepfl.agent_config import DEFAULT_MAX_MODEL_PARAMS
from edgepfl.aggregation import grid_contribution, ring_vector
from edgepfl.atomic import read_tensors, write_json, write_tensors
from edgepfl.codecs import CodecError, CodecHeader, CodecSpec, Encoded, ErrorFeedback, decode
from edgepfl.data import ClientData, ClientTensors
from edgepfl.data.preprocess import channel_order, conversion
from edgepfl.heads.labels import LabelMismatch, run_label_index
from edgepfl.methods import ClientUpdate, LocalContext, Method, available_methods, create_method, get_method
from edgepfl.methods.base import load_tensors, model_size
from edgepfl.models import BUILTIN_ARCHS, TORCHVISION_ARCHS, installed_plugin_archs, is_import_path
from edgepfl.protocol import (
    REFUSAL_REASONS,
    Message,
    MessageType,
    RunSpec,
    TaskMeta,
    UpdateMeta,
    bounded_json,
    encode,
    seed_for,
)
from edgepfl.protocol.clock import stopwatch
from edgepfl.protocol.codec import tensors_digest
from edgepfl.protocol.secagg import MASKED_TENSOR
from edgepfl.protocol.signing import Signer
from edgepfl.secagg import SecAggError
from edgepfl.specs import ModelSpec

from .secure import SecureSessions, SharesNotOpened

if TYPE_CHECKING:
    from cryptography import x509

log = logging.getLogger(__name__)

PERSONAL_FILE = "personal.safetensors"  # protocol 1.0 agents' one file; read, never written


#: the seed stream of an update's stochastic rounding, beside the task's seed
UPLINK_STREAM = 0xC0DEC


def feedback_file(signature: str) -> str:
    """The file of the error-feedback residual of runs with ``signature`` (compressed updates):
    what rounding and top-k left out of the last update, added to the next one."""
    return f"feedback-{signature}.safetensors"


def personal_files(signature: str) -> tuple[str, str]:
    """(tensors, record) file names of the personal state of runs with ``signature``: one
    pair per signature, so a task naming another method or model never overwrites it."""
    return f"personal-{signature}.safetensors", f"personal-{signature}.json"


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


class TaskRefused(ValueError):
    """A task this agent cannot run (logged once where it is raised). ``reason`` is a key of
    :data:`edgepfl.protocol.REFUSAL_REASONS`: the agent answers a 1.2 coordinator with a
    ``refusal`` carrying it (docs/PROTOCOL.md §10)."""

    def __init__(self, reason: str, detail: str, peers: list[str] | None = None):
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        #: ``bad_shares``: the neighbours whose shares did not open
        self.peers = peers


def buildable_archs() -> list[str]:
    """Every ``run.model.arch`` this process announces it can build: the built-ins (the
    torchvision ones only with torchvision) and the installed ``edgepfl.models`` entry points.
    An import path ``module:callable`` is never announced: whether it imports is found when a
    task names it (a task this agent cannot build is refused, ``unsupported_arch``)."""
    from importlib.util import find_spec

    vision = find_spec("torchvision") is not None
    return [a for a in BUILTIN_ARCHS if vision or a not in TORCHVISION_ARCHS] + installed_plugin_archs()


def trainable_methods() -> list[str]:
    """The registry's methods whose module imports here (a method with a missing dependency is left out)."""
    names = []
    for name in available_methods():
        try:
            get_method(name)
        except Exception as exc:  # an optional dependency of that method is missing: it is not offered
            log.info("method %s is not available on this agent: %s", name, exc)
            continue
        names.append(name)
    return names


def run_signature(run: RunSpec) -> str:
    """What personal state depends on: method, its options and the model."""
    # Hashed in the layout tasks used before the run spec was typed (options beside the
    # name), so personal state saved by an older agent is still recognised.
    key = {"method": {"name": run.method.name, **run.method.options}, "model": run.model.model_dump()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class TrainerRuntime:
    """Holds one agent's model, data and personal state; answers tasks.

    Personal parameters are saved atomically after every training task to
    ``state_dir/personal-<run signature>.safetensors`` and reloaded when the agent
    restarts or a task of that method and model comes again (``run_signature``); the
    state of another run is kept, never overwritten. ``signer`` signs the updates;
    ``authenticated``: every message reaching it is the coordinator's (a pinned key, or
    in process), which secure rounds need (:class:`~.secure.SecureSessions`).
    """

    def __init__(self, agent_id: str, data: ClientData, state_dir: str | Path, device: str = "auto",
                 threads: int | None = None, signer: Signer | None = None, authenticated: bool = False,
                 max_model_params: int | None = DEFAULT_MAX_MODEL_PARAMS, certificate: bytes | None = None,
                 peer_ca: x509.Certificate | None = None):
        if threads:
            torch.set_num_threads(threads)  # process-wide: one agent per process
        self.agent_id = agent_id
        self.data = data
        self.state_dir = Path(state_dir)
        self.signer = signer
        #: a task whose model has more parameters is refused before it is built (None: no limit)
        self.max_model_params = max_model_params
        self.device = pick_device(device)
        # The local data as each run's preprocessing wants it, keyed by that preprocessing.
        self._inputs: dict[str, ClientTensors] = {}
        self._signature: str | None = None
        # Built by the first task (_ensure_model), rebuilt when a task's run has another signature.
        self.method: Method | None = None
        self.model: nn.Module | None = None
        # what compressed updates of the current run left out (docs/COMPRESSION.md)
        self._feedback = ErrorFeedback()
        # (epoch, round) and tensors of the last task this process decoded: a task delta's base
        self._held: tuple[tuple[int, int], dict[str, np.ndarray]] | None = None
        #: the secure rounds it takes part in (protocol 1.9)
        self.secure = SecureSessions(agent_id, signer, authenticated, certificate, peer_ca)

    def warm_up(self) -> None:
        """Pay torch's one-time costs before the agent announces itself, not inside its first
        task's deadline: the first optimizer built in a process imports ``torch._dynamo``
        (about 2 s idle on a 2-core x86 box, 11 s beside other work, longer on a Pi), and the
        first backward pass initializes autograd's engine."""
        weight = torch.zeros(1, requires_grad=True, device=self.device)
        optimizer = torch.optim.SGD([weight], lr=0.0)
        (weight * 2).sum().backward()
        optimizer.step()

    # ---------------------------------------------------------------- model setup
    def _check_data(self, meta: TaskMeta, round: int) -> np.ndarray | None:
        """Refuse a run whose data is not this agent's: its model could not take the data,
        or the run's classes are not the local data's (docs/PROTOCOL.md §5, Labels).
        Returns how the local labels become the run's (:func:`run_label_index`): None when
        they are the run's already."""
        run = meta.run
        problems = []
        if tuple(run.data.input_shape) != tuple(self.data.input_shape):
            problems.append(f"input shape {list(run.data.input_shape)}, local data {list(self.data.input_shape)}")
        if run.data.num_classes != self.data.num_classes:
            problems.append(f"{run.data.num_classes} classes, local data {self.data.num_classes}")
        if problems:
            raise self._refuse(meta, round, "data_mismatch", "the run has " + "; ".join(problems))
        try:
            channel_order(self.data.channel_names, run.data.channel_names)
        except ValueError as exc:
            raise self._refuse(meta, round, "data_mismatch", str(exc)) from None
        try:
            return run_label_index(self.data.class_names, run.data.class_names)
        except LabelMismatch as exc:
            raise self._refuse(meta, round, "data_mismatch", str(exc)) from None

    def _inputs_for(self, meta: TaskMeta, round: int, to_run_labels: np.ndarray | None = None) -> ClientTensors:
        """The local data as the run wants it: preprocessed as ``run.data`` says (pixel scale,
        mean, std), labels in the run's numbering (``to_run_labels``, from :meth:`_check_data`).

        Local data normalized otherwise is converted (one exact per-channel multiply-add,
        logged as a warning once per preprocessing); a run that does not say how it
        normalizes gets the local data as it is, with a warning; local data that does not
        say how it was normalized cannot be converted, so the task is refused. Local
        labels in another class order are mapped onto the run's (logged once per order).
        """
        wanted = meta.run.data
        key = wanted.model_dump_json(include={"pixel_scale", "normalization", "class_names", "channel_names"})
        cached = self._inputs.get(key)
        if cached is not None:
            return cached
        data = self.data
        order = channel_order(data.channel_names, wanted.channel_names)  # checked by _check_data
        if order is not None:
            log.info("%s: taking the local channels in the run's order (local %s, run %s)", self.agent_id,
                     data.channel_names, wanted.channel_names)
            data = data.reordered(order)
        if to_run_labels is not None:
            log.info("%s: mapping the local labels onto the run's class order (local %s, run %s)", self.agent_id,
                     data.class_names, wanted.class_names)
            data = replace(data, y_train=to_run_labels[data.y_train], y_test=to_run_labels[data.y_test],
                           class_names=list(wanted.class_names))
        if wanted.normalization is None:
            log.warning("%s: the run does not say how inputs are normalized; training on the local normalization "
                        "%s, which may differ from the rest of the fleet", self.agent_id, data.normalization or "(unknown)")
        elif not data.normalization:
            raise self._refuse(meta, round, "normalization", f"the run normalizes with {wanted.normalization.model_dump()}, "
                               "and the local data does not say how it was normalized")
        else:
            affine = conversion(data.normalization, wanted)
            if affine is not None:
                log.warning("%s: local data is normalized with %s, the run with %s (pixel scale %g): converting the "
                            "local data to the run's", self.agent_id, data.normalization,
                            wanted.normalization.model_dump(), wanted.pixel_scale)
                data = replace(data, x_train=affine.apply(data.x_train), x_test=affine.apply(data.x_test),
                               normalization=wanted.normalization.model_dump())
        tensors = data.to_torch(self.device)
        self._inputs = {key: tensors}  # one run at a time: keep only the current preprocessing
        return tensors

    def _refuse(self, meta: TaskMeta, round: int, reason: str, why: str) -> TaskRefused:
        """Log why the task is refused (one line) and return the exception to raise."""
        detail = f"{self.agent_id}: task {meta.task_id} (round {round}) refused ({reason}): {why}"
        log.error(detail)
        return TaskRefused(reason, detail)

    def _secagg_refusal(self, meta: TaskMeta, round: int, exc: SecAggError) -> TaskRefused:
        """The refusal of a secure task this agent cannot mask for (logged): ``bad_shares``
        naming the neighbours whose shares did not open, else ``error``."""
        if isinstance(exc, SharesNotOpened):
            refused = self._refuse(meta, round, "bad_shares", f"secure aggregation: {exc}")
            refused.peers = exc.peers
            return refused
        return self._refuse(meta, round, "error", f"secure aggregation: {exc}")

    def _ensure_model(self, meta: TaskMeta, round: int) -> tuple[Method, nn.Module]:
        """The method and model for the task's run: the current ones if its signature is
        unchanged, else built. A method, options or model this agent cannot build is a
        :class:`TaskRefused` with the matching reason."""
        run = meta.run
        signature = run_signature(run)
        if signature == self._signature and self.method is not None and self.model is not None:
            return self.method, self.model
        try:
            get_method(run.method.name)
        except Exception as exc:  # unknown here, or its module does not import (a missing dependency)
            raise self._refuse(meta, round, "unsupported_method", str(exc)) from None
        try:
            method = create_method(run.method.name, run.method.options)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
            raise self._refuse(meta, round, "bad_options", f"{run.method.name} options: {problems}") from None
        if not is_import_path(run.model.arch) and run.model.arch not in buildable_archs():
            raise self._refuse(meta, round, "unsupported_arch", f"this agent cannot build arch {run.model.arch!r} "
                               f"(it builds {', '.join(buildable_archs())}; a plugin's entry point needs its package "
                               "installed here)")
        spec = run.model.model_copy(update={"weights": None})
        counted = self._check_size(meta, round, method, spec)
        torch.manual_seed(seed_for(run.seed, "init", self.agent_id))
        # A task never names a file on this device: run.model.weights is the coordinator's
        # path (its pretrained backbone reaches agents as the task's tensors). Opened here,
        # any sender of a task could probe, or feed torch.load, any local path.
        try:
            model = method.build_model(spec, run.data.input_shape, run.data.num_classes)
        except (OSError, ImportError, ValueError) as exc:  # a weights file missing here, an input it cannot take
            raise self._refuse(meta, round, "unsupported_arch", f"cannot build {run.model.model_dump()}: {exc}") from None
        if counted is None and self.max_model_params is not None:  # not countable before: counted now
            self._refuse_if_larger(meta, round, sum(p.numel() for p in model.parameters()), "built, then dropped")
        model.to(self.device)
        restored = self._load_personal(method, model, signature)
        self.method, self.model, self._signature = method, model, signature
        self._feedback = self._load_feedback(signature)
        log.info("%s: built %s model (%s)", self.agent_id, method.name, "restored personal state" if restored else "fresh")
        return method, model

    def _check_size(self, meta: TaskMeta, round: int, method: Method, spec: ModelSpec) -> int | None:
        """Refuse (``unsupported_arch``) a model with more than ``max_model_params`` parameters
        before it takes any memory: it is built on torch's meta device (shapes, no storage), so
        one forged task cannot make a small device build a ResNet-18. A model that cannot be
        built there (a plugin doing arithmetic on its tensors while it is built) is counted
        once built, and dropped if it is too large: None is returned for it."""
        if self.max_model_params is None:
            return None
        counted = model_size(method, spec, meta.run.data.input_shape, meta.run.data.num_classes)
        if counted is not None:
            self._refuse_if_larger(meta, round, counted, "not built")
        return counted

    def _refuse_if_larger(self, meta: TaskMeta, round: int, params: int, what: str) -> None:
        if self.max_model_params is not None and params > self.max_model_params:
            raise self._refuse(meta, round, "unsupported_arch",
                               f"the run's model ({meta.run.model.arch}) has {params:,} parameters, more than this "
                               f"agent's max_model_params {self.max_model_params:,} ({what}; raise it in the agent's "
                               "config to train it)")

    def _load_personal(self, method: Method, model: nn.Module, signature: str) -> bool:
        tensors_name, record_name = personal_files(signature)
        path, meta_path = self.state_dir / tensors_name, self.state_dir / record_name
        if not path.exists() or not meta_path.exists():
            # an older agent's single file, if it holds this run's state
            path, meta_path = self.state_dir / PERSONAL_FILE, self.state_dir / "personal.json"
            if not path.exists() or not meta_path.exists():
                return False
        try:
            meta = bounded_json.loads(meta_path.read_text())
        except ValueError as exc:
            log.warning("%s: %s is unreadable (%s); starting fresh", self.agent_id, meta_path, exc)
            return False
        if not isinstance(meta, dict) or meta.get("signature") != signature:
            log.info("%s: no saved personal state for this method/model yet (others are kept)", self.agent_id)
            return False
        tensors = read_tensors(path)
        expected = set(method.personal_state(model))
        if set(tensors) != expected:
            log.warning("%s: saved personal state has other tensors than the model; starting fresh", self.agent_id)
            return False
        load_tensors(model, tensors)
        return True

    def _load_feedback(self, signature: str) -> ErrorFeedback:
        """The run's saved residual, or an empty one (none saved, or unreadable: a residual
        only refines later updates, so starting without one loses nothing that matters)."""
        feedback = ErrorFeedback()
        path = self.state_dir / feedback_file(signature)
        if path.exists():
            try:
                feedback.load_state_dict(read_tensors(path))
            except (OSError, ValueError) as exc:
                log.warning("%s: %s is unreadable (%s); error feedback starts again", self.agent_id, path.name, exc)
        return feedback

    def _payload(self, task: Message, meta: TaskMeta) -> dict[str, np.ndarray]:
        """The task's tensors: as they came, or, for a task delta (protocol 1.7), decoded onto
        the tensors of this process's task of the delta's base round and checked against the
        delta's digest. They are kept as the base of the next delta. Raises TaskRefused
        (``no_base``) when this process does not hold the base or the result is not the
        coordinator's; the coordinator sends the next round's task whole."""
        round, downlink = task.header.round, meta.downlink
        if downlink is None:
            tensors = dict(task.tensors)
        else:
            held = self._held
            if held is None or held[0] != (meta.epoch, downlink.base_round):
                holds = "none" if held is None else f"round {held[0][1]} of epoch {held[0][0]}"
                raise self._refuse(meta, round, "no_base", f"a delta against round {downlink.base_round} of epoch "
                                                           f"{meta.epoch}; this process holds {holds}")
            try:
                tensors = decode(Encoded.from_arrays(downlink.codec, task.tensors), held[1])
            except CodecError as exc:
                raise self._refuse(meta, round, "no_base", f"the delta does not decode onto round "
                                                           f"{downlink.base_round}'s tensors ({exc})") from None
            if tensors_digest(tensors) != downlink.digest:
                raise self._refuse(meta, round, "no_base", "the decoded tensors are not the coordinator's (digest)")
        self._held = ((meta.epoch, round), tensors)
        return tensors

    def _compressed(self, meta: TaskMeta, reference: dict[str, np.ndarray],
                    upload: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], CodecHeader | None]:
        """The upload as the task's ``uplink`` asks (its change from ``reference``, encoded,
        with this run's error feedback), or as it is without one."""
        uplink = meta.uplink
        if uplink is None or not upload:
            return upload, None
        assert self._signature is not None
        rng = np.random.default_rng([meta.seed, UPLINK_STREAM])  # reproducible, apart from training's draws
        try:
            encoded = self._feedback.encode(upload, reference, CodecSpec.from_uplink(uplink), rng,
                                            exact=[name for name in upload if uplink.is_exact(name)])
        except ValueError as exc:  # a non-finite update: sent as it is, for the coordinator to judge
            log.warning("%s: update not compressed (%s)", self.agent_id, exc)
            return upload, None
        write_tensors(self.state_dir / feedback_file(self._signature), self._feedback.state_dict())
        return encoded.arrays(), encoded.header

    def _masked(self, task: Message, meta: TaskMeta, method: Method, payload: dict[str, np.ndarray],
                upload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A secure round's update (PROTOCOL.md §19): the shared parameters' change on the
        round's exact grid, weighted as the coordinator weighs it, masked. Nothing else of
        the upload leaves the device."""
        secagg = meta.secagg
        assert secagg is not None  # the caller's condition
        reference = {k: v for k, v in payload.items() if "/" not in k}  # the coordinator's shared parameters
        missing = sorted(set(reference) - set(upload))
        if missing or meta.uplink is not None:
            raise TaskRefused("error", f"a secure round's update needs every shared tensor, uncompressed "
                                       f"(missing {missing[:3]}; uplink {meta.uplink})")
        broken = [k for k in reference if upload[k].dtype.kind == "f" and not np.isfinite(upload[k]).all()]
        if broken:  # masked, it would pass every check and corrupt the round's sum: nobody but this device can see it
            raise TaskRefused("error", f"the update of {broken[0]} is not finite; not sent into a secure round")
        if secagg.clip_norm is not None:  # distributed DP: clipped, counted once, noised here, unseen by anyone
            contribution = grid_contribution(upload, reference, 1, secagg.clip_norm, secagg.noise_std or 0.0,
                                             np.random.default_rng())  # seeded from the OS, never from the task
        else:
            cap = secagg.weight_cap
            samples = self.data.num_train if cap is None else min(self.data.num_train, cap)
            contribution = grid_contribution(upload, reference, method.update_weight(
                ClientUpdate(self.agent_id, samples, {})))
        vector = ring_vector(contribution, reference)
        try:
            masked = self.secure.mask(task.header.federation, task.header.round, secagg, vector)
        except SecAggError as exc:
            raise self._secagg_refusal(meta, task.header.round, exc) from None
        return {MASKED_TENSOR: masked.view("<i8")}  # the ring's bits as int64, a dtype every frame carries

    def _save_personal(self, method: Method, model: nn.Module, round: int) -> None:
        assert self._signature is not None  # set by _ensure_model, which every task goes through first
        tensors_name, record_name = personal_files(self._signature)
        write_tensors(self.state_dir / tensors_name, method.personal_state(model))
        write_json(self.state_dir / record_name, {"signature": self._signature, "round": round, "agent": self.agent_id})

    # ---------------------------------------------------------------- tasks
    def handle(self, task: Message) -> tuple[UpdateMeta, dict[str, np.ndarray]]:
        """Evaluate the model made from the task's payload, train if asked; return the update.

        The local data is first preprocessed and labelled as the task's run says
        (:meth:`_inputs_for`). Raises :class:`TaskRefused` (after logging why) when the task's
        run has another input shape, class count or set of class names than this agent's
        data, a normalization the local data cannot be converted to, or a method, options or
        model this agent cannot build.
        """
        meta = task.meta_as(TaskMeta)
        to_run_labels = self._check_data(meta, task.header.round)
        inputs = self._inputs_for(meta, task.header.round, to_run_labels)
        method, model = self._ensure_model(meta, task.header.round)
        generator = torch.Generator().manual_seed(meta.seed)
        torch.manual_seed(meta.seed)
        ctx = LocalContext(
            train=meta.run.train,
            device=self.device,
            round=task.header.round,
            seed=meta.seed,
            num_classes=self.data.num_classes,
            generator=generator,
            log=log,
        )
        if meta.kind == "train" and meta.secagg is not None:
            try:  # before training: a round this agent cannot mask for is not trained for
                self.secure.open_shares(task.header.round, meta.secagg)
            except SecAggError as exc:
                raise self._secagg_refusal(meta, task.header.round, exc) from None
        payload = self._payload(task, meta)
        method.receive(model, payload, ctx)
        started = stopwatch()
        evaluation = method.evaluate(model, inputs, ctx)
        upload: dict[str, np.ndarray] = {}
        train_loss = None
        extra: dict[str, float] = {}
        codec = None
        if meta.kind == "train":
            result = method.local_update(model, inputs, ctx)
            if meta.secagg is not None:
                upload = self._masked(task, meta, method, payload, result.upload)
            else:
                upload, codec = self._compressed(meta, payload, result.upload)
            train_loss = None if np.isnan(result.train_loss) else float(result.train_loss)
            extra = {k: float(v) for k, v in result.metrics.items() if math.isfinite(float(v))}
            if len(extra) < len(result.metrics):  # a frame carries finite numbers only (§7): the rest is not sent
                log.warning("%s: round %d's metrics %s are not finite; not sent", self.agent_id, task.header.round,
                            sorted(set(result.metrics) - set(extra)))
            self._save_personal(method, model, task.header.round)
        update = UpdateMeta(
            task_id=meta.task_id,
            kind=meta.kind,
            num_train=self.data.num_train,
            num_test=self.data.num_test,
            eval_correct=evaluation.correct,
            eval_loss=None if np.isnan(evaluation.loss) else float(evaluation.loss),
            train_loss=train_loss,
            train_seconds=stopwatch() - started,
            extra=extra,
            codec=codec,
        )
        return update, upload

    def answer(self, task: Message) -> bytes:
        """:meth:`handle` and encode the update frame for the coordinator."""
        meta, tensors = self.handle(task)
        return encode(MessageType.UPDATE, federation=task.header.federation, sender=self.agent_id,
                      round=task.header.round, meta=meta, tensors=tensors, signer=self.signer)
