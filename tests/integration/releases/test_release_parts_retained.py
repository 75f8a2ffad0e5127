"""A release too large for one MQTT message stays retained: as parts on ``release/<i>``
(docs/PROTOCOL.md §8, §12), which a receiver that subscribes after the coordinator is gone
follows from chunk 0 and reassembles. Real Mosquitto, real transports (the part topics:
tests/unit/protocol/test_release_parts.py)."""

from __future__ import annotations

import os

from edgepfl.config import BrokerConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.protocol import FederationChannel, federation_topic, parse_topic, release_part_topic
from edgepfl.protocol.transport import MqttTransport
from edgepfl.testing import TrafficCapture

from tests.fleet_helpers import wait_until

M = 16_384  # the smallest allowed message size: a few kB make a release of many parts


def _late_receiver(url: str, federation: str) -> MqttTransport:
    """What a head agent subscribes to: the whole-frame topic and part 0, nothing else."""
    return MqttTransport(url, client_id=f"late-{os.urandom(4).hex()}", federation=federation, sender="device-00",
                         subscriptions=[federation_topic(federation, FederationChannel.RELEASE),
                                        release_part_topic(federation, 0)]).start(timeout=20)


def _retained(url: str, federation: str, expect: set[str]) -> dict[str, bytes]:
    """The non-empty retained messages on the release topic and its parts, once ``expect`` are all there."""
    with TrafficCapture(url, f"edgepfl/v1/{federation}/release/#", include_retained=True) as cap:
        wait_until(lambda: {t for t, p in cap.snapshot() if p} >= expect, 10, what=f"retained {sorted(expect)}")
        return {t: p for t, p in cap.snapshot() if p}


def _receive(transport: MqttTransport) -> bytes:
    inbound = wait_until(lambda: transport.receive(timeout=0.5), 20, interval=0, what="a whole release frame")
    assert inbound.topic == parse_topic(federation_topic(transport.federation, FederationChannel.RELEASE))
    return inbound.frame


def test_a_release_in_parts_reaches_a_receiver_that_subscribes_after_the_publisher_left(mosquitto):
    fed = f"parts{os.urandom(4).hex()}"
    step = M - 2048
    big, shorter, whole = os.urandom(6 * step + 5), os.urandom(2 * step + 1), os.urandom(M // 2)
    fleet = MqttFleet(fed, BrokerConfig(max_message_bytes=M), url=mosquitto.url)
    try:
        assert fleet.releases.publish(big, 3) == 7
    finally:
        fleet.close()  # the coordinator is gone: only what the broker retained is left
    parts = {release_part_topic(fed, i) for i in range(7)}
    assert set(_retained(mosquitto.url, fed, parts)) == parts  # and nothing on the whole-frame topic

    late = _late_receiver(mosquitto.url, fed)
    try:
        assert _receive(late) == big
        # it followed chunk 0 to exactly the other parts' topics (exact: RabbitMQ sends no retained on wildcards)
        assert set(late.subscriptions) - {release_part_topic(fed, 0)} >= {release_part_topic(fed, i) for i in range(1, 7)}

        # a shorter release: the receiver gets it live, and the parts it does not overwrite are cleared
        fleet = MqttFleet(fed, BrokerConfig(max_message_bytes=M), url=mosquitto.url)
        try:
            assert fleet.releases.publish(shorter, 4, earlier_parts=7) == 3
            assert _receive(late) == shorter
            three = {release_part_topic(fed, i) for i in range(3)}
            assert set(_retained(mosquitto.url, fed, three)) == three
            assert not [t for t in late.subscriptions if (parse_topic(t).part or 0) >= 3]

            # a release that fits one message is retained whole, and every part is cleared
            assert fleet.releases.publish(whole, 5, earlier_parts=3) == 0
            assert _receive(late) == whole
            topic = federation_topic(fed, FederationChannel.RELEASE)
            assert _retained(mosquitto.url, fed, {topic}) == {topic: whole}

            # and back to parts: the whole-frame topic is cleared, so a late joiner cannot take the older one
            assert fleet.releases.publish(big, 6) == 7
            assert _receive(late) == big
            assert set(_retained(mosquitto.url, fed, parts)) == parts
        finally:
            fleet.close()
    finally:
        late.stop()
    again = _late_receiver(mosquitto.url, fed)
    try:
        assert _receive(again) == big
    finally:
        again.stop()


def test_a_part_topic_takes_only_its_own_chunk(mosquitto):
    """A whole frame or another index on ``release/<i>`` is dropped (``malformed``), never reassembled."""
    fed = f"parts{os.urandom(4).hex()}"
    dropped: list[tuple[str, str]] = []
    receiver = MqttTransport(mosquitto.url, client_id=f"r-{os.urandom(4).hex()}", federation=fed, sender="d",
                             subscriptions=[release_part_topic(fed, 0), release_part_topic(fed, 1)],
                             on_reject=lambda topic, reason, detail: dropped.append((topic, reason))).start(timeout=20)
    sender = MqttTransport(mosquitto.url, client_id=f"s-{os.urandom(4).hex()}", federation=fed, sender="coordinator",
                           subscriptions=[], max_message_bytes=M).start(timeout=20)
    try:
        swapped = {0: release_part_topic(fed, 1), 1: release_part_topic(fed, 0)}  # chunk i on the other's topic
        sender.publish_parts(os.urandom(M + 1), lambda i: swapped[i])  # two chunks
        sender.publish(release_part_topic(fed, 0), b"not a chunk", retain=True, wait=True)
        wait_until(lambda: receiver.receive(timeout=0.2) is None and len(dropped) >= 3, 10, interval=0,
                   what="three drops")
        assert {reason for _, reason in dropped} == {"malformed"}
    finally:
        sender.clear_retained([release_part_topic(fed, 0), release_part_topic(fed, 1)])
        sender.stop()
        receiver.stop()
