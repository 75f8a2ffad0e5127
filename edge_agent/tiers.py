"""Tier runtimes: what an agent of each tier subscribes to, announces and answers.

The agent loop (:mod:`.agent`) is the same for every tier; it talks to its tier only
through :class:`TierRuntime`:

* :class:`TrainerTier` — tasks in, updates out, through
  :class:`edgepfl.edge_agent.trainer.TrainerRuntime` (torch);
* :class:`HeadTier` — encoder releases in, metrics out, through
  :class:`edgepfl.edge_agent.head_tier.HeadRuntime` (onnxruntime + scikit-learn).

This module imports neither runtime at import time: a head agent must never import
torch, and a trainer agent need not have onnxruntime.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from edgepfl.config import AgentConfig
from edgepfl.protocol import (
    AgentChannel,
    FederationChannel,
    Message,
    MessageType,
    MetricsMeta,
    ReleaseMeta,
    TaskMeta,
    agent_topic,
    encode,
    federation_topic,
    release_part_topic,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from edgepfl.data import ClientData
    from edgepfl.protocol.signing import Signer

log = logging.getLogger("edgepfl.agent")

# Answered tasks a trainer remembers, to re-send instead of retraining (docs/PROTOCOL.md §9).
ANSWERED_TASKS = 4


@dataclass(frozen=True)
class Reply:
    """A frame for the agent to publish on one of its own channels."""

    channel: AgentChannel
    frame: bytes
    round: int


class TierRuntime(Protocol):
    """The agent loop's view of a tier.

    ``accepts`` is the one message type the tier handles (others are logged and
    ignored); ``device`` goes into the agent's status.
    """

    tier: ClassVar[str]
    accepts: ClassVar[MessageType]

    @property
    def device(self) -> str: ...

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        """Topics to (re)subscribe on every connect."""
        ...

    def restore(self) -> None:
        """Reload what a previous run of this agent left on disk, if anything (before connecting)."""
        ...

    def handle(self, message: Message) -> Reply | None:
        """Act on one message of type ``accepts``; what to publish back, if anything. Never raises."""
        ...


class TrainerTier:
    """Trainer tier: evaluates and trains the model of each task, answers with an update.

    Idempotent on task id: a task delivered again (QoS 1 is at-least-once) is answered
    with the cached update frame, same message id, instead of training twice.
    """

    tier: ClassVar[str] = "trainer"
    accepts: ClassVar[MessageType] = MessageType.TASK

    def __init__(self, agent_id: str, data: ClientData, state_dir: str, device: str = "auto",
                 threads: int | None = None, *, signer: Signer | None = None, pinned: bool = False):
        from .task_guard import TaskGuard
        from .trainer import TrainerRuntime  # torch only on this path

        self.runtime = TrainerRuntime(agent_id, data, state_dir, device, threads=threads, signer=signer)
        #: with a pinned coordinator key: only tasks for this agent, newest first, before their deadline
        self.guard = TaskGuard(agent_id, state_dir, strict=pinned)
        self._answered: OrderedDict[str, Reply] = OrderedDict()

    @classmethod
    def from_config(cls, config: AgentConfig, data: ClientData, signer: Signer | None = None,
                    pinned: bool = False) -> TrainerTier:
        return cls(config.agent_id, data, config.state_dir, config.device, threads=config.threads, signer=signer,
                   pinned=pinned)

    @property
    def device(self) -> str:
        return str(self.runtime.device)

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        return [agent_topic(federation, agent_id, AgentChannel.TASK)]

    def restore(self) -> None:
        """Nothing yet: personal state belongs to a method and model, which the first task names."""

    def handle(self, message: Message) -> Reply | None:
        meta = message.meta_as(TaskMeta)  # the agent hands a tier only messages of its ``accepts`` type
        task_id = meta.task_id
        refused = self.guard.refusal(message)
        if refused is not None:
            log.warning("ignored task %s (round %d): %s (%s)", task_id, message.header.round, *refused)
            return None
        cached = self._answered.get(task_id)
        if cached is not None:
            return cached
        if self.guard.strict:
            self.guard.accept(message)
        try:
            frame = self.runtime.answer(message)
        except Exception:
            log.exception("task %s (round %d) failed", task_id, message.header.round)
            return None
        reply = Reply(AgentChannel.UPDATE, frame, message.header.round)
        self._answered[task_id] = reply
        while len(self._answered) > ANSWERED_TASKS:
            self._answered.popitem(last=False)
        log.info("round %d: %s task answered", message.header.round, meta.kind)
        return reply


class HeadTier:
    """Head tier: installs each encoder release, fits its head, answers with a metrics report."""

    tier: ClassVar[str] = "head"
    accepts: ClassVar[MessageType] = MessageType.RELEASE
    device = "cpu-onnxruntime"

    def __init__(self, agent_id: str, data: ClientData, state_dir: str, head: str, threads: int | None = None, *,
                 signer: Signer | None = None, coordinator_key: Ed25519PublicKey | None = None):
        from .head_tier import HeadRuntime  # onnxruntime and scikit-learn only on this path

        self.agent_id = agent_id
        self.head = head
        self.signer = signer
        self.runtime = HeadRuntime(state_dir, head, data, threads=threads, coordinator_key=coordinator_key)

    @classmethod
    def from_config(cls, config: AgentConfig, data: ClientData, signer: Signer | None = None,
                    coordinator_key: Ed25519PublicKey | None = None) -> HeadTier:
        return cls(config.agent_id, data, config.state_dir, config.head, threads=config.threads, signer=signer,
                   coordinator_key=coordinator_key)

    def subscriptions(self, federation: str, agent_id: str) -> list[str]:
        # The task topic too, as the protocol has every agent do; a head agent ignores tasks.
        # Part 0 of a release in parts: the transport follows its other parts (PROTOCOL.md §12).
        return [agent_topic(federation, agent_id, AgentChannel.TASK),
                federation_topic(federation, FederationChannel.RELEASE), release_part_topic(federation, 0)]

    def restore(self) -> None:
        try:
            self.runtime.load()
        except Exception as exc:  # nothing saved yet, or unusable: wait for a release
            log.info("no usable saved head yet (%s)", exc)

    def handle(self, message: Message) -> Reply | None:
        meta = message.meta_as(ReleaseMeta)  # the agent hands a tier only messages of its ``accepts`` type
        artifact, global_heads = message.tensors.get("artifact"), message.tensors.get("global_heads")
        if artifact is None:
            log.error("release %s carries no artifact; refused", meta.release_id)
            return None
        try:
            result = self.runtime.install_release(
                meta.manifest, artifact.tobytes(), meta.sha256, sequence=meta.sequence, expires=meta.expires,
                proof=message.signed_part + message.signature if message.signature is not None else None,
                global_heads=global_heads.tobytes() if global_heads is not None else None)
        except Exception as exc:
            log.error("release %s refused: %s", meta.release_id, exc)
            return None
        metrics = MetricsMeta(
            tier="head",
            release_id=meta.release_id,
            head=str(result.get("head", self.head)),
            num_train=int(result.get("num_train", 0)),
            num_test=int(result.get("num_test", 0)),
            eval_correct=int(result.get("eval_correct", round(result.get("accuracy", 0.0) * result.get("num_test", 0)))),
            values={k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        )
        frame = encode(MessageType.METRICS, federation=message.header.federation, sender=self.agent_id,
                       round=message.header.round, meta=metrics, signer=self.signer)
        return Reply(AgentChannel.METRICS, frame, message.header.round)


#: tier name (``AgentConfig.tier``) -> how to build it
TIERS: dict[str, type[TrainerTier] | type[HeadTier]] = {TrainerTier.tier: TrainerTier, HeadTier.tier: HeadTier}


def create_tier(config: AgentConfig, data: ClientData, signer: Signer | None = None,
                coordinator_key: Ed25519PublicKey | None = None) -> TierRuntime:
    """The runtime of ``config.tier`` for this agent and its local data; it signs what it
    sends with ``signer`` and holds the coordinator to ``coordinator_key`` when given."""
    if config.tier == HeadTier.tier:
        return HeadTier.from_config(config, data, signer, coordinator_key)
    return TrainerTier.from_config(config, data, signer, pinned=coordinator_key is not None)
