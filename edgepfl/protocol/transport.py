"""MQTT transport shared by coordinator and agents (paho-mqtt 2.x).

What it adds over a bare paho client:

* connect with exponential backoff, and **subscribe in on_connect**, so a reconnect
  restores every subscription;
* a last will and a birth message (re-published on every connect) for presence;
* payloads larger than ``max_message_bytes`` are split into chunk frames and put
  back together (and sha256-verified) on receipt;
* incoming frames are queued and handed to the caller's thread by
  :meth:`MqttTransport.receive`, so decoding and training never run on paho's
  network thread; the queue is bounded (:class:`.backpressure.BoundedInbox`): while it
  is full, paho's thread holds back the PUBACKs and the broker keeps the backlog;
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
from collections.abc import Callable
from dataclasses import dataclass

from ..broker import parse_broker_url
from .backpressure import BoundedInbox
from .envelope import DEFAULT_MAX_PAYLOAD_BYTES, ProtocolError, Reassembler, decode, peek_header, split_frame
from .messages import ChunkMeta, MessageType
from .topics import ParsedTopic, TopicError, parse_topic

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


class MqttTransport:
    """A connected MQTT client speaking edgepfl frames.

    ``subscriptions`` are (re)subscribed on every connect; ``birth`` is a callable
    returning ``(topic, frame, retain)`` published after every connect; ``will`` is
    ``(topic, frame)`` registered as the last will (retained).
    """

    def __init__(
        self,
        url: str,
        *,
        client_id: str,
        federation: str,
        sender: str,
        subscriptions: list[str],
        username: str | None = None,
        password: str | None = None,
        will: tuple[str, bytes] | None = None,
        birth: Callable[[], tuple[str, bytes, bool]] | None = None,
        max_message_bytes: int = 1_000_000,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        keepalive_s: int = 30,
        on_reject: Callable[[str, str, str], None] | None = None,
        inbox_max_bytes: int | None = None,
        inbox_max_messages: int = 10_000,
    ):
        import paho.mqtt.client as mqtt

        self.host, self.port, tls = parse_broker_url(url)
        self.federation = federation
        self.sender = sender
        self.subscriptions = list(subscriptions)
        self.birth = birth
        self.max_message_bytes = max_message_bytes
        self.keepalive_s = keepalive_s
        self.on_reject = on_reject
        # Raw (topic, payload) from paho's thread. Waiting for room must stay well inside the
        # keepalive: paho's thread sends the PINGREQs too.
        self.inbox: BoundedInbox[tuple[str, bytes]] = BoundedInbox(
            inbox_max_bytes or default_inbox_bytes(max_payload_bytes, max_message_bytes), inbox_max_messages,
            max_wait_s=keepalive_s / 3)
        #: bytes a sender may have published and not yet seen acknowledged (:meth:`send_ready`)
        self.send_window_bytes = self.inbox.max_bytes
        self.unacked_bytes = 0
        # Only for the unacknowledged count; never held while calling into paho, whose thread
        # holds its own locks when it calls on_publish.
        self._acks = threading.Lock()
        self._unacked: dict[int, int] = {}  # mid -> bytes
        self._acked_early: set[int] = set()  # PUBACKs that beat the recording of their mid
        self.reassembler = Reassembler(max_bytes=max_payload_bytes)
        self.max_payload_bytes = max_payload_bytes
        self.bytes_sent: Counter[str] = Counter()  # per channel
        self.bytes_received: Counter[str] = Counter()
        self.connected = threading.Event()
        self.connect_count = 0
        self._lock = threading.Lock()
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv311, clean_session=True
        )
        if username:
            self._client.username_pw_set(username, password)
        if tls:
            self._client.tls_set()
        if will:
            self._client.will_set(will[0], will[1], qos=1, retain=True)
        self._client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._client.max_inflight_messages_set(100)
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 30.0) -> MqttTransport:
        """Connect (retrying with backoff) and wait until the first connection is up."""
        self._client.connect_async(self.host, self.port, keepalive=self.keepalive_s)
        self._client.loop_start()
        if not self.connected.wait(timeout):
            self._client.loop_stop()
            raise ConnectionError(f"could not reach MQTT broker at {self.host}:{self.port} within {timeout:.0f}s")
        return self

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
            log.warning("broker refused connection: %s", reason_code)
            return
        self.connect_count += 1
        for topic in self.subscriptions:
            client.subscribe(topic, qos=1)
        if self.birth:
            topic, frame, retain = self.birth()
            client.publish(topic, frame, qos=1, retain=retain)
        if self.connect_count > 1:
            log.info("reconnected to %s:%d, subscriptions restored", self.host, self.port)
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties=None) -> None:
        self.connected.clear()
        if reason_code != 0:
            log.warning("lost connection to broker (%s); reconnecting with backoff", reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        # Runs on paho's network thread: only enqueue, never decode or train here.
        # Blocks while the inbox is full: the PUBACK goes out when this returns (backpressure).
        self.inbox.put((msg.topic, msg.payload), len(msg.payload))

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
                infos.append(info)
                with self._acks:
                    if info.mid in self._acked_early:
                        self._acked_early.discard(info.mid)
                    else:
                        self._unacked[info.mid] = len(part)
                        self.unacked_bytes += len(part)
        if wait:
            for info in infos:
                info.wait_for_publish(timeout=60)
        sent = sum(len(p) for p in parts)
        self.bytes_sent[topic.rsplit("/", 1)[-1]] += sent
        return sent

    def send_ready(self) -> bool:
        """Whether the bytes published and not yet acknowledged are below the send window."""
        return self.unacked_bytes < self.send_window_bytes

    def _on_publish(self, client, userdata, mid, reason_code=None, properties=None) -> None:
        with self._acks:
            size = self._unacked.pop(mid, None)
            if size is None:
                # not recorded yet (or published by the birth message, which is not counted)
                self._acked_early.add(mid)
            else:
                self.unacked_bytes -= size

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
        channel = topic.rsplit("/", 1)[-1]
        self.bytes_received[channel] += len(payload)
        try:
            parsed = parse_topic(topic)
        except TopicError as exc:
            self._reject(topic, "bad_topic", str(exc))
            return None
        if not payload:
            return None  # a cleared retained message
        header = peek_header(payload)
        if header is not None and header.get("type") == MessageType.CHUNK.value:
            try:
                chunk = decode(payload, max_bytes=self.max_message_bytes + 65536)
                whole = self.reassembler.add(topic, chunk)
            except ProtocolError as exc:
                self._reject(topic, exc.reason, exc.detail)
                return None
            if whole is None:
                return None
            return Inbound(parsed, whole, chunk.meta_as(ChunkMeta).total_bytes)
        return Inbound(parsed, payload, len(payload))

    def _reject(self, topic: str, reason: str, detail: str) -> None:
        log.warning("dropped message on %s: %s (%s)", topic, reason, detail)
        if self.on_reject:
            self.on_reject(topic, reason, detail)
