"""Tier runtimes: what an agent of each tier subscribes to, announces and answers.

The agent loop (:mod:`.agent`) is the same for every tier; it talks to its tier only
through :class:`TierRuntime`:

* :class:`TrainerTier` — tasks in, updates out, through
  :class:`edgepfl.edge_agent.trainer.TrainerRuntime` (torch);
* :class:`HeadTier` — encoder releases in, metrics out, through
  :class:`edgepfl.edge_agent.head_tier.HeadRuntime` (onnxruntime; scikit-learn only in the
  child process that fits a head, :mod:`edgepfl.edge_agent.head_fit`).

This module imports neither runtime at import time: a head agent must never import
torch, and a trainer agent need not have onnxruntime.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from edgepfl.agent_config import DEFAULT_MAX_MODEL_PARAMS, AgentConfig
from edgepfl.codec_stages import CODECS, DELTA_CODECS
from edgepfl.errors import OutOfMemory, out_of_memory
from edgepfl.failpoints import failpoint
from edgepfl.protocol import (
    BAD_SHARES,
    RELEASE_REFUSALS,
    VARIANCE_GRID,
    AgentChannel,
    Capabilities,
    FederationChannel,
    Message,
    MessageType,
    MetricsMeta,
    ReleaseMeta,
    ReleaseRef,
    StatusMeta,
    TaskMeta,
    agent_topic,
    encode,
    encode_refusal,
    federation_topic,
    release_part_topic,
)
from edgepfl.protocol.secagg import SecAggMeta
from edgepfl.service import notifier
from edgepfl.simulation import DevicePace, task_samples

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from edgepfl.config import RunConfig
    from edgepfl.data import ClientData
    from edgepfl.protocol.signing import Signer

    from .head_tier import HeadFit

log = logging.getLogger("edgepfl.agent")

# Answered tasks a trainer remembers, to re-send instead of retraining (docs/PROTOCOL.md §9).
ANSWERED_TASKS = 4


@dataclass(frozen=True)
class Reply:
    """A frame for the agent to publish on one of its own channels.

    ``task_id``: the task it answers (an update or a refusal), which the agent holds
    until the task's round is over (docs/PROTOCOL.md §10, held answers); ``release_id``:
    the release a ``metrics`` report measured, which the agent holds until the run is
    done; ``refusal``: a ``refusal`` frame, which only a coordinator of protocol 1.2 or
    later is sent; ``since``: the protocol revision the frame needs of the coordinator (a
    report of a refused release: 1.5), not sent to an older one."""

    channel: AgentChannel
    frame: bytes
    round: int
    task_id: str | None = None
    refusal: bool = False
    release_id: str | None = None
    since: tuple[int, int] | None = None
    #: sent instead to a coordinator older than ``since`` (None: nothing is sent to one)
    older: Reply | None = None

    @property
    def held_as(self) -> str | None:
        """The key the agent holds this reply under until it is no longer wanted; None: not held."""
        if self.task_id is not None:
            return self.task_id
        return None if self.release_id is None else f"metrics report of release {self.release_id}"


class TierRuntime(Protocol):
    """The agent loop's view of a tier.

    ``accepts`` are the message types the tier handles (others are logged and
    ignored); ``device`` goes into the agent's status.
    """

    tier: ClassVar[str]
    accepts: ClassVar[tuple[MessageType, ...]]

    @property
    def device(self) -> str: ...

    def capabilities(self) -> Capabilities:
        """What this agent can run, for its status (the agent adds its message size)."""
        ...

    def close(self, task_id: str) -> None:
        """The coordinator closed ``task_id`` (a ``nack``): never answer it again."""
        ...

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        """Topics to (re)subscribe on every connect."""
        ...

    def release_topics(self, federation: str) -> list[str]:
        """The retained release topics, subscribed on a connection only when the tier needs
        them (:mod:`.release_fetch`); none for a tier that installs no releases."""
        ...

    def installed_release(self) -> ReleaseRef | None:
        """The release installed and usable (None: none, or a tier without releases)."""
        ...

    def installed_report(self, federation: str) -> Reply | None:
        """A metrics report of the installed release, for a coordinator that names it as
        current (the agent then downloads nothing to report on it); None without one."""
        ...

    def restore(self) -> None:
        """Reload what a previous run of this agent left on disk, if anything (before connecting)."""
        ...

    def handle(self, message: Message) -> Reply | None:
        """Act on one message of a type in ``accepts``; what to publish back, if anything. Never raises,
        except :class:`~edgepfl.errors.OutOfMemory`: nothing was wrong with the message, so it is
        not refused; the agent ends with its own exit code, and its service restarts it."""
        ...


class TrainerTier:
    """Trainer tier: evaluates and trains the model of each task, answers with an update.

    Idempotent on task id: a task delivered again (QoS 1 is at-least-once) is answered
    with the cached update frame, same message id, instead of training twice. A task it
    cannot run is answered with a ``refusal`` (:class:`~edgepfl.edge_agent.trainer.TaskRefused`'s
    reason; ``error`` when the local update raised), cached the same way.
    """

    tier: ClassVar[str] = "trainer"
    #: tasks, and the steps of a secure round (protocol 1.9)
    accepts: ClassVar[tuple[MessageType, ...]] = (MessageType.TASK, MessageType.SECAGG)

    def __init__(self, agent_id: str, data: ClientData, state_dir: str, device: str = "auto",
                 threads: int | None = None, *, signer: Signer | None = None, pinned: bool = False,
                 in_process: bool = False, max_model_params: int | None = DEFAULT_MAX_MODEL_PARAMS,
                 certificate: bytes | None = None, peer_ca: x509.Certificate | None = None):
        from .task_guard import TaskGuard
        from .trainer import TrainerRuntime  # torch only on this path

        self.runtime = TrainerRuntime(agent_id, data, state_dir, device, threads=threads, signer=signer,
                                      authenticated=pinned or in_process, max_model_params=max_model_params,
                                      certificate=certificate, peer_ca=peer_ca)
        #: with a pinned coordinator key: only tasks for this agent, newest first, before their deadline
        self.guard = TaskGuard(agent_id, state_dir, strict=pinned)
        self.agent_id = agent_id
        # task id -> its answer; None: closed by the coordinator (a nack), not answered again
        self._answered: OrderedDict[str, Reply | None] = OrderedDict()
        self._capabilities: Capabilities | None = None
        #: a simulated device's pace (AgentConfig.pace): answers are held until it would have sent them
        self.pace: DevicePace | None = None

    @classmethod
    def from_config(cls, config: AgentConfig, data: ClientData, signer: Signer | None = None,
                    pinned: bool = False) -> TrainerTier:
        from cryptography.hazmat.primitives.serialization import Encoding

        from edgepfl.pki import load_certificate

        security = config.security
        # the device's certified signing key and the CA of its neighbours' (protocol 1.14, secure rounds)
        certificate = load_certificate(security.certificate) if security.certificate else None
        tier = cls(config.agent_id, data, config.state_dir, config.device, threads=config.threads, signer=signer,
                   pinned=pinned, max_model_params=config.max_model_params,
                   certificate=certificate.public_bytes(Encoding.DER) if certificate is not None else None,
                   peer_ca=load_certificate(security.peer_ca) if security.peer_ca else None)
        tier.pace = config.pace
        return tier

    @property
    def device(self) -> str:
        return str(self.runtime.device)

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        return [agent_topic(federation, agent_id, AgentChannel.TASK)]

    def release_topics(self, federation: str) -> list[str]:
        return []

    def installed_release(self) -> ReleaseRef | None:
        return None

    def installed_report(self, federation: str) -> Reply | None:
        return None

    def capabilities(self) -> Capabilities:
        from .trainer import buildable_archs, trainable_methods

        if self._capabilities is None:  # imports every method module once
            self._capabilities = Capabilities(methods=trainable_methods(), archs=buildable_archs(),
                                              codecs=list(CODECS))
        return self._capabilities

    def status(self) -> StatusMeta:
        """Its presence in an in-process fleet (:class:`edgepfl.coordinator.fleet.LocalAgent`);
        the agent loop's birth adds session, limits and capabilities."""
        data = self.runtime.data
        # the codecs, so that an in-process fleet compresses as the MQTT one does; methods and
        # archs undeclared: the simulator builds its agents for the run
        return StatusMeta(state="online", tier=self.tier, device=self.device, num_train=data.num_train,
                          num_test=data.num_test, capabilities=Capabilities(codecs=list(CODECS)))

    def restore(self) -> None:
        """Get ready for tasks (:meth:`TrainerRuntime.warm_up`). Personal state is restored by
        the first task, which names the method and model it belongs to."""
        self.runtime.warm_up()

    def close(self, task_id: str) -> None:
        self._remember(task_id, None)

    def handle(self, message: Message) -> Reply | None:
        from .trainer import TaskRefused

        if message.type == MessageType.SECAGG:
            frame = self.runtime.secure.step(message.header, message.meta_as(SecAggMeta))
            # to a coordinator before 1.14 nothing: its rounds mix agents that seal both directions of an edge
            # under one key and the zero nonce (PROTOCOL.md §19), which would hand it this agent's shares;
            # nor before 1.17, whose grid puts a BatchNorm variance elsewhere than this agent's contribution
            return None if frame is None else Reply(AgentChannel.UPDATE, frame, message.header.round,
                                                    since=VARIANCE_GRID)
        meta = message.meta_as(TaskMeta)  # the agent hands a tier only messages of its ``accepts`` types
        task_id, round = meta.task_id, message.header.round
        refused = self.guard.refusal(message)
        if refused is not None:
            log.warning("ignored task %s (round %d): %s (%s)", task_id, round, *refused)
            # past its deadline by this device's clock: not run, but told, so that a clock far
            # ahead shows in the coordinator's row and log instead of only on the device
            return self._refusal(message, *refused) if refused[0] == "expired" else None
        if task_id in self._answered:
            cached = self._answered[task_id]
            if cached is None:
                log.info("task %s (round %d) was closed by the coordinator; not answered again", task_id, round)
            return cached
        if self.guard.strict:
            self.guard.accept(message)
        if meta.kind == "train":
            failpoint("agent.train_task")
        received = time.monotonic()
        try:
            with notifier().fed_while_computing():  # a local training round: one long step
                frame = self.runtime.answer(message)
            reply = Reply(AgentChannel.UPDATE, frame, round, task_id)
            if self.pace is not None:
                self._keep_pace(message, meta, received, len(reply.frame))
            log.info("round %d: %s task answered", round, meta.kind)
        except TaskRefused as exc:  # logged where it was raised
            reply = self._refusal(message, exc.reason, exc.detail, exc.peers)
        except Exception as exc:
            log.exception("task %s (round %d) failed", task_id, round)
            reply = self._refusal(message, "error", f"{type(exc).__name__}: {exc}")
        self._remember(task_id, reply)
        return reply

    def _keep_pace(self, task: Message, meta: TaskMeta, received: float, answer_bytes: int) -> None:
        """Hold the answer until a device of :attr:`pace` would have sent it: the task's
        download, the work (this machine's time if it was slower) and the answer's upload."""
        assert self.pace is not None
        data = self.runtime.data
        samples = task_samples(meta.kind, data.num_train, data.num_test, meta.run.train.epochs)
        task_bytes = sum(t.nbytes for t in task.tensors.values())  # the frame's bulk
        due = received + self.pace.answer_s(task_bytes, samples, answer_bytes)
        time.sleep(max(0.0, due - time.monotonic()))

    def _refusal(self, task: Message, reason: str, detail: str, peers: list[str] | None = None) -> Reply:
        signer, task_id = self.runtime.signer, task.meta_as(TaskMeta).task_id
        frame = encode_refusal(task, sender=self.agent_id, reason=reason, detail=detail, signer=signer)
        reply = Reply(AgentChannel.UPDATE, frame, task.header.round, task_id, refusal=True)
        if peers:  # what a coordinator before 1.12 reads: the same refusal as an error, its peers in the detail
            frame = encode_refusal(task, sender=self.agent_id, reason=reason, detail=detail, signer=signer,
                                   peers=peers)
            reply = Reply(AgentChannel.UPDATE, frame, task.header.round, task_id, refusal=True, since=BAD_SHARES,
                          older=replace(reply, frame=encode_refusal(task, sender=self.agent_id, reason="error",
                                                                    detail=detail, signer=signer)))
        return reply

    def _remember(self, task_id: str, reply: Reply | None) -> None:
        self._answered[task_id] = reply
        self._answered.move_to_end(task_id)
        while len(self._answered) > ANSWERED_TASKS:
            self._answered.popitem(last=False)


class HeadTier:
    """Head tier: installs each encoder release, fits its head, answers with a metrics report."""

    tier: ClassVar[str] = "head"
    accepts: ClassVar[tuple[MessageType, ...]] = (MessageType.RELEASE,)
    device = "cpu-onnxruntime"

    def __init__(self, agent_id: str, data: ClientData, state_dir: str, head: str, threads: int | None = None, *,
                 signer: Signer | None = None, coordinator_key: Ed25519PublicKey | None = None):
        from .head_tier import HeadRuntime  # onnxruntime only on this path

        self.agent_id = agent_id
        self.head = head
        self.signer = signer
        self.runtime = HeadRuntime(state_dir, head, data, threads=threads, coordinator_key=coordinator_key)

    @classmethod
    def from_config(cls, config: AgentConfig, data: ClientData, signer: Signer | None = None,
                    coordinator_key: Ed25519PublicKey | None = None) -> HeadTier:
        return cls(config.agent_id, data, config.state_dir, config.head, threads=onnx_threads(config.threads),
                   signer=signer, coordinator_key=coordinator_key)

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        # The task topic, as the protocol has every agent do: a head agent ignores tasks, and
        # gets releases there from a coordinator that is online.
        return [agent_topic(federation, agent_id, AgentChannel.TASK)]

    def release_topics(self, federation: str) -> list[str]:
        # Part 0 of a release in parts: the transport follows its other parts (PROTOCOL.md §12).
        return [federation_topic(federation, FederationChannel.RELEASE), release_part_topic(federation, 0)]

    def installed_release(self) -> ReleaseRef | None:
        record = self.runtime.record
        return ReleaseRef(release_id=record.release_id, sequence=record.sequence) \
            if record is not None and self.runtime.ready else None

    def installed_report(self, federation: str) -> Reply | None:
        record = self.runtime.record
        if record is None or not self.runtime.ready:
            return None
        return self._report(record.release_id, record.metrics, federation, record.manifest.round)

    def capabilities(self) -> Capabilities:
        from importlib.util import find_spec

        from edgepfl.heads import GENERIC_HEAD_KINDS, OFFLINE_HEAD_KIND
        from edgepfl.methods import available_methods

        # Read from the method modules' names, not their classes: importing every method
        # module imports torch where it is installed, which a head agent never does. Every
        # method offers the generic kinds; a method's own head kind carries its name and is
        # fitted with torch (edgepfl.methods.device_head); an offline head fits any encoder.
        # tests/unit/edge_agent/test_tiers.py checks this against the classes' ``head_kinds``.
        kind = self.head
        if kind in GENERIC_HEAD_KINDS or kind == OFFLINE_HEAD_KIND:
            methods = available_methods()
        else:
            methods = [kind] if kind in available_methods() and find_spec("torch") is not None else []
        return Capabilities(methods=methods, head_kinds=[kind], release_codecs=list(DELTA_CODECS))

    def close(self, task_id: str) -> None:
        """A head agent answers no task."""

    def restore(self) -> None:
        try:
            self.runtime.load()
        except Exception as exc:  # nothing saved yet, or unusable: wait for a release
            if out_of_memory(exc):  # the saved release is fine: not a reason to download it again
                raise OutOfMemory("restoring the installed release", exc) from exc
            log.info("no usable saved head yet (%s)", exc)
        self.runtime.remove_strays()  # an install a stop or a crash cut short left them

    def handle(self, message: Message) -> Reply | None:
        from .head_tier import ReleaseRefused

        meta = message.meta_as(ReleaseMeta)  # the agent hands a tier only messages of its ``accepts`` type
        artifact, global_heads = message.tensors.get("artifact"), message.tensors.get("global_heads")
        proof = message.signed_part + message.signature if message.signature is not None else None
        if meta.restore:  # a release this agent holds, again (a rollback): nothing travels
            try:
                if message.tensors:
                    raise ReleaseRefused(f"release {meta.release_id} refused: a restore carries no tensors")
                result = self.runtime.restore_release(meta.manifest, meta.sha256, sequence=meta.sequence,
                                                      expires=meta.expires, proof=proof)
            except ReleaseRefused as exc:  # the sender sends the whole release instead
                return self._refusal_report(meta.release_id, str(exc), message)
            return self._report(meta.release_id, result, message.header.federation, message.header.round)
        if meta.delta is not None:
            try:
                artifact_bytes = self._rebuilt(meta, message)
            except ReleaseRefused as exc:  # the coordinator sends the whole release instead
                return self._refusal_report(meta.release_id, str(exc), message)
        elif artifact is None:
            log.error("release %s carries no artifact; refused", meta.release_id)
            return self._refusal_report(meta.release_id, f"release {meta.release_id} carries no artifact", message)
        else:
            artifact_bytes = artifact.tobytes()
        try:
            result = self.runtime.install_release(
                meta.manifest, artifact_bytes, meta.sha256, sequence=meta.sequence, expires=meta.expires, proof=proof,
                global_heads=global_heads.tobytes() if global_heads is not None else None)
        except ReleaseRefused as exc:  # logged, with the release kept, where it was refused
            return self._refusal_report(meta.release_id, str(exc), message)
        except Exception as exc:
            if out_of_memory(exc):  # a good release: installed again when memory allows, never refused
                log.error("release %s not installed: out of memory; the agent exits to be restarted and tries it "
                          "again", meta.release_id)
                if isinstance(exc, OutOfMemory):
                    raise
                raise OutOfMemory(f"installing release {meta.release_id}", exc) from exc
            log.error("release %s refused: %s", meta.release_id, exc)
            return self._refusal_report(meta.release_id, f"release {meta.release_id} refused: {exc}", message)
        return self._report(meta.release_id, result, message.header.federation, message.header.round)

    def _rebuilt(self, meta: ReleaseMeta, message: Message) -> bytes:
        """The artifact of a release sent as a delta (since 1.7): the installed artifact with the
        delta's changes applied. Its hash is checked by the install, as a whole release's is.
        Raises ReleaseRefused (logged) when the installed release is not the delta's base or
        the delta does not fit it."""
        from edgepfl.codecs import CodecError, Encoded
        from edgepfl.release_delta import apply_release_delta

        from .head_tier import ReleaseRefused

        delta = meta.delta
        assert delta is not None  # the caller's branch
        base = self.runtime.installed_artifact()

        def refuse(reason: str) -> ReleaseRefused:
            log.warning("release %s sent as a delta against %s: %s; the coordinator sends it whole",
                        meta.release_id, delta.base.release_id, reason)
            return ReleaseRefused(f"release {meta.release_id} refused: delta: {reason}")

        if base is None or hashlib.sha256(base).hexdigest() != delta.base_sha256:
            raise refuse(f"its base {delta.base.release_id} is not the installed release")
        if delta.codec.codec not in DELTA_CODECS:
            raise refuse(f"codec {delta.codec.codec} is not a release delta's")
        if "artifact" in message.tensors:
            raise refuse("it carries a whole artifact too")
        try:
            arrays = {name: value for name, value in message.tensors.items() if name != "global_heads"}
            return apply_release_delta(base, delta.runs, Encoded.from_arrays(delta.codec, arrays))
        except CodecError as exc:
            raise refuse(str(exc)) from None

    def _refusal_report(self, release_id: str, why: str, message: Message) -> Reply:
        """What the coordinator is told of a release this agent did not install (since 1.5):
        a metrics report naming it, with the reason and no counts, so that the operator sees
        it in the head report, the fleet view and the coordinator's log."""
        line = " ".join(why.split())
        metrics = MetricsMeta(tier="head", release_id=release_id, head=self.head,
                              refused=line if len(line) <= 300 else line[:299] + "…")
        frame = encode(MessageType.METRICS, federation=message.header.federation, sender=self.agent_id,
                       round=message.header.round, meta=metrics, signer=self.signer)
        return Reply(AgentChannel.METRICS, frame, message.header.round, release_id=release_id, since=RELEASE_REFUSALS)

    def _report(self, release_id: str, result: HeadFit, federation: str, round: int) -> Reply:
        metrics = MetricsMeta(tier="head", release_id=release_id, head=result.head, num_train=result.num_train,
                              num_test=result.num_test, eval_correct=result.eval_correct, values=result.values())
        frame = encode(MessageType.METRICS, federation=federation, sender=self.agent_id, round=round, meta=metrics,
                       signer=self.signer)
        return Reply(AgentChannel.METRICS, frame, round, release_id=release_id)


def onnx_threads(configured: int | None) -> int:
    """onnxruntime's intra-op threads for a head agent: ``configured`` (``threads`` in its
    config), else ``OMP_NUM_THREADS`` (the example unit sets it), else the cores this process
    may run on. Always a number: left to choose, onnxruntime pins each of its threads to a
    core (sched_setaffinity), which a hardened unit forbids (``SystemCallFilter=~@resources``)
    and which it then reports on stderr, one non-JSON line per thread."""
    if configured:
        return configured
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux, or the call is filtered
        return max(1, os.cpu_count() or 1)


#: tier name (``AgentConfig.tier``) -> how to build it
TIERS: dict[str, type[TrainerTier] | type[HeadTier]] = {TrainerTier.tier: TrainerTier, HeadTier.tier: HeadTier}


def create_tier(config: AgentConfig, data: ClientData, signer: Signer | None = None,
                coordinator_key: Ed25519PublicKey | None = None) -> TierRuntime:
    """The runtime of ``config.tier`` for this agent and its local data; it signs what it
    sends with ``signer`` and holds the coordinator to ``coordinator_key`` when given."""
    if config.tier == HeadTier.tier:
        return HeadTier.from_config(config, data, signer, coordinator_key)
    return TrainerTier.from_config(config, data, signer, pinned=coordinator_key is not None)


def local_trainers(config: RunConfig, agent_ids: Sequence[str], out_dir: str | Path) -> dict[str, TrainerTier]:
    """Trainer agents run in this process for a simulated federation (``edgepfl simulate
    --in-process``): agent ``i`` of ``agent_ids`` holds partition ``i`` of ``config.data``
    and keeps its state in ``out_dir/agents/<id>``, as its agent process would; the run's own
    model, whatever its size (no task reaches them from anyone else)."""
    from edgepfl.data import load_client_data

    return {agent_id: TrainerTier(agent_id, load_client_data(config.data, i), str(Path(out_dir) / "agents" / agent_id),
                                  config.device, in_process=True, max_model_params=None)
            for i, agent_id in enumerate(agent_ids)}
