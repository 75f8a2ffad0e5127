"""The transport's bounded inbox: unit behaviour, and a flood through a real Mosquitto.

The flood tests check what really happens with paho and QoS 1 when the consumer stalls:
the queue in this process stays at its bound (the broker keeps the backlog while the
PUBACKs are held back), the connection survives a stall longer than the keepalive, and
every message arrives, in order, once the consumer reads again.
"""

from __future__ import annotations

import threading
import time
import uuid

import paho.mqtt.client as mqtt
import pytest

from edgepfl.protocol import AgentChannel, agent_topic, agent_wildcard
from edgepfl.protocol.backpressure import BoundedInbox
from edgepfl.protocol.transport import MqttTransport, default_inbox_bytes

# ------------------------------------------------------------------ unit


def test_put_waits_for_room_and_resumes_when_the_consumer_takes_an_item():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10, max_wait_s=5)
    assert inbox.put(1, 60)
    done = threading.Event()

    def producer():
        inbox.put(2, 60)  # 120 > 100: waits
        done.set()

    threading.Thread(target=producer, daemon=True).start()
    assert not done.wait(0.3)
    assert inbox.queued_bytes == 60
    assert inbox.get(1) == 1
    assert done.wait(2)
    assert inbox.get(1) == 2 and inbox.peak_bytes == 60 and inbox.overruns == 0


def test_a_stalled_consumer_costs_one_message_over_the_bound_per_wait_never_a_lost_one():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10, max_wait_s=0.1)
    inbox.put(1, 80)
    started = time.monotonic()
    assert inbox.put(2, 80) is False  # nobody reads: queued over the bound after the wait
    assert time.monotonic() - started >= 0.1
    assert inbox.overruns == 1 and len(inbox) == 2
    assert [inbox.get(0), inbox.get(0), inbox.get(0)] == [1, 2, None]


def test_the_message_count_is_bounded_too_and_one_oversized_message_passes_an_empty_queue():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=1000, max_messages=2, max_wait_s=0.05)
    assert inbox.put(1, 1) and inbox.put(2, 1)
    assert inbox.put(3, 1) is False  # third message: over the count
    for _ in range(3):
        inbox.get(0)
    assert inbox.put(4, 5000)  # larger than the whole bound, but alone
    assert inbox.overruns == 1


def test_the_default_bound_follows_the_payload_limit():
    assert default_inbox_bytes(256 * 2**20, 1_000_000) == 16 * 2**20
    assert default_inbox_bytes(16 * 2**20, 1_000_000) == 4_000_000  # never below four MQTT messages


# ------------------------------------------------------------------ a real broker

MESSAGE_BYTES = 20_000
FLOOD = 300


def _flood(url: str, topic: str, count: int) -> mqtt.Client:
    """A plain paho publisher: ``count`` QoS 1 messages, each carrying its index."""
    host, port = url.removeprefix("mqtt://").split(":")
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:8]}")
    client.connect(host, int(port))
    client.loop_start()
    for i in range(count):
        client.publish(topic, i.to_bytes(4, "big") + bytes(MESSAGE_BYTES - 4), qos=1)
    return client


def _receiver(url: str, federation: str, keepalive_s: int, inbox_max_bytes: int) -> MqttTransport:
    return MqttTransport(url, client_id=f"sink-{uuid.uuid4().hex[:8]}", federation=federation, sender="coordinator",
                         subscriptions=[agent_wildcard(federation, AgentChannel.UPDATE)], keepalive_s=keepalive_s,
                         inbox_max_bytes=inbox_max_bytes).start()


def _drain(transport: MqttTransport, count: int, timeout: float = 60) -> list[int]:
    got: list[int] = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        inbound = transport.receive(timeout=1)
        if inbound is not None:
            got.append(int.from_bytes(inbound.frame[:4], "big"))
    return got


@pytest.mark.slow
def test_a_flood_waits_at_the_broker_while_the_consumer_stalls_and_nothing_is_lost(mosquitto):
    federation = f"bp{uuid.uuid4().hex[:8]}"
    bound = 5 * MESSAGE_BYTES
    sink = _receiver(mosquitto.url, federation, keepalive_s=30, inbox_max_bytes=bound)  # waits up to 10 s
    flood = _flood(mosquitto.url, agent_topic(federation, "a1", AgentChannel.UPDATE), FLOOD)
    try:
        time.sleep(3)  # the consumer stalls; the publisher has long sent everything
        assert sink.inbox.queued_bytes <= bound
        assert sink.inbox.overruns == 0
        got = _drain(sink, FLOOD)
        assert got == list(range(FLOOD))  # all of them, in order
        assert sink.inbox.peak_bytes <= bound
        assert sink.connect_count == 1
    finally:
        flood.disconnect()
        flood.loop_stop()
        sink.stop()


@pytest.mark.slow
def test_a_stall_longer_than_the_keepalive_keeps_the_connection_and_every_message(mosquitto):
    """The broker drops a client silent for 1.5 x keepalive: paho's thread must not wait that long."""
    federation = f"bp{uuid.uuid4().hex[:8]}"
    bound = 5 * MESSAGE_BYTES
    # keepalive 10 s: the broker drops a client after 15 s of silence, a margin that a loaded
    # CI box (a starved network thread) does not eat up; the inbox waits up to 3.3 s
    sink = _receiver(mosquitto.url, federation, keepalive_s=10, inbox_max_bytes=bound)
    flood = _flood(mosquitto.url, agent_topic(federation, "a1", AgentChannel.UPDATE), 40)
    try:
        time.sleep(20)  # twice the keepalive without reading
        state = (f"connects={sink.connect_count} overruns={sink.inbox.overruns} peak={sink.inbox.peak_bytes} "
                 f"queued={len(sink.inbox)}")
        assert sink.connect_count == 1 and sink.connected.is_set(), state
        # over the bound by about one message per wait (20 s / 3.3 s), not by the flood
        assert 1 <= sink.inbox.overruns <= 10, state
        assert sink.inbox.peak_bytes <= bound + sink.inbox.overruns * MESSAGE_BYTES, state
        got = _drain(sink, 40)
        # a reconnect (clean session) would lose the broker's queue: say so when it happens
        assert sink.connect_count == 1, (state, f"connects after draining={sink.connect_count}", got)
        assert got == list(range(40)), (state, got)
    finally:
        flood.disconnect()
        flood.loop_stop()
        sink.stop()


@pytest.mark.slow
def test_the_send_window_counts_bytes_until_the_broker_acknowledges_them(mosquitto):
    federation = f"bp{uuid.uuid4().hex[:8]}"
    sender = _receiver(mosquitto.url, federation, keepalive_s=30, inbox_max_bytes=5 * MESSAGE_BYTES)
    try:
        assert sender.send_ready() and sender.unacked_bytes == 0
        topic = agent_topic(federation, "a1", AgentChannel.TASK)
        for _ in range(20):
            sender.publish(topic, bytes(MESSAGE_BYTES))
        # 20 messages against a window of 5: the window is full until the PUBACKs come back
        assert not sender.send_ready()
        deadline = time.monotonic() + 30
        while sender.unacked_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sender.unacked_bytes == 0 and sender.send_ready()  # every PUBACK matched its message
    finally:
        sender.stop()
