"""How the coordinator reaches its agents: over MQTT, or in-process for simulation.

Both fleets move the same encoded frames, so the round loop
(:mod:`edgepfl.coordinator.rounds`) validates, counts bytes and aggregates identically.
"""

from __future__ import annotations

import heapq
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from edgepfl.broker import exposure_warning
from edgepfl.config import BrokerConfig, SecuritySpec
from edgepfl.protocol import (
    CAPABILITIES,
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    Message,
    MessageType,
    ReleaseRef,
    StatusMeta,
    TopicError,
    agent_topic,
    agent_wildcard,
    decode,
    encode,
    federation_topic,
    parse_topic,
    split_frame,
    supports,
)
from edgepfl.protocol.backpressure import BoundedInbox
from edgepfl.protocol.envelope import peek_header
from edgepfl.protocol.signing import Signer
from edgepfl.protocol.transport import Inbound, MqttTransport
from edgepfl.simulation import FleetTiming, SimulationSpec, task_samples

from .clock import Clock, VirtualClock, WallClock
from .credentials import Credentials
from .gate import Refused, Rejection
from .releases.channel import BrokerReleaseChannel, ReleaseChannel

log = logging.getLogger("edgepfl.coordinator")
SENDER = "coordinator"
#: an agent whose status still declares no capabilities this long after its birth did not read
#: the retained presence: it is published again (at most this often)
MISSED_PRESENCE_S = 3.0


@dataclass(frozen=True)
class AgentFrame:
    """A whole frame from one agent's status, update or metrics topic: what the fleet hands
    the round loop (the transport's :class:`~edgepfl.protocol.transport.Inbound`, named by
    the agent and channel its topic says)."""

    agent_id: str
    channel: AgentChannel
    frame: bytes
    wire_bytes: int


class Fleet(ABC):
    """How the round loop reaches its agents: send tasks and releases, receive what they publish.

    Pull only: a fleet never calls into the coordinator. Everything that arrives comes
    out of :meth:`poll`, in order: agents' frames as :class:`AgentFrame`, and traffic the
    fleet itself had to drop (a bad topic, chunks that do not reassemble) as a
    :class:`~edgepfl.coordinator.gate.Rejection`, so the round loop counts every
    rejection in one place.
    """

    #: the time every deadline of the round loop is read from (the wall clock but in simulation)
    clock: Clock = WallClock()
    #: whether a task sent can be lost on the way (a broker that restarts forgets what it had
    #: not delivered): then the round loop sends a task again to an agent that reconnected
    #: while it was unanswered (PROTOCOL.md §10)
    loses_tasks: ClassVar[bool] = False
    #: whether every frame that comes out of :meth:`poll` on an agent's channel is provably that
    #: agent's own without a signature (agents in this process): then an unsigned refusal for
    #: good may keep the agent out of the run, as a signed one does (Inbox._on_refusal)
    own_frames: ClassVar[bool] = False
    #: the keys a fleet behind a broker loaded for its own frames (None: the coordinator side loads them)
    credentials: Credentials | None = None
    #: how releases reach the fleet's head agents (this one: a fleet without head agents)
    releases: ReleaseChannel = ReleaseChannel()

    @abstractmethod
    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        """Deliver a task frame; returns bytes put on the wire."""

    @property
    def inbox(self) -> BoundedInbox | None:
        """The queue of frames received and not yet routed, where the fleet has one (for metrics)."""
        return None

    def send_ready(self) -> bool:
        """Whether more may be sent now; while not, the round loop routes inbound traffic
        (which lets the transport take the acknowledgements) instead of queueing more."""
        return True

    def tell(self, agent_id: str, frame: bytes) -> int:
        """Deliver a NACK on the agent's task topic; returns bytes put on the wire. A fleet
        whose agents cannot be told (in-process ones, which are never rejected for their
        frames) drops it."""
        return 0

    def agent_limits(self, agent_id: str, max_message_bytes: int | None, max_payload_bytes: int | None = None) -> None:
        """The largest MQTT message and the largest whole frame the agent declared it accepts
        (None: not declared): what is sent to it is chunked to at most that message size and
        the fleet's own, and a frame larger than the whole-frame limit is not sent at all. A
        fleet without a broker has no sizes to mind."""
        return None  # not abstract: only a fleet with a broker overrides it

    def expect_chunks(self, allowance: Callable[[str, AgentChannel], int]) -> None:
        """Chunked frames on an agent's topic reserve at most ``allowance(agent id, channel)``
        bytes (0: they are refused ``unexpected``). A fleet without a broker gets no chunks."""
        return None  # not abstract: only a fleet with a broker overrides it

    @abstractmethod
    def poll(self, timeout: float) -> AgentFrame | Rejection | Refused | None:
        """The next inbound event, or None when nothing came within ``timeout`` seconds. A
        :class:`~edgepfl.coordinator.gate.Refused` is a task the fleet did not send, because
        the agent declared it takes no frame that large: answered as the agent would."""

    def agent_status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        """Told by the round loop of every status it accepted; ``came_online``: the agent was
        offline or unknown before it. The release channel hears it too."""
        self.releases.status(agent_id, status, came_online)

    @abstractmethod
    def announce(self, meta: CoordinatorMeta) -> None:
        """Publish the coordinator's presence and round."""

    @abstractmethod
    def close(self) -> None:
        """Say goodbye (``done`` presence) and release the connection."""

    def publish_view(self, payload: bytes) -> None:
        """Publish the fleet view (JSON, retained) for operators; a fleet without a broker has nobody to tell."""
        return None  # not abstract: only a fleet with operators watching overrides it


class MqttFleet(Fleet):
    """Agents behind an MQTT broker (``docs/PROTOCOL.md``).

    With ``security.signing_key`` the coordinator's presence, its last will included, is
    signed (tasks and releases are signed by the round loop, which builds them).
    """

    loses_tasks = True
    releases: BrokerReleaseChannel

    def __init__(self, federation: str, broker: BrokerConfig, url: str | None = None,
                 security: SecuritySpec | None = None, credentials: Credentials | None = None):
        security = security or SecuritySpec()
        #: loaded here once; the coordinator side built over this fleet takes them from it (wiring.py)
        self.credentials = credentials or Credentials.load(security)
        self.signer: Signer | None = self.credentials.signer
        warning = exposure_warning(url or broker.url, "coordinator",
                                   signed=bool(security.signing_key and security.enrolled_dir))
        if warning:
            log.warning(warning)
        self.federation = federation
        self._presence = federation_topic(federation, FederationChannel.COORDINATOR)
        self._meta = CoordinatorMeta(state="online")
        self._presence_sent = float("-inf")  # monotonic time of the last presence published (not the birth)
        self._uninformed: dict[str, float] = {}  # agent id -> when its status without capabilities came
        self._limits: dict[str, int] = {}  # agent id -> the max message size it declared, where below ours
        self._payload_limits: dict[str, int] = {}  # agent id -> the largest whole frame it declared it accepts
        self._told_too_large: set[tuple[str, int]] = set()  # (agent, frame size) logged once
        self._dropped: deque[Rejection | Refused] = deque()  # made by the fleet itself, handed out by poll()
        #: (max_message_bytes, max_payload_bytes) announced in every presence frame
        self.transport_limits = (broker.max_message_bytes, broker.max_payload_bytes)
        self.transport = MqttTransport.from_config(
            broker,
            url=url,
            client_id=f"edgepfl-{federation}-coordinator",
            federation=federation,
            sender=SENDER,
            subscriptions=[agent_wildcard(federation, ch) for ch in (AgentChannel.STATUS, AgentChannel.UPDATE, AgentChannel.METRICS)],
            will=(self._presence, self._frame(CoordinatorMeta(state="offline"))),
            birth=self._birth,
            on_reject=self._transport_dropped,
        )
        #: releases: retained, named in the presence, sent to each head agent that lacks one (PROTOCOL.md §12)
        self.releases = BrokerReleaseChannel(federation, self.transport, self._deliver, self._name_release,
                                             self.signer.private.public_key() if self.signer else None,
                                             on_reject=self._transport_dropped)
        self.transport.start(timeout=60)

    @property
    def inbox(self) -> BoundedInbox:
        return self.transport.inbox

    def _frame(self, meta: CoordinatorMeta) -> bytes:
        # Every presence frame announces the limits, so agents chunk to this coordinator's M.
        meta = meta.model_copy(update={"max_message_bytes": self.transport_limits[0],
                                       "max_payload_bytes": self.transport_limits[1]})
        return encode(MessageType.COORDINATOR, federation=self.federation, sender=SENDER, round=meta.round, meta=meta,
                      signer=self.signer)

    def _transport_dropped(self, topic: str, reason: str, detail: str) -> None:
        # Called inside transport.receive(), on the polling thread: handed out by poll().
        try:
            agent_id = parse_topic(topic).agent
        except TopicError:
            agent_id = None
        self._dropped.append(Rejection(agent_id, reason, f"{topic}: {detail}"))

    def _birth(self) -> tuple[str, bytes, bool]:
        # A new session on every connection is a roll call: agents re-publish their status
        # live, which reaches a coordinator that the broker's retained statuses do not
        # (RabbitMQ; PROTOCOL.md §11).
        self._meta = self._meta.model_copy(update={"session": uuid.uuid4().hex})
        return self._presence, self._frame(self._meta), True

    def announce(self, meta: CoordinatorMeta) -> None:
        # the session of this connection and the current release stay in every presence
        self._meta = meta.model_copy(update={"session": self._meta.session, "release": self._meta.release})
        self._publish_presence()

    def _publish_presence(self) -> None:
        self._presence_sent = time.monotonic()
        self.transport.publish(self._presence, self._frame(self._meta), retain=True)

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        sent = self._deliver(agent_id, frame, round)
        if sent is None:  # the agent would refuse it: the round hears so now instead of waiting
            detail = f"a {len(frame)}-byte task, above its max_payload_bytes {self._payload_limits[agent_id]}: not sent"
            self._dropped.append(Refused(agent_id, "too_large", detail, message_id=""))
            return 0
        return sent

    def _deliver(self, agent_id: str, frame: bytes, round: int) -> int | None:
        """Publish ``frame`` on the agent's task topic, chunked to its message size; returns the
        bytes put on the wire, or None when it is larger than the agent accepts (not sent)."""
        topic = agent_topic(self.federation, agent_id, AgentChannel.TASK)
        largest = self._payload_limits.get(agent_id)
        if largest is not None and len(frame) > largest:
            # it would drop the frame as oversized after downloading it: the bytes are not spent
            if (agent_id, len(frame)) not in self._told_too_large:
                self._told_too_large.add((agent_id, len(frame)))
                log.warning("not sending agent %s a %d-byte frame: it accepts frames of at most %d bytes "
                            "(its max_payload_bytes)", agent_id, len(frame), largest)
            return None
        limit = self._limits.get(agent_id)
        if limit is None or len(frame) <= limit:
            return self.transport.publish(topic, frame, round=round)
        # chunked to the agent's declared M, which is below ours: each part then fits the transport's M
        parts = split_frame(frame, limit, federation=self.federation, sender=SENDER, round=round)
        return sum(self.transport.publish(topic, part, round=round) for part in parts)

    def tell(self, agent_id: str, frame: bytes) -> int:
        return self._deliver(agent_id, frame, -1) or 0

    def agent_limits(self, agent_id: str, max_message_bytes: int | None, max_payload_bytes: int | None = None) -> None:
        if max_message_bytes is not None and max_message_bytes < self.transport.max_message_bytes:
            self._limits[agent_id] = max_message_bytes
        else:
            self._limits.pop(agent_id, None)
        if max_payload_bytes is not None:
            self._payload_limits[agent_id] = max_payload_bytes
        else:
            self._payload_limits.pop(agent_id, None)

    def send_ready(self) -> bool:
        return self.transport.send_ready()

    def expect_chunks(self, allowance: Callable[[str, AgentChannel], int]) -> None:
        def by_topic(topic: str) -> int:  # the reassembler's source is the topic the chunks came on
            try:
                parsed = parse_topic(topic)
            except TopicError:
                return 0
            if parsed.channel is FederationChannel.RELEASE:  # the retained release, only while adopting it
                return self.transport.reassembler.max_bytes if self.releases.adopting else 0
            if not isinstance(parsed.channel, AgentChannel) or parsed.agent is None:
                return 0
            return allowance(parsed.agent, parsed.channel)
        self.transport.reassembler.allowance = by_topic

    def _name_release(self, ref: ReleaseRef, announce: bool) -> None:
        """The presence names ``ref`` from now on (and, with ``announce``, says so now)."""
        self._meta = self._meta.model_copy(update={"release": ref})
        if announce:
            self._publish_presence()

    def publish_view(self, payload: bytes) -> None:
        self.transport.publish(federation_topic(self.federation, FederationChannel.VIEW), payload, retain=True)

    def agent_status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        # An agent of 1.2 or later announces itself once without capabilities, before it read
        # this coordinator's presence, and again with them once it has. One that has not within
        # MISSED_PRESENCE_S did not get the retained presence (RabbitMQ keeps retained messages
        # on one cluster node): the presence goes out again live, at most once per that time
        # however many agents missed it (PROTOCOL.md §11), so it learns what this coordinator
        # speaks (and, a head agent, which release is current).
        if status.state == "online" and status.capabilities is None and supports(status.version, CAPABILITIES):
            self._uninformed.setdefault(agent_id, time.monotonic())
        else:
            self._uninformed.pop(agent_id, None)
        super().agent_status(agent_id, status, came_online)

    def poll(self, timeout: float) -> AgentFrame | Rejection | Refused | None:
        if self._uninformed and time.monotonic() >= min(self._uninformed.values()) + MISSED_PRESENCE_S \
                and time.monotonic() >= self._presence_sent + MISSED_PRESENCE_S:
            log.info("%d agents announced themselves without having read the presence: publishing it again",
                     len(self._uninformed))
            self._uninformed.clear()
            self._publish_presence()
        if not self._dropped:
            inbound = self.transport.receive(timeout)
            if inbound is not None and inbound.topic.channel is FederationChannel.RELEASE:
                self.releases.heard(inbound.frame)  # subscribed only to adopt the retained release
            elif inbound is not None:
                return self._incoming(inbound)
        return self._dropped.popleft() if self._dropped else None

    @staticmethod
    def _incoming(inbound: Inbound) -> AgentFrame | None:
        channel, agent_id = inbound.topic.channel, inbound.topic.agent
        # isinstance first: both channel enums are str enums, so `in` alone does not narrow out FederationChannel.
        if (not isinstance(channel, AgentChannel)
                or channel not in (AgentChannel.STATUS, AgentChannel.UPDATE, AgentChannel.METRICS) or agent_id is None):
            return None
        return AgentFrame(agent_id, channel, inbound.frame, inbound.wire_bytes)

    def close(self) -> None:
        done = CoordinatorMeta(state="done", round=self._meta.round, method=self._meta.method, release=self._meta.release)
        self.transport.stop(final=(self._presence, self._frame(done)))


class LocalReply(Protocol):
    """What an in-process agent publishes back: one frame (an update or a refusal)."""

    @property
    def frame(self) -> bytes: ...


class LocalAgent(Protocol):
    """An agent run in this process: :class:`edgepfl.edge_agent.tiers.TrainerTier` is one,
    and answers a task exactly as its agent process would (an update, or a refusal with
    its reason), so the in-process fleet has no refusal path of its own."""

    def status(self) -> StatusMeta:
        """Its presence, as its birth message would announce it."""
        ...

    def handle(self, message: Message) -> LocalReply | None:
        """Its answer to one task (None: ignored, as an agent ignores a task it will not answer)."""
        ...


class LocalFleet(Fleet):
    """Agents as objects in this process, on a virtual clock: the research loop and the
    MQTT path's reference.

    ``agents`` maps agent id to a :class:`LocalAgent` of federation ``federation``. A task
    is computed when it is sent, and its answer is delivered by :meth:`poll` at the
    virtual time the agent's device would have it there (:class:`~edgepfl.simulation.
    FleetTiming`: download, compute while online, upload); a device going off- or online
    is a status frame at that time, as its last will and its reconnection would be. The
    :attr:`clock` moves only to the next such event (or by a poll's whole timeout when
    none is due), so deadlines pass in virtual time and the host's speed changes
    nothing. The frames are the ones an MQTT fleet carries, so with devices that answer
    within the round's deadline a run here matches one over MQTT bit for bit.
    """

    own_frames = True  # its agents live in this process: nobody else can write in their name

    def __init__(self, agents: Mapping[str, LocalAgent], federation: str, timing: FleetTiming | None = None,
                 epochs: int = 1):
        self.agents = agents
        self.federation = federation
        self.timing = timing or FleetTiming(SimulationSpec(), list(agents), seed=0)
        self.epochs = epochs
        self.clock: VirtualClock = VirtualClock()
        self._events: list[tuple[float, int, AgentFrame | str]] = []  # (virtual time, sequence, frame or agent id)
        self._sequence = 0
        for agent_id in agents:
            device = self.timing[agent_id]
            self._push(0.0, self._status(agent_id, device.availability.online_at(0.0)))
            self._push(device.availability.next_change(0.0), agent_id)

    def _push(self, at: float, event: AgentFrame | str) -> None:
        if at != float("inf"):
            heapq.heappush(self._events, (at, self._sequence, event))
            self._sequence += 1

    def _status(self, agent_id: str, online: bool) -> AgentFrame:
        meta = self.agents[agent_id].status()
        if not online:
            meta = meta.model_copy(update={"state": "offline"})
        frame = encode(MessageType.STATUS, federation=self.federation, sender=agent_id, round=-1, meta=meta)
        return AgentFrame(agent_id, AgentChannel.STATUS, frame, len(frame))

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        message = decode(frame)
        reply = self.agents[agent_id].handle(message)
        if reply is not None:
            # Only the counts, to time the answer, read from the raw header: whether the frame is
            # admissible (its meta valid and finite, of a size the run allows) is the gate's to
            # say, with a rejection, as for any agent's frame — never a crash of the run.
            answer = (peek_header(reply.frame) or {}).get("meta") or {}
            samples = task_samples(str(message.header.meta.get("kind", "train")), int(answer.get("num_train", 0)),
                                   int(answer.get("num_test", 0)), self.epochs)
            at = self.timing[agent_id].answer_time(self.clock.now(), len(frame), samples, len(reply.frame))
            self._push(at, AgentFrame(agent_id, AgentChannel.UPDATE, reply.frame, len(reply.frame)))
        return len(frame)

    def poll(self, timeout: float) -> AgentFrame | None:
        if not self._events or self._events[0][0] > self.clock.now() + timeout:
            self.clock.advance_to(self.clock.now() + timeout)
            return None
        at, _, event = heapq.heappop(self._events)
        self.clock.advance_to(at)
        if isinstance(event, AgentFrame):
            return event
        agent_id = event  # the device goes on- or offline now
        availability = self.timing[agent_id].availability
        self._push(availability.next_change(at), agent_id)
        return self._status(agent_id, availability.online_at(at))

    def announce(self, meta: CoordinatorMeta) -> None:
        """Nothing to do: in-process agents get their tasks directly and never ask for presence."""

    def close(self) -> None:
        """Nothing to release."""
