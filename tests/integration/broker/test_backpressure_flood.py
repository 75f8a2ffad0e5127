"""The transport's bounded inbox: a flood through a real Mosquitto (its unit behaviour:
tests/unit/protocol/test_backpressure.py).

The flood tests check what really happens with paho and QoS 1 when the consumer stalls:
the queue in this process stays within its bound plus the broker's in-flight window
(the broker keeps the backlog while the PUBACKs are held back), the connection survives
a stall several times the keepalive, and every message arrives, in order, once the
consumer reads again.
"""

from __future__ import annotations

import time
import uuid

import paho.mqtt.client as mqtt

from edgepfl.protocol import AgentChannel, agent_topic, agent_wildcard
from edgepfl.protocol.transport import MqttTransport

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


def test_a_flood_waits_at_the_broker_while_the_consumer_stalls_and_nothing_is_lost(mosquitto):
    federation = f"bp{uuid.uuid4().hex[:8]}"
    bound = 5 * MESSAGE_BYTES
    sink = _receiver(mosquitto.url, federation, keepalive_s=30, inbox_max_bytes=bound)
    flood = _flood(mosquitto.url, agent_topic(federation, "a1", AgentChannel.UPDATE), FLOOD)
    try:
        time.sleep(3)  # the consumer stalls; the publisher has long sent everything
        state = f"queued={len(sink.inbox)} held={sink.inbox.held} admitted={sink.inbox.admitted_bytes}"
        # in this process: the bound plus what the broker sent unacknowledged (its in-flight
        # window: Mosquitto's is 20, measured overshooting to 95), at most max_held; the rest
        # of the flood waits in the broker
        assert sink.inbox.admitted_bytes <= bound and sink.inbox.held <= sink.inbox.max_held < FLOOD - 5, state
        assert sink.inbox.held >= 1, state  # the flood did reach the bound
        got = _drain(sink, FLOOD)
        assert got == list(range(FLOOD))  # all of them, in order
        # the broker may send past its window while the consumer drains fast; max_held bounds that
        assert sink.inbox.peak_bytes <= bound + sink.inbox.max_held * MESSAGE_BYTES
        assert sink.inbox.overruns == 0
        assert sink.connect_count == 1
    finally:
        flood.disconnect()
        flood.loop_stop()
        sink.stop()


def test_a_stall_several_times_the_keepalive_keeps_the_connection_and_every_message(mosquitto):
    """paho closes a connection whose PINGRESP it has not read within the keepalive; the
    PINGRESP queues in the socket behind the messages the broker sent, so paho's thread must
    keep reading them while the consumer stalls (it once waited in the callback instead)."""
    federation = f"bp{uuid.uuid4().hex[:8]}"
    bound = 5 * MESSAGE_BYTES
    sink = _receiver(mosquitto.url, federation, keepalive_s=4, inbox_max_bytes=bound)
    # fewer than max_held past the bound: however far the broker overshoots its window, the
    # network thread never waits
    count = 5 + sink.inbox.max_held - 1
    flood = _flood(mosquitto.url, agent_topic(federation, "a1", AgentChannel.UPDATE), count)
    try:
        time.sleep(20)  # five keepalives without reading
        state = f"connects={sink.connect_count} queued={len(sink.inbox)} held={sink.inbox.held}"
        assert sink.connect_count == 1 and sink.connected.is_set(), state
        assert sink.inbox.held >= 1 and sink.inbox.overruns == 0, state
        # paho's thread keeps reading: the broker's PUBACK for this process's own message,
        # behind the flood in the socket, is read within the keepalive (a thread waiting a
        # third of the keepalive per message took 20 of them)
        sink.publish(agent_topic(federation, "a1", AgentChannel.TASK), bytes(100))
        deadline = time.monotonic() + sink.keepalive_s
        while sink.unacked_bytes and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.unacked_bytes == 0, state
        got = _drain(sink, count)
        # a reconnect (clean session) would lose the broker's queue: say so when it happens
        assert sink.connect_count == 1, (state, f"connects after draining={sink.connect_count}", got)
        assert got == list(range(count)), (state, got)
    finally:
        flood.disconnect()
        flood.loop_stop()
        sink.stop()


def test_broker_inbox_max_held_acks_bounds_a_stalled_coordinator_s_held_acknowledgements(mosquitto):
    """The operator's bound (``broker.inbox_max_held_acks``) reaches the coordinator's
    transport: with it below the broker's window (Mosquitto's 20), the network thread holds
    that many, then waits a third of the keepalive per message and queues it over the bound,
    counted (its acknowledgement held too: PUBACKs go in order); the connection and every
    message survive."""
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.specs import BrokerConfig

    federation = f"bp{uuid.uuid4().hex[:8]}"
    broker = BrokerConfig(url=mosquitto.url, keepalive_s=6, inbox_max_bytes=16_384, inbox_max_held_acks=3)
    fleet = MqttFleet(federation, broker)
    sink = fleet.transport
    assert sink.inbox.max_held == 3 and sink.inbox.max_wait_s == 2
    count = 30
    flood = _flood(mosquitto.url, agent_topic(federation, "a1", AgentChannel.UPDATE), count)
    try:
        time.sleep(5)  # the consumer stalls
        state = f"queued={len(sink.inbox)} held={sink.inbox.held} overruns={sink.inbox.overruns}"
        assert sink.inbox.overruns >= 1 and sink.inbox.held <= 3 + sink.inbox.overruns, state
        got = _drain(sink, count)
        assert got == list(range(count)) and sink.connect_count == 1, (state, got)
    finally:
        flood.disconnect()
        flood.loop_stop()
        fleet.close()


def test_the_send_window_counts_bytes_until_the_broker_acknowledges_them():
    """20 messages against a window of 5, published while the broker is stopped (SIGSTOP: no
    PUBACK can come back, so the window is full by construction, not by a race with a fast
    broker); once it runs again every PUBACK matches its message and the window is open."""
    import os
    import signal

    from edgepfl.testing import MosquittoBroker

    federation = f"bp{uuid.uuid4().hex[:8]}"
    with MosquittoBroker() as broker:
        sender = _receiver(broker.url, federation, keepalive_s=30, inbox_max_bytes=5 * MESSAGE_BYTES)
        try:
            assert sender.send_ready() and sender.unacked_bytes == 0
            topic = agent_topic(federation, "a1", AgentChannel.TASK)
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                for _ in range(20):
                    sender.publish(topic, bytes(MESSAGE_BYTES))
                assert not sender.send_ready() and sender.unacked_bytes >= 5 * MESSAGE_BYTES
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while sender.unacked_bytes and time.monotonic() < deadline:
                time.sleep(0.05)
            assert sender.unacked_bytes == 0 and sender.send_ready()  # every PUBACK matched its message
        finally:
            sender.stop()


def test_messages_held_when_the_broker_restarts_are_kept_and_the_new_connection_flows():
    """Held acknowledgements belong to the lost connection: its messages stay queued for the
    consumer, and the next connection's messages are acknowledged and arrive after them."""
    from edgepfl.testing import MosquittoBroker

    broker = MosquittoBroker()
    url = broker.start()
    federation = f"bp{uuid.uuid4().hex[:8]}"
    sink = _receiver(url, federation, keepalive_s=10, inbox_max_bytes=5 * MESSAGE_BYTES)
    topic = agent_topic(federation, "a1", AgentChannel.UPDATE)
    flood = _flood(url, topic, 20)
    try:
        deadline = time.monotonic() + 20
        while len(sink.inbox) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        held = sink.inbox.held
        assert len(sink.inbox) == 20 and held >= 1, (len(sink.inbox), held)
        flood.disconnect()
        flood.loop_stop()
        port = broker.port
        broker.stop()
        broker = MosquittoBroker(port=port)
        broker.start()
        deadline = time.monotonic() + 30
        while not (sink.connect_count == 2 and sink.connected.is_set()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sink.connect_count == 2
        flood = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"flood-{uuid.uuid4().hex[:8]}")
        flood.connect("127.0.0.1", port)
        flood.loop_start()
        # the sink subscribes again in on_connect: probe until the broker routes to it
        probe = (99).to_bytes(4, "big") + bytes(MESSAGE_BYTES - 4)
        deadline = time.monotonic() + 30
        while len(sink.inbox) == 20 and time.monotonic() < deadline:
            flood.publish(topic, probe, qos=1).wait_for_publish(5)
            time.sleep(0.2)
        for i in range(100, 130):  # more than the bound again: the new connection holds its own
            flood.publish(topic, i.to_bytes(4, "big") + bytes(MESSAGE_BYTES - 4), qos=1)
        got: list[int] = []
        deadline = time.monotonic() + 60
        while 129 not in got and time.monotonic() < deadline:
            inbound = sink.receive(timeout=1)
            if inbound is not None and (n := int.from_bytes(inbound.frame[:4], "big")) != 99:
                got.append(n)
        assert got == list(range(20)) + list(range(100, 130)), got
        assert sink.inbox.held == 0 and sink.connect_count == 2
    finally:
        flood.disconnect()
        flood.loop_stop()
        sink.stop()
        broker.stop()
