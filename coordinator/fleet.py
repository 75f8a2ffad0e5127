"""How the coordinator reaches its agents: over MQTT, or in-process for simulation.

Both fleets move the same encoded frames, so the round loop
(:mod:`edgepfl.coordinator.rounds`) validates, counts bytes and aggregates identically.
"""

from __future__ import annotations

import logging
import queue
from dataclasses import dataclass

from edgepfl.config import BrokerConfig
from edgepfl.protocol import (
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    MessageType,
    ProtocolError,
    StatusMeta,
    agent_topic,
    agent_wildcard,
    decode,
    encode,
    federation_topic,
)
from edgepfl.protocol.transport import MqttTransport

from .registry import Registry

log = logging.getLogger("edgepfl.coordinator")
SENDER = "coordinator"


@dataclass
class Incoming:
    """A whole frame from one agent's update or metrics topic."""

    agent_id: str
    channel: AgentChannel
    frame: bytes
    wire_bytes: int


class Fleet:
    """Interface the round loop uses: presence, sending tasks, receiving answers."""

    registry: Registry

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        """Deliver a task frame; returns bytes put on the wire."""
        raise NotImplementedError

    def poll(self, timeout: float) -> Incoming | None:
        raise NotImplementedError

    def publish_release(self, frame: bytes, round: int) -> int:
        raise NotImplementedError

    def announce(self, meta: CoordinatorMeta) -> None:
        """Coordinator presence (retained)."""

    def close(self) -> None:
        pass

    def on_reject(self, agent_id: str | None, reason: str, detail: str) -> None:
        """Set by the round loop to count transport-level rejections."""


class MqttFleet(Fleet):
    def __init__(self, federation: str, broker: BrokerConfig, url: str | None = None):
        self.federation = federation
        self.registry = Registry()
        self._presence = federation_topic(federation, FederationChannel.COORDINATOR)
        self._meta = CoordinatorMeta(state="online")
        self.transport = MqttTransport(
            url or broker.url,
            client_id=f"edgepfl-{federation}-coordinator",
            federation=federation,
            sender=SENDER,
            subscriptions=[agent_wildcard(federation, ch) for ch in (AgentChannel.STATUS, AgentChannel.UPDATE, AgentChannel.METRICS)],
            username=broker.username,
            password=broker.password,
            will=(self._presence, self._frame(CoordinatorMeta(state="offline"))),
            birth=lambda: (self._presence, self._frame(self._meta), True),
            max_message_bytes=broker.max_message_bytes,
            max_payload_bytes=broker.max_payload_bytes,
            keepalive_s=broker.keepalive_s,
            on_reject=lambda topic, reason, detail: self.on_reject(None, reason, detail),
        )
        self.transport.start(timeout=60)

    def _frame(self, meta: CoordinatorMeta) -> bytes:
        return encode(MessageType.COORDINATOR, federation=self.federation, sender=SENDER, round=meta.round, meta=meta)

    def announce(self, meta: CoordinatorMeta) -> None:
        self._meta = meta
        self.transport.publish(self._presence, self._frame(meta), retain=True)

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        return self.transport.publish(agent_topic(self.federation, agent_id, AgentChannel.TASK), frame, round=round)

    def publish_release(self, frame: bytes, round: int) -> int:
        """Retained when it fits one MQTT message, so late joiners get it from the broker;
        a larger release travels in chunks and is re-sent to every head agent that comes online."""
        self._release = (frame, round)
        topic = federation_topic(self.federation, FederationChannel.RELEASE)
        retain = len(frame) <= self.transport.max_message_bytes
        if not retain:
            log.info("release of %d bytes exceeds max_message_bytes: chunked, re-sent to late joiners", len(frame))
        return self.transport.publish(topic, frame, retain=retain, round=round, wait=True)

    def poll(self, timeout: float) -> Incoming | None:
        inbound = self.transport.receive(timeout)
        if inbound is None:
            return None
        channel, agent_id = inbound.topic.channel, inbound.topic.agent
        if channel == AgentChannel.STATUS:
            self._on_status(agent_id, inbound.frame)
            return None
        if channel not in (AgentChannel.UPDATE, AgentChannel.METRICS) or agent_id is None:
            return None
        return Incoming(agent_id, channel, inbound.frame, inbound.wire_bytes)

    def _on_status(self, agent_id: str | None, frame: bytes) -> None:
        try:
            message = decode(frame)
        except ProtocolError as exc:
            self.on_reject(agent_id, exc.reason, f"status: {exc.detail}")
            return
        if message.type != MessageType.STATUS or message.header.sender != agent_id:
            self.on_reject(agent_id, "wrong_sender", "status not from the agent whose topic it is on")
            return
        was_online = agent_id in self.registry.online()
        self.registry.update(agent_id, message.meta)  # type: ignore[arg-type]
        release = getattr(self, "_release", None)
        if (release and message.meta.tier == "head" and message.meta.state == "online" and not was_online
                and len(release[0]) > self.transport.max_message_bytes):
            self.publish_release(*release)

    def close(self) -> None:
        self.transport.stop(final=(self._presence, self._frame(CoordinatorMeta(state="done", round=self._meta.round,
                                                                               method=self._meta.method))))


class LocalFleet(Fleet):
    """Agents as objects in this process: the research loop and the MQTT path's reference.

    ``runtimes`` maps agent id to a :class:`edgepfl.edge_agent.trainer.TrainerRuntime`. Tasks
    run synchronously inside :meth:`send`; their encoded updates wait in a queue.
    """

    def __init__(self, runtimes: dict):
        self.runtimes = runtimes
        self.registry = Registry()
        for agent_id, runtime in runtimes.items():
            self.registry.update(agent_id, StatusMeta(state="online", tier="trainer", device=str(runtime.device),
                                                      num_train=runtime.data.num_train, num_test=runtime.data.num_test))
        self._queue: queue.Queue[Incoming] = queue.Queue()

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        task = decode(frame)
        answer = self.runtimes[agent_id].answer(task)
        self._queue.put(Incoming(agent_id, AgentChannel.UPDATE, answer, len(answer)))
        return len(frame)

    def poll(self, timeout: float) -> Incoming | None:
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish_release(self, frame: bytes, round: int) -> int:
        return len(frame)
