"""MQTT transport shared by coordinator and agents (paho-mqtt 2.x).

What it adds over a bare paho client:

* a first connection that fails names its cause within seconds
  (:class:`~edgepfl.protocol.connection.BrokerUnreachable`): a CA or password that is
  wrong fails at once, a broker that is down or a name that does not resolve is
  retried with backoff, the cause logged on each retry;
* TLS with a private CA and client certificates (:class:`~edgepfl.protocol.connection.BrokerLogin`);
* reconnect with exponential backoff, and **subscribe in on_connect**, so a reconnect
  restores every subscription;
* a last will and a birth message (re-published on every connect) for presence;
* ``not_resent``: topics whose QoS 1 messages left unacknowledged by a lost connection
  paho must not re-send on the reconnect (it would, right after the CONNACK: after a
  broker restart that is before anyone subscribed again, so the broker acknowledges them
  to nobody); the agent re-publishes its status and held answers itself;
* payloads larger than ``max_message_bytes`` are split into chunk frames and put
  back together (and sha256-verified) on receipt, with the partial frames bounded per
  topic and in all (:mod:`.reassembly`); an evicted or refused partial is reported
  like any other dropped message;
* a frame too large for one message that must stay retained (a release) is published as
  retained **parts**, chunk i on its own topic (:meth:`MqttTransport.publish_parts`); a
  receiver subscribed to part 0 subscribes to the others once chunk 0 tells their count,
  and reassembles them as one frame of the parts' base topic (docs/PROTOCOL.md §8, §12);
* incoming frames are queued and handed to the caller's thread by
  :meth:`MqttTransport.receive`, so decoding and training never run on paho's
  network thread; the queue is bounded (:class:`.backpressure.BoundedInbox`): paho runs
  with manual acknowledgement and the queue sends the PUBACKs, holding them back while it
  is full, so the broker keeps the backlog and paho's thread never stops reading;
* a count of the bytes published and not yet acknowledged (:attr:`MqttTransport.unacked_bytes`,
  :meth:`MqttTransport.send_ready`): paho keeps every QoS 1 message until its PUBACK, so a
  sender that waits for room sends at the broker's pace instead of queueing a round's
  worth of tasks in this process;
* counters of bytes and messages in each direction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..broker import parse_broker_url
from ..logs import LogLimiter
from ..specs import BrokerConfig
from .backpressure import BoundedInbox
from .connection import (
    BrokerLogin,
    BrokerUnreachable,
    Failure,
    FailureCause,
    classify_connack,
    classify_socket_error,
    closed_before_connack,
)
from .envelope import DEFAULT_MAX_PAYLOAD_BYTES, ProtocolError, decode, peek_header, split_frame
from .messages import ChunkMeta, MessageType
from .reassembly import DEFAULT_MAX_BUFFERED_BYTES, Reassembler
from .topics import FederationChannel, ParsedTopic, TopicError, federation_topic, parse_topic, release_part_topic

log = logging.getLogger(__name__)


def default_inbox_bytes(max_payload_bytes: int, max_message_bytes: int) -> int:
    """The inbound queue's default bound (and the send window's): a sixteenth of the largest
    whole payload, and room for at least four MQTT messages (chunks are reassembled one
    message at a time, so a payload need not fit)."""
    return max(max_payload_bytes // 16, 4 * max_message_bytes)


@dataclass
class Inbound:
    """One whole frame received on a topic (chunks already reassembled)."""

    topic: ParsedTopic
    frame: bytes
    wire_bytes: int


#: how long one connection attempt waits for the broker's CONNACK when the start has no deadline
CONNACK_WAIT_S = 30.0


def _wait_in_slices(seconds: float, wait: Callable[[float], bool], tick: Callable[[], None] | None) -> bool:
    """Call ``wait(s)`` with ``s`` of at most a second, ``tick`` after each, until it returns True
    (what it waits for happened: returns True) or ``seconds`` have passed (returns False)."""
    until = time.monotonic() + seconds
    while (now := time.monotonic()) < until:
        if wait(min(1.0, until - now)):
            return True
        if tick is not None:
            tick()
    return False


def _interruptible_wait(seconds: float, stop: threading.Event | None, tick: Callable[[], None] | None) -> bool:
    """Sleep ``seconds`` in steps of at most one, calling ``tick`` after each; True when ``stop`` was set."""
    return _wait_in_slices(seconds, (stop or threading.Event()).wait, tick) or (stop is not None and stop.is_set())


class MqttTransport:
    """A connected MQTT client speaking edgepfl frames.

    ``subscriptions`` are (re)subscribed on every connect; ``birth`` is a callable
    returning ``(topic, frame, retain)`` published after every connect; ``will`` is
    ``(topic, frame)`` registered as the last will (retained). ``login`` carries the
    username, password and TLS files (default: anonymous, system trust store).
    """

    @classmethod
    def from_config(cls, broker: BrokerConfig, *, url: str | None = None, **options) -> MqttTransport:
        """A transport with everything ``broker:`` configures (limits, keepalive, inbound queue,
        credentials); ``url`` (default ``broker.url``) where the broker really is, e.g. an
        embedded broker's address; ``options`` the caller's own (client id, topics, will, …)."""
        return cls(url or broker.url, login=BrokerLogin.from_config(broker),
                   max_message_bytes=broker.max_message_bytes, max_payload_bytes=broker.max_payload_bytes,
                   max_buffered_bytes=broker.max_buffered_bytes, keepalive_s=broker.keepalive_s,
                   inbox_max_bytes=broker.inbox_max_bytes, inbox_max_messages=broker.inbox_max_messages,
                   inbox_max_held_acks=broker.inbox_max_held_acks, **options)

    def __init__(
        self,
        url: str,
        *,
        client_id: str,
        federation: str,
        sender: str,
        subscriptions: list[str],
        login: BrokerLogin | None = None,
        will: tuple[str, bytes] | None = None,
        birth: Callable[[], tuple[str, bytes, bool]] | None = None,
        max_message_bytes: int = 1_000_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
        keepalive_s: int = 30,
        on_reject: Callable[[str, str, str], None] | None = None,
        inbox_max_bytes: int | None = None,
        inbox_max_messages: int = 10_000,
        inbox_max_held_acks: int = 100,
        not_resent: Callable[[str], bool] | None = None,
    ):
        import paho.mqtt.client as mqtt

        self.host, self.port, tls = parse_broker_url(url)
        self._tls = tls
        self.federation = federation
        self.sender = sender
        self.subscriptions = list(subscriptions)
        #: subscribed at the owner's request on the current connection only (:meth:`subscribe`):
        #: a reconnect does not restore them, so the owner decides again on each connection
        self.connection_subscriptions: list[str] = []
        self.birth = birth
        self._drop_log = LogLimiter(log)  # per reason: a flood of bad frames is not a flood of lines
        self.max_message_bytes = max_message_bytes  # what this side publishes: chunks of at most this
        #: the largest MQTT message accepted from peers (an agent raises it to the coordinator's announced M)
        self.accept_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s
        self.on_reject = on_reject
        self.not_resent = not_resent
        # Raw (topic, payload) from paho's thread, which never waits here: the inbox holds
        # the PUBACKs back instead (see .backpressure for why waiting lost connections).
        self.inbox: BoundedInbox[tuple[str, bytes]] = BoundedInbox(
            inbox_max_bytes or default_inbox_bytes(max_payload_bytes, max_message_bytes), inbox_max_messages,
            max_held=inbox_max_held_acks, max_wait_s=keepalive_s / 3)
        # A held PUBACK belongs to the connection that delivered its message: after a
        # reconnect its message id names another message (or none), so it is not sent.
        self._ack_lock = threading.Lock()
        self._connection = 0
        #: bytes a sender may have published and not yet seen acknowledged (:meth:`send_ready`)
        self.send_window_bytes = self.inbox.max_bytes
        #: bytes published with QoS 1 and not yet acknowledged (the sum of ``_in_flight``)
        self.unacked_bytes = 0
        # Per topic: a flood of chunk frames on one agent's topic only evicts that topic's partials.
        self.reassembler = Reassembler(max_bytes=max_payload_bytes, max_buffered_bytes=max_buffered_bytes,
                                       on_drop=self._reject)
        self.max_payload_bytes = max_payload_bytes
        self.bytes_sent: Counter[str] = Counter()  # per channel
        self.bytes_received: Counter[str] = Counter()
        self.connected = threading.Event()
        self.connect_count = 0
        self.login = login or BrokerLogin()
        self._connack = threading.Event()  # the first connection attempt got an answer (or lost its socket)
        # the broker acknowledged this connection's subscriptions: from then on nothing sent to them is missed
        self.subscribed = threading.Event()
        self._last_subscribe_mid: int | None = None
        self._refusal: Failure | None = None
        self._socket_error: str | None = None  # paho's last error while waiting for the first CONNACK
        self._lock = threading.Lock()
        # QoS 1 publishes not yet acknowledged (mid -> bytes) and the largest acknowledged:
        # the send window counts them, and two drops in a row with the same larger one in
        # flight are the broker's size limit (one drop may be a broker that stopped). Never
        # held while calling into paho, whose thread holds its own locks when it calls on_publish.
        self._in_flight: dict[int, int] = {}
        self._acked_early: set[int] = set()
        self._largest_acked = 0
        # The oversized-looking message the last lost connection left unacknowledged (0: none):
        # only the same one left again by the next connection is taken for the broker's size limit.
        self._suspect = 0
        self._flight_lock = threading.Lock()
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=True,
            manual_ack=True,
        )
        if self.login.username:
            self._client.username_pw_set(self.login.username, self.login.password)
        if tls:
            self._client.tls_set_context(self.login.tls_context())
        if will:
            self._client.will_set(will[0], will[1], qos=1, retain=True)
        self._client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._client.max_inflight_messages_set(100)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = 30.0, *, stop: threading.Event | None = None,
              tick: Callable[[], None] | None = None) -> MqttTransport | None:
        """Connect and wait until the first connection is up; afterwards paho reconnects by itself.

        A cause that retrying cannot fix (TLS verification, refused credentials) raises
        :class:`BrokerUnreachable` at once; a transient one (refused, unreachable, DNS) is
        logged and retried with backoff (1 s doubling to 30 s) until ``timeout`` (None: for
        as long as it takes, a supervised service's way), then raised with the last cause.
        ``stop`` set (a SIGTERM) ends the wait within a second: returns None, not connected.
        ``tick`` is called about once a second meanwhile (a service's watchdog ping).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1.0

        def left() -> float:
            return CONNACK_WAIT_S if deadline is None else deadline - time.monotonic()

        while True:
            failure = self._connect_once(max(1.0, left()), stop, tick)
            if stop is not None and stop.is_set():
                self._client.loop_stop()
                return None
            if failure is None:
                # "started" means receiving: a message sent to our topics after start() returns
                # is not lost to a SUBSCRIBE the broker has not processed yet
                if not self.subscribed.wait(max(1.0, left())):
                    log.warning("the broker at %s:%d did not acknowledge the subscriptions within %.0fs",
                                self.host, self.port, max(1.0, left()))
                return self
            if not failure.transient:
                raise BrokerUnreachable(failure.cause, failure.message)
            if left() <= 0:
                raise BrokerUnreachable(failure.cause, f"could not reach MQTT broker at {self.host}:{self.port} "
                                                       f"within {timeout:.0f}s: {failure.message}")
            wait = min(delay, left())
            log.warning("%s; retrying in %.0fs", failure.message, wait)
            if _interruptible_wait(wait, stop, tick):
                return None
            delay = min(delay * 2, 30.0)

    def _connect_once(self, wait_s: float, stop: threading.Event | None = None,
                      tick: Callable[[], None] | None = None) -> Failure | None:
        """One connection attempt: None once connected, else why not (paho's loop stopped again)."""
        self._connack.clear()
        self._refusal = self._socket_error = None
        try:
            self._client.connect(self.host, self.port, keepalive=self.keepalive_s)
        except Exception as exc:  # socket, DNS and TLS errors all surface here, before any MQTT traffic
            return classify_socket_error(exc, self.host, self.port)
        self._client.on_log = self._on_log  # only until the CONNACK: it formats every packet's log line
        self._client.loop_start()
        # the CONNACK, or a stop (a SIGTERM ends the wait within a second)
        _wait_in_slices(wait_s, lambda s: self._connack.wait(s) or (stop is not None and stop.is_set()), tick)
        answered = self._connack.is_set()
        self._client.on_log = None
        if self.connected.is_set():
            return None
        self._client.loop_stop()
        if not answered:
            return Failure(FailureCause.TIMEOUT, f"MQTT broker {self.host}:{self.port} accepted the connection but "
                                                 f"sent no CONNACK within {wait_s:.0f}s", transient=True)
        return self._refusal or closed_before_connack(
            self.host, self.port, self._socket_error,
            presented_certificate=not self._tls or self.login.cert_file is not None)

    def _on_log(self, client, userdata, level, message) -> None:
        import paho.mqtt.client as mqtt

        if level == mqtt.MQTT_LOG_ERR and self._socket_error is None:  # the first error is the cause; later ones echo it
            self._socket_error = message

    def stop(self, final: tuple[str, bytes] | None = None) -> None:
        """Publish ``final`` (retained, e.g. an offline status), then disconnect cleanly."""
        try:
            if final and self.connected.is_set():
                info = self._client.publish(final[0], final[1], qos=1, retain=True)
                info.wait_for_publish(timeout=5)
            self._client.disconnect()
        finally:
            self._client.loop_stop()

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        if reason_code.is_failure:
            if self.connect_count == 0:  # the first attempt: start() reports it
                self._refusal = classify_connack(reason_code, reason_code.value, self.host, self.port,
                                                 self.login.username)
                self._connack.set()
            else:
                log.warning("broker refused connection: %s", reason_code)
            return
        self.connect_count += 1
        if self.connect_count > 1 and self.not_resent is not None:
            self._forget_unacked(client, self.not_resent)
        self.subscribed.clear()
        self.connection_subscriptions = []
        if self.subscriptions:
            _, self._last_subscribe_mid = client.subscribe([(topic, 1) for topic in self.subscriptions])
        else:
            self.subscribed.set()
        if self.birth:
            topic, frame, retain = self.birth()
            client.publish(topic, frame, qos=1, retain=retain)
        if self.connect_count > 1:
            log.info("reconnected to %s:%d, subscriptions restored", self.host, self.port)
        self.connected.set()
        self._connack.set()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties=None) -> None:
        if mid == self._last_subscribe_mid:
            failed = [str(code) for code in reason_codes if code.is_failure]
            if failed:  # e.g. an ACL that denies a topic: the transport runs, deaf to it
                log.error("the broker refused subscriptions of %s: %s", self.sender, ", ".join(failed))
            self.subscribed.set()

    def _forget_unacked(self, client, not_resent: Callable[[str], bool]) -> None:
        """On a reconnect, before paho re-sends what the last connection left unacknowledged:
        drop the messages on topics the owner re-sends itself (``not_resent``), keep the rest."""
        pending = client.drop_out_messages()  # paho's documented way to stop its re-send, from on_connect
        with self._flight_lock:
            self._in_flight.clear()
            self._acked_early.clear()
            self.unacked_bytes = 0
        dropped = 0
        for message in pending:
            if not_resent(message.topic):
                dropped += 1
                continue
            info = client.publish(message.topic, message.payload, qos=message.qos, retain=message.retain)
            self._sent(info.mid, len(message.payload))
        if dropped:
            log.info("not re-sending %d message(s) the last connection left unacknowledged: their sender decides "
                     "what still matters", dropped)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties=None) -> None:
        with self._ack_lock:  # before paho reconnects: no PUBACK of this connection reaches the next
            self._connection += 1
        self.connected.clear()
        if self.connect_count == 0:
            self._connack.set()  # lost before the first CONNACK: start() reports why
            return
        if reason_code == 0:
            return
        count, size = self._unacknowledged()
        suspect = self._oversized_in_flight()
        if suspect and suspect == self._suspect:
            # The same message left two connections in a row unacknowledged: a broker that
            # stopped or restarted acknowledges it once back, one that refuses its size never.
            log.error("the broker closed the connection twice in a row with the same %d-byte message unacknowledged, "
                      "larger than any it acknowledged (%d); paho re-sends it on every reconnect. If the broker "
                      "limits message size (Mosquitto max_packet_size, AWS IoT 128 KB), set broker.max_message_bytes "
                      "(now %d) below its limit: docs/BROKERS.md", suspect, self._largest_acked, self.max_message_bytes)
        elif count:
            log.warning("lost connection to broker (%s) with %d message(s) of %d bytes unacknowledged (the broker "
                        "stopped or closed the connection before acknowledging them); reconnecting with backoff",
                        reason_code, count, size)
        else:
            log.warning("lost connection to broker (%s); reconnecting with backoff", reason_code)
        self._suspect = suspect

    def _on_publish(self, client, userdata, mid, reason_code=None, properties=None) -> None:
        with self._flight_lock:
            size = self._in_flight.pop(mid, None)
            if size is None:
                # acknowledged before publish() recorded it (or a birth message, not counted)
                self._acked_early.add(mid)
            else:
                self.unacked_bytes -= size
                self._largest_acked = max(self._largest_acked, size)

    def _sent(self, mid: int, size: int) -> None:
        with self._flight_lock:
            if mid in self._acked_early:
                self._acked_early.discard(mid)
                self._largest_acked = max(self._largest_acked, size)
            else:
                self._in_flight[mid] = size
                self.unacked_bytes += size

    def _unacknowledged(self) -> tuple[int, int]:
        """(messages, bytes) published with QoS 1 and not yet acknowledged."""
        with self._flight_lock:
            return len(self._in_flight), self.unacked_bytes

    def _oversized_in_flight(self) -> int:
        """The largest unacknowledged message if it is larger than any acknowledged one, else 0."""
        with self._flight_lock:
            largest = max(self._in_flight.values(), default=0)
        return largest if largest > self._largest_acked else 0

    def _on_message(self, client, userdata, msg) -> None:
        # Runs on paho's network thread: only enqueue, never decode or train here; it waits
        # only past the inbox's max_held (a broker far past its in-flight window).
        # The inbox sends the PUBACK now, or later when the consumer has made room.
        mid, qos, connection = msg.mid, msg.qos, self._connection
        self.inbox.put((msg.topic, msg.payload), len(msg.payload), ack=lambda: self._acknowledge(mid, qos, connection))

    def _acknowledge(self, mid: int, qos: int, connection: int) -> None:
        with self._ack_lock:
            if qos and connection == self._connection:
                self._client.ack(mid, qos)

    # ------------------------------------------------------------------ traffic
    def publish(self, topic: str, frame: bytes, *, retain: bool = False, round: int = -1, wait: bool = False) -> int:
        """Publish a frame (chunked if needed) with QoS 1; returns the bytes put on the wire."""
        parts = split_frame(frame, self.max_message_bytes, federation=self.federation, sender=self.sender, round=round)
        if retain and len(parts) > 1:
            raise ValueError("a retained message must fit in one MQTT message; raise max_message_bytes")
        infos = []
        with self._lock:
            for part in parts:
                info = self._client.publish(topic, part, qos=1, retain=retain)
                self._sent(info.mid, len(part))
                infos.append(info)
        if wait:
            for info in infos:
                info.wait_for_publish(timeout=60)
        sent = sum(len(p) for p in parts)
        self.bytes_sent[topic.rsplit("/", 1)[-1]] += sent
        return sent

    def publish_parts(self, frame: bytes, part_topic: Callable[[int], str], *, round: int = -1) -> tuple[int, int]:
        """Publish a frame larger than one message as retained chunks, chunk ``i`` on ``part_topic(i)``.

        The last chunk goes first and chunk 0 last, so a receiver that learns the count from
        chunk 0 finds every other chunk of the same frame retained already. Waits for the
        broker's acknowledgements. Returns (bytes put on the wire, number of chunks).
        """
        parts = split_frame(frame, self.max_message_bytes, federation=self.federation, sender=self.sender, round=round)
        if len(parts) < 2:
            raise ValueError("the frame fits one MQTT message: publish it whole")
        infos = []
        with self._lock:
            for index in reversed(range(len(parts))):
                info = self._client.publish(part_topic(index), parts[index], qos=1, retain=True)
                self._sent(info.mid, len(parts[index]))
                infos.append(info)
        for info in infos:
            info.wait_for_publish(timeout=60)
        sent = sum(len(p) for p in parts)
        self.bytes_sent[FederationChannel.RELEASE.value] += sent
        return sent, len(parts)

    def clear_retained(self, topics: Iterable[str]) -> None:
        """Delete the retained message of each topic (an empty retained message), acknowledged."""
        with self._lock:
            infos = [self._client.publish(topic, b"", qos=1, retain=True) for topic in topics]
        for info in infos:
            info.wait_for_publish(timeout=60)

    def send_ready(self) -> bool:
        """Whether the bytes published and not yet acknowledged are below the send window."""
        return self.unacked_bytes < self.send_window_bytes

    def receive(self, timeout: float | None = None) -> Inbound | None:
        """Next whole frame, or None after ``timeout``. Invalid traffic is logged and dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = self.inbox.get(timeout=remaining)
            if item is None:
                return None
            topic, payload = item
            inbound = self._assemble(topic, payload)
            if inbound is not None:
                return inbound
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _assemble(self, topic: str, payload: bytes) -> Inbound | None:
        try:
            parsed = parse_topic(topic)
        except TopicError as exc:
            self.bytes_received[topic.rsplit("/", 1)[-1]] += len(payload)
            self._reject(topic, "bad_topic", str(exc))
            return None
        self.bytes_received[parsed.channel.value] += len(payload)
        if not payload:
            return None  # a cleared retained message
        header = peek_header(payload)
        is_chunk = header is not None and header.get("type") == MessageType.CHUNK.value
        if parsed.part is not None and not is_chunk:
            self._reject(topic, "malformed", "a release part topic carries only chunk frames")
            return None
        if is_chunk:
            # the parts of a release are one frame of the release topic, whichever topic each came on
            source = topic if parsed.part is None else federation_topic(parsed.federation, FederationChannel.RELEASE)
            try:
                chunk = decode(payload, max_bytes=self.accept_message_bytes + 65536)
                meta = chunk.meta_as(ChunkMeta)
                if parsed.part is not None and meta.index != parsed.part:
                    raise ProtocolError("malformed", f"chunk {meta.index} on the topic of part {parsed.part}")
                if parsed.part == 0:
                    for held in (self.subscriptions, self.connection_subscriptions):
                        if topic in held:
                            self._follow_parts(parsed.federation, meta.count, held)
                whole = self.reassembler.add(source, chunk)
            except ProtocolError as exc:
                self._reject(topic, exc.reason, exc.detail)
                return None
            if whole is None:
                return None
            if parsed.part is not None:
                parsed = ParsedTopic(parsed.federation, parsed.channel)
            return Inbound(parsed, whole, meta.total_bytes)
        return Inbound(parsed, payload, len(payload))

    def subscribe(self, topics: list[str]) -> None:
        """Subscribe to ``topics`` on the current connection only (kept in
        :attr:`connection_subscriptions`, not restored by a reconnect)."""
        new = [t for t in topics if t not in self.subscriptions and t not in self.connection_subscriptions]
        if new:
            self.connection_subscriptions.extend(new)
            self._client.subscribe([(t, 1) for t in new])

    def drop_connection_subscriptions(self) -> list[str]:
        """Unsubscribe from every topic :meth:`subscribe` added on this connection (the release
        parts followed from them too); returns them."""
        gone, self.connection_subscriptions = self.connection_subscriptions, []
        if gone:
            self._client.unsubscribe(gone)
        return gone

    def _follow_parts(self, federation: str, count: int, subscriptions: list[str]) -> None:
        """Subscribe to exactly the release part topics 1..count-1 that chunk 0 announces
        (exact topics: RabbitMQ sends no retained message on a wildcard), dropping any of a
        longer earlier release; kept in ``subscriptions`` (where part 0 is: :attr:`subscriptions`,
        restored by a reconnect, or :attr:`connection_subscriptions`), updated in place."""
        wanted = [release_part_topic(federation, i) for i in range(1, count)]
        held = [t for t in subscriptions if _part_index(t, federation) not in (None, 0)]
        new = [t for t in wanted if t not in subscriptions]
        gone = [t for t in held if t not in set(wanted)]
        if not new and not gone:
            return
        subscriptions[:] = [t for t in subscriptions if t not in set(gone)] + new
        if gone:
            self._client.unsubscribe(gone)
        if new:
            self._client.subscribe([(t, 1) for t in new])
        log.debug("release in %d parts: subscribed to %d more part topics, dropped %d", count, len(new), len(gone))

    def _reject(self, topic: str, reason: str, detail: str) -> None:
        self._drop_log.warning(reason, "dropped message on %s: %s (%s)", topic, reason, detail)
        if self.on_reject:
            self.on_reject(topic, reason, detail)


def _part_index(topic: str, federation: str) -> int | None:
    """The part index of a release part topic of ``federation``, else None."""
    try:
        parsed = parse_topic(topic)
    except TopicError:
        return None
    return parsed.part if parsed.federation == federation else None
