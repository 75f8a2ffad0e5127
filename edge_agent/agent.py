"""The agent loop, written once for both tiers.

Connects to the broker (backoff, resubscribe on reconnect), announces itself with a
retained status (tier, device, sample counts, version) and a last will, then
serves the messages of its tier's subscriptions on the main thread while paho's
network thread only queues bytes. What a message means is the tier's business
(:mod:`.tiers`):

* trainer tier: task -> :class:`edgepfl.edge_agent.trainer.TrainerRuntime` -> update;
* head tier: release -> :class:`edgepfl.edge_agent.head_tier.HeadRuntime` -> metrics.

With ``security.coordinator_key`` the agent acts only on frames the coordinator signed
(others are logged with their reason, counted in :attr:`Agent.rejected` and dropped);
with ``security.signing_key`` it signs its statuses, its last will, updates and metrics.
"""

from __future__ import annotations

import logging
import platform
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from edgepfl import __version__
from edgepfl.broker import exposure_warning
from edgepfl.config import AgentConfig
from edgepfl.protocol import (
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    Message,
    MessageType,
    ProtocolError,
    RollCall,
    StatusMeta,
    agent_topic,
    decode,
    encode,
    federation_topic,
)
from edgepfl.protocol.connection import BrokerLogin
from edgepfl.protocol.signing import load_public_key, load_signer, verify
from edgepfl.protocol.transport import MqttTransport
from edgepfl.service import notifier

from .tiers import TierRuntime, create_tier

if TYPE_CHECKING:
    from edgepfl.data import ClientData

log = logging.getLogger("edgepfl.agent")

COORDINATOR = "coordinator"
# A flood of forged frames is logged once per this many seconds per reason (all are counted).
LOG_EVERY_S = 60.0
# An agent re-asserts its presence at most this often when its retained status is overwritten.
REASSERT_EVERY_S = 2.0


class Agent:
    """One edge agent process. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.data: ClientData | None = None
        self.tier: TierRuntime | None = None
        self.transport: MqttTransport | None = None
        self._stop = threading.Event()
        self._warned_payload: int | None = None
        self._roll_call = RollCall()
        security = config.security
        self.signer = load_signer(security.signing_key) if security.signing_key else None
        self.coordinator_key = load_public_key(security.coordinator_key) if security.coordinator_key else None
        #: one per process: the coordinator orders this process's will and births by it (PROTOCOL.md §11)
        self.session = uuid.uuid4().hex
        #: frames dropped before reaching the tier, by reason
        self.rejected: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self._birth: bytes | None = None  # the last birth status published
        self._reasserted = float("-inf")

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Load local data, build the tier's runtime and restore its saved state (before connecting)."""
        from edgepfl.data import load_client_data

        c = self.config
        self.data = load_client_data(c.data, c.client_index)
        self.tier = create_tier(c, self.data, self.signer, self.coordinator_key)
        self.tier.restore()

    def _ready(self) -> tuple[TierRuntime, ClientData]:
        """The tier and the local data that :meth:`setup` loaded."""
        if self.tier is None or self.data is None:
            raise RuntimeError("agent not set up: call setup() first")
        return self.tier, self.data

    def run(self) -> None:
        """Connect, announce, serve messages until :meth:`stop`, then say goodbye."""
        if self.tier is None:
            self.setup()
        tier, data = self._ready()
        c = self.config
        warning = exposure_warning(c.broker.url, "agent", signed=bool(self.signer and self.coordinator_key))
        if warning:
            log.warning(warning)
        status_topic = self._topic(AgentChannel.STATUS)
        self.transport = transport = MqttTransport(
            c.broker.url,
            client_id=f"edgepfl-{c.federation}-{c.agent_id}",
            federation=c.federation,
            sender=c.agent_id,
            # The coordinator's presence: it announces the message size M to chunk to, and a new
            # coordinator session is a roll call (PROTOCOL.md §11). Its own status too: a
            # retained status someone else put there is replaced (_reassert).
            subscriptions=[*tier.subscriptions(c.federation, c.agent_id),
                           federation_topic(c.federation, FederationChannel.COORDINATOR), status_topic],
            login=BrokerLogin.from_config(c.broker),
            will=(status_topic, self._status_frame("offline")),
            birth=lambda: (status_topic, self._new_birth(), True),
            max_message_bytes=c.broker.max_message_bytes,
            max_payload_bytes=c.broker.max_payload_bytes,
            max_buffered_bytes=c.broker.max_buffered_bytes,
            keepalive_s=c.broker.keepalive_s,
            inbox_max_bytes=c.broker.inbox_max_bytes,
            inbox_max_messages=c.broker.inbox_max_messages,
        )
        transport.start(timeout=120)
        log.info("agent %s (%s tier) online: %d train / %d test samples", c.agent_id, c.tier,
                 data.num_train, data.num_test)
        service = notifier()
        service.ready(f"agent {c.agent_id} ({c.tier} tier) connected to {c.broker.url}")
        try:
            while not self._stop.is_set():
                service.watchdog()
                inbound = transport.receive(timeout=0.5)
                if inbound is None:
                    continue
                if inbound.topic.channel == AgentChannel.STATUS:
                    self._reassert(inbound.frame)
                    continue
                try:
                    message = decode(inbound.frame, max_bytes=transport.max_payload_bytes)
                except ProtocolError as exc:
                    log.warning("dropped message on %s: %s", inbound.topic, exc)
                    continue
                self._dispatch(message)
        finally:
            service.stopping()
            transport.stop(final=(status_topic, self._status_frame("offline")))

    def stop(self, *_args) -> None:
        """Ask :meth:`run` to return (safe from a signal handler)."""
        self._stop.set()

    # ---------------------------------------------------------------- messages
    def adopt_limits(self, presence: CoordinatorMeta) -> int:
        """Publish in MQTT messages of at most min(own M, the coordinator's announced M);
        returns that size. An own ``broker.max_message_bytes`` above the announced one is
        a misconfiguration (the broker in front of the coordinator may refuse such
        messages and drop the connection), so it is logged as a warning, once per value.
        """
        transport = self.transport
        if transport is None:
            raise RuntimeError("limits are adopted only while the agent runs")
        own = self.config.broker.max_message_bytes
        announced = presence.max_message_bytes
        effective = own if announced is None else min(own, announced)
        transport.accept_message_bytes = max(own, announced or 0)
        if announced is not None and announced < own and transport.max_message_bytes != effective:
            log.warning("the coordinator announces max_message_bytes=%d, below this agent's %d: publishing in "
                        "messages of at most %d bytes (set broker.max_message_bytes: %d in the agent config)",
                        announced, own, effective, announced)
        transport.max_message_bytes = effective
        payload = presence.max_payload_bytes
        if payload is not None and payload < transport.max_payload_bytes and payload != self._warned_payload:
            self._warned_payload = payload
            log.warning("the coordinator accepts frames of at most %d bytes (max_payload_bytes), this agent up to "
                        "%d: a larger update would be refused as oversized", payload, transport.max_payload_bytes)
        return effective

    def _dispatch(self, message: Message) -> None:
        tier, transport = self.tier, self.transport
        if tier is None or transport is None:
            raise RuntimeError("messages are dispatched only while the agent runs")
        forged = self._forged(message)
        if forged is not None:
            self._drop(message, *forged)
        elif message.header.federation != self.config.federation:
            log.warning("ignored %s for federation %s", message.type.value, message.header.federation)
        elif message.type == MessageType.COORDINATOR:
            presence = message.meta_as(CoordinatorMeta)
            self.adopt_limits(presence)
            if self._roll_call.due(presence):
                transport.publish(self._topic(AgentChannel.STATUS), self._new_birth(), retain=True)
        elif message.type != tier.accepts:
            log.warning("ignored unexpected %s message from %s", message.type.value, message.header.sender)
        else:
            reply = tier.handle(message)
            if reply is not None:
                transport.publish(self._topic(reply.channel), reply.frame, round=reply.round)

    def _new_birth(self) -> bytes:
        self._birth = self._status_frame("online")
        return self._birth

    def _reassert(self, frame: bytes) -> None:
        """Another status than this process's last birth is retained on its status topic (a
        forged or replayed ``offline``, an old will): publish a fresh birth over it, so a
        coordinator that (re)starts learns the agent's real presence. Rate-limited."""
        if frame == self._birth or self.transport is None or self._stop.is_set():
            return
        now = time.monotonic()
        if now - self._reasserted < REASSERT_EVERY_S:
            return
        self._reasserted = now
        log.info("a status this process did not publish is retained on its topic; announcing itself again")
        self.transport.publish(self._topic(AgentChannel.STATUS), self._new_birth(), retain=True)

    def _forged(self, message: Message) -> tuple[str, str] | None:
        """With a pinned coordinator key: (reason, detail) unless the coordinator signed ``message``."""
        if self.coordinator_key is None:
            return None
        if message.header.sender != COORDINATOR:
            return "wrong_sender", f"from {message.header.sender}, not the coordinator"
        reason = verify(message, self.coordinator_key)
        return None if reason is None else (reason, "not signed by the pinned coordinator key")

    def _drop(self, message: Message, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        now = time.monotonic()
        if now - self._logged.get(reason, float("-inf")) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning("dropped %s (round %d): %s (%s); %d dropped for this reason so far", message.type.value,
                        message.header.round, reason, detail, self.rejected[reason])

    def _status_frame(self, state: str) -> bytes:
        c = self.config
        tier, data = self._ready()
        meta = StatusMeta(
            state=state,
            tier=c.tier,
            device=tier.device,
            num_train=data.num_train,
            num_test=data.num_test,
            software=f"edgepfl {__version__}",
            platform=f"{platform.system()} {platform.machine()} py{platform.python_version()}",
            session=self.session,
        )
        return encode(MessageType.STATUS, federation=c.federation, sender=c.agent_id, round=-1, meta=meta,
                      signer=self.signer)

    def _topic(self, channel: AgentChannel) -> str:
        return agent_topic(self.config.federation, self.config.agent_id, channel)


#: what ``--reset-state`` keeps: a head fitted offline is the operator's file, not state
KEPT_ON_RESET = frozenset({"head.offline.onnx"})


def reset_state(state_dir: str | Path) -> list[str]:
    """Delete what the agent keeps in ``state_dir`` (personal states, task order, installed
    release and its sequence); returns the names removed, each logged. A task never does this."""
    removed = []
    directory = Path(state_dir)
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        if path.is_file() and path.name not in KEPT_ON_RESET:
            path.unlink()
            removed.append(path.name)
            log.warning("reset: removed %s", path)
    log.warning("reset: %d files removed from %s", len(removed), directory)
    return removed


def run_agent(config: AgentConfig) -> None:
    """Run an agent until SIGINT / SIGTERM."""
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.setup()
    agent.run()
