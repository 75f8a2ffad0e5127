"""The agent loop, written once for both tiers.

Connects to the broker (backoff, resubscribe on reconnect), announces itself with a
retained status (tier, device, sample counts, version) and a last will, then
serves the messages of its tier's subscriptions on the main thread while paho's
network thread only queues bytes. What a message means is the tier's business
(:mod:`.tiers`):

* trainer tier: task -> :class:`edgepfl.edge_agent.trainer.TrainerRuntime` -> update;
* head tier: release -> :class:`edgepfl.edge_agent.head_tier.HeadRuntime` -> metrics. A
  head agent takes the broker's retained release only when nobody else brings what it
  lacks (:mod:`.release_fetch`, protocol 1.4), so a restart downloads nothing.

With ``security.coordinator_key`` the agent acts only on frames the coordinator signed
(others are logged with their reason, counted in :attr:`Agent.rejected` and dropped);
with ``security.signing_key`` it signs its statuses, its last will, updates and metrics.

Protocol 1.2, used only with a coordinator whose presence announced it
(``docs/PROTOCOL.md`` §10): the status carries the tier's capabilities, a task the agent
cannot run is answered with a ``refusal``, and ``nack`` frames on the task topic are
logged, counted (:attr:`Agent.nacks`) and close the task they name. A coordinator of
another major version is logged once and its tasks are ignored.

**Held answers.** paho keeps a QoS 1 message published while disconnected and re-sends
it as soon as it reconnects; after a broker restart that is before the coordinator has
subscribed again, so the broker acknowledges the update and discards it, and paho
counts it as delivered. So the agent keeps each task's answer itself until the task's
round is over, and publishes it again once the coordinator's presence shows that round
still open on a connection (or coordinator session) it was not yet published on; a
presence of a later round or ``done`` drops it (logged when it never went out). A copy
the coordinator already has is dropped there as ``duplicate``. A head agent's ``metrics``
report is held the same way, except that it is wanted in any round: it is published
again on every connection (or coordinator session) with the coordinator online that it
has not gone out on yet, and dropped only once the run is ``done``.

**Stopping.** SIGTERM (or SIGINT) is honoured at any point within a few seconds: while
the agent waits for its broker (the wait looks at the stop flag every second), between
messages, and in the middle of a long step — loading its state, installing a release,
training a task — which :func:`edgepfl.service.interruptible` ends at once (the step's
work is dropped; files are written atomically, and a release's switch is never cut in
two). Either way the agent publishes its retained ``offline`` status when it is
connected, and the process exits 0.
"""

from __future__ import annotations

import logging
import platform
import signal
import threading
import time
import uuid
from collections import Counter, deque
from pathlib import Path
from typing import TYPE_CHECKING

from edgepfl import __version__
from edgepfl.agent_config import AgentConfig
from edgepfl.broker import exposure_warning
from edgepfl.logs import LogLimiter, set_log_context
from edgepfl.protocol import (
    CAPABILITIES,
    CODECS,
    RELEASE_DELTAS,
    RELEASE_REFS,
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    Message,
    MessageType,
    NackMeta,
    ProtocolError,
    RollCall,
    StatusMeta,
    agent_topic,
    decode,
    encode,
    federation_topic,
    parse_version,
    supports,
)
from edgepfl.protocol.envelope import peek_header, refusal_frame
from edgepfl.protocol.evolution import MAJOR
from edgepfl.protocol.signing import load_public_key, load_signer, verify
from edgepfl.protocol.transport import MqttTransport
from edgepfl.service import Stopped, interruptible, notifier, request_stop

from .held_answers import HeldAnswer, HeldAnswers
from .release_fetch import RetainedReleases
from .task_guard import recipient_refusal
from .tiers import Reply, TierRuntime, create_tier

if TYPE_CHECKING:
    from edgepfl.data import ClientData

log = logging.getLogger("edgepfl.agent")

COORDINATOR = "coordinator"
# A flood of forged frames is logged once per this many seconds per reason (all are counted).
LOG_EVERY_S = 60.0
# An agent re-asserts its presence at most this often when its retained status is overwritten.
REASSERT_EVERY_S = 2.0
#: the protocol version that added the connection number to statuses (a lost task sent again)
CONNECTION_NUMBERS = (1, 3)
#: a head agent's copy of its loaded samples in its state directory, read through memory maps
#: (:meth:`~edgepfl.data.client.ClientData.paged`): a cache, written anew at each start
SAMPLES_DIR = "samples"


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
        self._log = LogLimiter(log)  # per reason: a flood of bad frames on its topics is not a flood of lines
        self._births: deque[bytes] = deque(maxlen=4)  # the last births published, newest last
        self._birth_declares = False  # whether that birth carried capabilities
        self._reasserted = float("-inf")
        #: the last presence of a coordinator of this major version (None: none seen yet)
        self.coordinator: CoordinatorMeta | None = None
        self._foreign_version: str | None = None  # set while the coordinator speaks another major version
        #: nack frames received, by reason
        self.nacks: Counter[str] = Counter()
        self._answers = HeldAnswers()
        #: a head agent's retained release topics, taken on a connection only when needed
        self._retained: RetainedReleases | None = None
        self._step: str | None = None  # the long step under way (a message being handled), for the log

    # ---------------------------------------------------------------- lifecycle
    def setup(self) -> None:
        """Load local data, build the tier's runtime and restore its saved state (before connecting)."""
        from edgepfl.data import load_client_data

        c = self.config
        self.data = load_client_data(c.data, c.client_index)
        if c.tier == "head":  # it reads its samples only to install a release: from a file's pages
            self.data = self.data.paged(Path(c.state_dir) / SAMPLES_DIR)
        self.tier = create_tier(c, self.data, self.signer, self.coordinator_key)
        self.tier.restore()
        topics = self.tier.release_topics(c.federation)
        self._retained = RetainedReleases(topics, self.tier.installed_release) if topics else None

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
        self.transport = transport = MqttTransport.from_config(
            c.broker,
            client_id=f"edgepfl-{c.federation}-{c.agent_id}",
            federation=c.federation,
            sender=c.agent_id,
            # The coordinator's presence: it announces the message size M to chunk to, and a new
            # coordinator session is a roll call (PROTOCOL.md §11). Its own status too: a
            # retained status someone else put there is replaced (_reassert).
            subscriptions=[*tier.subscriptions(c.federation, c.agent_id),
                           federation_topic(c.federation, FederationChannel.COORDINATOR), status_topic],
            will=(status_topic, self._status_frame("offline")),
            birth=lambda: (status_topic, self._new_birth(), True),
            # statuses and answers left unacknowledged by a lost connection: the birth on the
            # reconnect and the held answers replace them (module docstring)
            not_resent=lambda topic: topic in (status_topic, self._topic(AgentChannel.UPDATE),
                                               self._topic(AgentChannel.METRICS)),
        )
        service = notifier()
        if service.active:
            # Under systemd the agent waits for its broker as long as it takes (a board that
            # boots before its network, a broker down for a while): ready, saying so, with the
            # watchdog pinged, rather than a start that times out and restarts until the unit's
            # start limit leaves it failed. Run by hand, it gives up after 120 s with the cause.
            service.ready(f"agent {c.agent_id} ({c.tier} tier) waiting for the broker at {c.broker.url}")
        if transport.start(timeout=None if service.active else 120, stop=self._stop, tick=service.watchdog) is None:
            log.info("agent %s stopped before its broker connection was up", c.agent_id)
            transport.stop()
            return
        log.info("agent %s (%s tier) online: %d train / %d test samples", c.agent_id, c.tier,
                 data.num_train, data.num_test)
        service.ready(f"agent {c.agent_id} ({c.tier} tier) connected to {c.broker.url}")
        try:
            while not self._stop.is_set():
                service.watchdog()
                if self._retained is not None:
                    self._retained.tick(transport)
                inbound = transport.receive(timeout=0.5)
                if inbound is None:
                    continue
                if inbound.topic.channel == AgentChannel.STATUS:
                    self._reassert(inbound.frame)
                    continue
                try:
                    message = decode(inbound.frame, max_bytes=transport.max_payload_bytes)
                except ProtocolError as exc:
                    self._log.warning(exc.reason, "dropped message on %s: %s", inbound.topic, exc)
                    if exc.reason == "oversized" and inbound.topic.channel == AgentChannel.TASK:
                        self._refuse_oversized(inbound.frame)
                    continue
                self._dispatch(message, retained=inbound.topic.channel == FederationChannel.RELEASE)
        except Stopped:
            log.info("agent %s stopped during %s; that work is dropped", c.agent_id, self._step or "a long step")
        finally:
            service.stopping()
            transport.stop(final=(status_topic, self._status_frame("offline")))

    def stop(self, *_args) -> None:
        """Ask :meth:`run` to return (safe from any thread and from a signal handler)."""
        self._stop.set()

    def terminate(self, *_args) -> None:
        """The SIGTERM / SIGINT handler: :meth:`stop`, and end a long step under way at once
        (:func:`edgepfl.service.request_stop`) instead of after it."""
        self._stop.set()
        request_stop()

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

    def _dispatch(self, message: Message, retained: bool = False) -> None:
        """Act on one decoded message; ``retained``: it came from the retained release topics."""
        tier, transport = self.tier, self.transport
        if tier is None or transport is None:
            raise RuntimeError("messages are dispatched only while the agent runs")
        forged = self._forged(message)
        if forged is not None:
            self._drop(message, *forged)
        elif message.header.federation != self.config.federation:
            self._log.warning("wrong_federation", "ignored %s for federation %s", message.type.value,
                              message.header.federation)
        elif message.type == MessageType.COORDINATOR:
            self._on_presence(message.meta_as(CoordinatorMeta))
        elif message.type == MessageType.NACK:
            self._on_nack(message)
        elif self._foreign_version is not None:
            self._drop(message, "unsupported_version", f"the coordinator speaks protocol {self._foreign_version}")
        elif message.type not in tier.accepts:
            self._log.warning("unexpected", "ignored unexpected %s message from %s", message.type.value,
                              message.header.sender)
        else:
            if retained and message.type == MessageType.RELEASE and self._retained is not None:
                self._retained.took_release(transport)  # before the install it is about to start
            self._step = f"the {message.type.value} of round {message.header.round}"
            set_log_context(round=message.header.round)
            had = tier.installed_release()
            with interruptible():  # a SIGTERM ends an install or a training at once (module docstring)
                reply = tier.handle(message)
            self._step = None
            if reply is not None:
                self._send(reply)
            if tier.installed_release() != had and self._speaks(RELEASE_REFS) and transport.connected.is_set():
                # the retained status names the release it has (PROTOCOL.md §12): a coordinator that
                # starts later reads it there, and sends nothing to an agent that has the current one
                transport.publish(self._topic(AgentChannel.STATUS), self._new_birth(), retain=True)

    def speaks_1_2(self) -> bool:
        """Whether the coordinator's presence announced protocol 1.2 or later (of this major)."""
        return self._speaks(CAPABILITIES)

    def _speaks(self, feature: tuple[int, int]) -> bool:
        return self.coordinator is not None and supports(self.coordinator.version, feature)

    def _on_presence(self, presence: CoordinatorMeta) -> None:
        transport = self.transport
        assert transport is not None  # only called from _dispatch
        if parse_version(presence.version)[0] != MAJOR:
            if self._foreign_version != presence.version:
                log.error("the coordinator speaks protocol %s, this agent %d.x: another major version, so its tasks "
                          "are ignored until a coordinator of major version %d is online", presence.version, MAJOR, MAJOR)
            self._foreign_version = presence.version
            return
        self._foreign_version = None
        self.coordinator = presence
        self.adopt_limits(presence)
        # A new coordinator session is a roll call; a coordinator whose version says whether
        # it reads capabilities gets a birth that does (or does not) carry them.
        due = self._roll_call.due(presence) or self._birth_declares != self.speaks_1_2()
        if due and transport.connected.is_set():  # else the birth of the reconnect is the fresh one
            transport.publish(self._topic(AgentChannel.STATUS), self._new_birth(), retain=True)
        if self._retained is not None:
            self._retained.on_presence(transport, presence)
            self._report_installed(presence)
        self._settle_answers(presence)

    def _report_installed(self, presence: CoordinatorMeta) -> None:
        """A coordinator online that names this head agent's installed release as current
        sends it nothing (PROTOCOL.md §12, releases by reference): the agent reports its
        metrics on it unasked, held like any report (once per connection and session)."""
        tier = self.tier
        assert tier is not None
        installed = tier.installed_release()
        if presence.state != "online" or installed is None or presence.release != installed:
            return
        reply = tier.installed_report(self.config.federation)
        if reply is not None and reply.held_as not in self._answers:
            self._send(reply)

    def _send(self, reply: Reply) -> None:
        """Publish a tier's reply; a task's answer or a metrics report is held as well (the
        module's "held answers")."""
        transport = self.transport
        assert transport is not None  # only called from _dispatch
        key = reply.held_as
        if key is None:
            if reply.since is not None and not self._speaks(reply.since):
                log.info("a %s frame of round %d is not sent: the coordinator (protocol %s) does not speak %d.%d",
                         reply.channel.value, reply.round, self.coordinator.version if self.coordinator else "unknown",
                         *reply.since)
                return
            transport.publish(self._topic(reply.channel), reply.frame, round=reply.round)
            return
        if reply.refusal and not self.speaks_1_2():
            # the tier logged why it refused; a coordinator before 1.2 is not sent refusals
            log.info("refusal of task %s not sent: the coordinator (protocol %s) does not take refusals",
                     reply.task_id, self.coordinator.version if self.coordinator else "unknown")
            return
        if reply.since is not None and not self._speaks(reply.since):
            if reply.older is not None:
                reply = reply.older  # the same answer, as an older coordinator reads it
            else:
                log.info("the %s is not sent: the coordinator (protocol %s) does not read it", key,
                         self.coordinator.version if self.coordinator else "unknown")
                return
        held = self._answers.hold(key, reply)
        if transport.connected.is_set():
            self._publish(held)
        elif reply.task_id is None:
            log.warning("the %s (round %d) is held: not connected to the broker; it is published once the "
                        "coordinator is back", key, reply.round)
        else:
            log.warning("the answer to task %s (round %d) is held: not connected to the broker; it is published "
                        "once the coordinator is back in that round", reply.task_id, reply.round)

    def _publish(self, held: HeldAnswer) -> None:
        transport = self.transport
        assert transport is not None
        reply = held.reply
        transport.publish(self._topic(reply.channel), reply.frame, round=reply.round)
        held.sent_on = (transport.connect_count, self.coordinator.session if self.coordinator else "")

    def _settle_answers(self, presence: CoordinatorMeta) -> None:
        """Publish each held answer whose round the presence shows open (a metrics report: any
        round), on a connection or to a coordinator session it did not go out on yet; forget
        those of rounds that are over (a metrics report: of a run that is done)."""
        transport = self.transport
        assert transport is not None
        for held in self._answers.settle(presence, (transport.connect_count, presence.session)):
            self._publish(held)

    def _on_nack(self, message: Message) -> None:
        tier = self.tier
        assert tier is not None  # only called from _dispatch
        misaddressed = recipient_refusal(message, self.config.agent_id, strict=self.coordinator_key is not None)
        if misaddressed is not None:
            self._drop(message, *misaddressed)
            return
        nack = message.meta_as(NackMeta)
        self.nacks[nack.reason] += 1
        held = self._answers.get(nack.task_id) if nack.task_id is not None else None
        # Only a rejection of this agent's own answer closes its task: a nack naming a frame it
        # never sent (someone else's frame on its topic, or a forged nack) must not cost it the task.
        own = held is not None and _message_id(held.reply.frame) == nack.message_id
        log.warning("the coordinator rejected %s %s %s (round %d): %s%s%s",
                    "this agent's" if own or nack.task_id is None else "a frame this agent did not send, a",
                    nack.rejected_type, nack.message_id, message.header.round, nack.reason,
                    f" ({nack.detail})" if nack.detail else "",
                    f"; task {nack.task_id} is closed" if own else
                    f"; task {nack.task_id} stays open" if nack.task_id else "")
        if own and nack.task_id is not None:
            self._answers.drop(nack.task_id)
            tier.close(nack.task_id)

    def _refuse_oversized(self, frame: bytes) -> None:
        """A task larger than this agent takes (a coordinator that had not yet read its
        ``max_payload_bytes``, sent before its birth that declares it): answered with a
        refusal ``too_large`` built from the header alone, so the round does not wait for an
        answer that cannot come (PROTOCOL.md §5). Only to a 1.4 coordinator, which excludes
        it from the run; an unreadable header or a frame that is not a task gets nothing."""
        header = peek_header(frame)
        meta = header.get("meta") if header else None
        if not (header and isinstance(meta, dict) and header.get("type") == MessageType.TASK.value
                and header.get("federation") == self.config.federation and self._speaks(RELEASE_REFS)):
            return
        task_id, size = str(meta.get("task_id")), len(frame)  # a malformed id fails the refusal's own check
        try:
            round = int(header["round"])
            frame = refusal_frame(self.config.federation, round, task_id, sender=self.config.agent_id,
                                  reason="too_large", signer=self.signer,
                                  detail=f"{size} bytes, above this agent's max_payload_bytes "
                                         f"{self.config.broker.max_payload_bytes}")
        except (ValueError, TypeError, KeyError):
            return
        log.warning("refused task %s (round %d): too_large (%d bytes)", task_id, round, size)
        self._send(Reply(AgentChannel.UPDATE, frame, round, task_id, refusal=True))

    def _new_birth(self) -> bytes:
        self._birth_declares = self.speaks_1_2()
        self._births.append(self._status_frame("online"))
        return self._births[-1]

    def _reassert(self, frame: bytes) -> None:
        """Another status than this process's births is retained on its status topic (a
        forged or replayed ``offline``, an old will): publish a fresh birth over it, so a
        coordinator that (re)starts learns the agent's real presence. Rate-limited; not
        while disconnected (the reconnect publishes a birth)."""
        if (frame in self._births or self.transport is None or self._stop.is_set()
                or not self.transport.connected.is_set()):
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
            # 1.2: only for a coordinator that reads them (left out of the frame otherwise)
            capabilities=tier.capabilities().model_copy(update={
                "max_message_bytes": c.broker.max_message_bytes,
                # 1.4: the largest frame its reassembler takes; nothing larger is sent to it
                "max_payload_bytes": c.broker.max_payload_bytes if self._speaks(RELEASE_REFS) else None,
                # 1.6: the update codecs it encodes, for a coordinator that may ask for one
                "codecs": tier.capabilities().codecs if self._speaks(CODECS) else None,
                # 1.7: the codecs a head agent decodes release deltas in
                "release_codecs": tier.capabilities().release_codecs if self._speaks(RELEASE_DELTAS) else None,
            }) if self.speaks_1_2() else None,
            # 1.3: a birth on a new connection tells the coordinator a task may have been lost
            connection=self.transport.connect_count or None
            if self.transport is not None and self._speaks(CONNECTION_NUMBERS) else None,
            # 1.4: the release a head agent has, which a coordinator that has it too does not send
            release=tier.installed_release() if self._speaks(RELEASE_REFS) else None,
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
    """Run an agent until SIGINT / SIGTERM (then it returns: the command exits 0)."""
    set_log_context(federation=config.federation, agent=config.agent_id, tier=config.tier)  # on every JSON line
    agent = Agent(config)
    signal.signal(signal.SIGTERM, agent.terminate)
    signal.signal(signal.SIGINT, agent.terminate)
    try:
        with interruptible():  # loading the data and restoring a release take seconds on a Pi
            agent.setup()
    except Stopped:
        log.info("agent %s stopped while loading its data and state", config.agent_id)
        return
    agent.run()


def _message_id(frame: bytes) -> str | None:
    """The ``message_id`` in a frame this agent encoded itself."""
    header = peek_header(frame)
    value = header.get("message_id") if header else None
    return value if isinstance(value, str) else None

