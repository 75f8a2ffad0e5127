"""The agent loop, written once for both tiers.

Connects to the broker (backoff, resubscribe on reconnect), announces itself with a
retained status (tier, device, sample counts, version) and a last will, then
serves the messages of its tier's subscriptions on the main thread while paho's
network thread only queues bytes. What a message means is the tier's business
(:mod:`.tiers`):

* trainer tier: task -> :class:`edgepfl.edge_agent.trainer.TrainerRuntime` -> update;
* head tier: release -> :class:`edgepfl.edge_agent.head_tier.HeadRuntime` -> metrics.
"""

from __future__ import annotations

import logging
import platform
import signal
import threading
from typing import TYPE_CHECKING

from edgepfl import __version__
from edgepfl.config import AgentConfig
from edgepfl.protocol import (
    AgentChannel,
    Message,
    MessageType,
    ProtocolError,
    StatusMeta,
    agent_topic,
    decode,
    encode,
)
from edgepfl.protocol.transport import MqttTransport

from .tiers import TierRuntime, create_tier

if TYPE_CHECKING:
    from edgepfl.data import ClientData

log = logging.getLogger("edgepfl.agent")


class Agent:
    """One edge agent process. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.data: ClientData | None = None
        self.tier: TierRuntime | None = None
        self.transport: MqttTransport | None = None
        self._stop = threading.Event()

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Load local data, build the tier's runtime and restore its saved state (before connecting)."""
        from edgepfl.data import load_client_data

        c = self.config
        self.data = load_client_data(c.data, c.client_index)
        self.tier = create_tier(c, self.data)
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
        status_topic = self._topic(AgentChannel.STATUS)
        self.transport = transport = MqttTransport(
            c.broker.url,
            client_id=f"edgepfl-{c.federation}-{c.agent_id}",
            federation=c.federation,
            sender=c.agent_id,
            subscriptions=tier.subscriptions(c.federation, c.agent_id),
            username=c.broker.username,
            password=c.broker.password,
            will=(status_topic, self._status_frame("offline")),
            birth=lambda: (status_topic, self._status_frame("online"), True),
            max_message_bytes=c.broker.max_message_bytes,
            max_payload_bytes=c.broker.max_payload_bytes,
            keepalive_s=c.broker.keepalive_s,
            inbox_max_bytes=c.broker.inbox_max_bytes,
            inbox_max_messages=c.broker.inbox_max_messages,
        )
        transport.start(timeout=120)
        log.info("agent %s (%s tier) online: %d train / %d test samples", c.agent_id, c.tier,
                 data.num_train, data.num_test)
        try:
            while not self._stop.is_set():
                inbound = transport.receive(timeout=0.5)
                if inbound is None:
                    continue
                try:
                    message = decode(inbound.frame, max_bytes=transport.max_payload_bytes)
                except ProtocolError as exc:
                    log.warning("dropped message on %s: %s", inbound.topic, exc)
                    continue
                self._dispatch(message)
        finally:
            transport.stop(final=(status_topic, self._status_frame("offline")))

    def stop(self, *_args) -> None:
        """Ask :meth:`run` to return (safe from a signal handler)."""
        self._stop.set()

    # ---------------------------------------------------------------- messages
    def _dispatch(self, message: Message) -> None:
        tier, transport = self.tier, self.transport
        if tier is None or transport is None:
            raise RuntimeError("messages are dispatched only while the agent runs")
        if message.header.federation != self.config.federation:
            log.warning("ignored %s for federation %s", message.type.value, message.header.federation)
        elif message.type != tier.accepts:
            log.warning("ignored unexpected %s message from %s", message.type.value, message.header.sender)
        else:
            reply = tier.handle(message)
            if reply is not None:
                transport.publish(self._topic(reply.channel), reply.frame, round=reply.round)

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
        )
        return encode(MessageType.STATUS, federation=c.federation, sender=c.agent_id, round=-1, meta=meta)

    def _topic(self, channel: AgentChannel) -> str:
        return agent_topic(self.config.federation, self.config.agent_id, channel)


def run_agent(config: AgentConfig) -> None:
    """Run an agent until SIGINT / SIGTERM."""
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.setup()
    agent.run()
