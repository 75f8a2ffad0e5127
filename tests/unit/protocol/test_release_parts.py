"""A release too large for one MQTT message stays retained as parts on ``release/<i>``
(docs/PROTOCOL.md §8, §12): the part topics. A receiver that subscribes after the
coordinator is gone, through a real Mosquitto: tests/integration/releases/test_release_parts_retained.py."""

from __future__ import annotations

import pytest

from edgepfl.protocol import FederationChannel, TopicError, parse_topic, release_part_topic


def test_release_part_topics_are_decimal_indices_below_a_million():
    assert release_part_topic("f", 0) == "edgepfl/v1/f/release/0"
    parsed = parse_topic("edgepfl/v1/f/release/12")
    assert (parsed.federation, parsed.channel, parsed.part, parsed.agent) == ("f", FederationChannel.RELEASE, 12, None)
    assert parse_topic("edgepfl/v1/f/release").part is None
    for bad in ("edgepfl/v1/f/release/01", "edgepfl/v1/f/release/-1", "edgepfl/v1/f/release/1000000",
                "edgepfl/v1/f/release/x", "edgepfl/v1/f/coordinator/0", "edgepfl/v1/f/release/0/0"):
        with pytest.raises(TopicError):
            parse_topic(bad)
    with pytest.raises(TopicError):
        release_part_topic("f", 1_000_000)
