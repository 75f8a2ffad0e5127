"""Beyond one broker, the logic those federations depend on: an agent answers each
coordinator session once, the session field, what a bridge forwards, and the message
size that fits a broker's packet limit (docs/BROKERS.md). The federations, against real
brokers: tests/integration/broker/test_topologies_live.py.
"""

from __future__ import annotations

import pytest

from edgepfl.broker import max_message_bytes_for
from edgepfl.protocol import CoordinatorMeta, RollCall
from edgepfl.testing import bridge_config

AWS_IOT_LIMIT = 128 * 1024


# --------------------------------------------------------------------------- the logic


def test_an_agent_answers_each_coordinator_session_once():
    roll_call = RollCall()
    first, second = "a" * 32, "b" * 32
    assert roll_call.due(CoordinatorMeta(state="online", session=first))
    # the same session's per-round presences and the broker's retained copy ask nothing more
    assert not roll_call.due(CoordinatorMeta(state="online", round=3, session=first))
    # a coordinator that reconnected (new session) gets every status again
    assert roll_call.due(CoordinatorMeta(state="online", session=second))
    # only an online coordinator with a session calls the roll
    assert not RollCall().due(CoordinatorMeta(state="done", session=first))
    assert not RollCall().due(CoordinatorMeta(state="offline", session=first))
    assert not RollCall().due(CoordinatorMeta(state="online"))


def test_the_session_field_is_optional_and_must_be_an_id():
    assert CoordinatorMeta(state="online").session == ""
    with pytest.raises(ValueError):
        CoordinatorMeta(state="online", session="not/an-id")


def test_a_bridge_forwards_agent_channels_out_and_coordinator_channels_in_and_cannot_loop():
    lines = bridge_config("site0", 1883).splitlines()
    topics = [line.split() for line in lines if line.startswith("topic ")]
    out = {t[1].split("/", 3)[-1] for t in topics if t[2] == "out"}
    into = {t[1].split("/", 3)[-1] for t in topics if t[2] == "in"}
    assert out == {"agents/+/status", "agents/+/update", "agents/+/metrics"}
    assert into == {"agents/+/task", "coordinator", "release", "release/+"}  # a release in parts too
    assert all(t[3] == "1" for t in topics)  # QoS 1 across the link, like every edgepfl publish
    assert "try_private true" in lines and "cleansession false" in lines


def test_max_message_bytes_for_a_packet_limit_leaves_room_for_the_longest_topic():
    longest_topic = f"edgepfl/v1/{'f' * 64}/agents/{'a' * 64}/metrics"
    m = max_message_bytes_for(AWS_IOT_LIMIT)
    # fixed header (1 + 4 bytes of remaining length) + topic length + topic + packet id
    assert m + 5 + 2 + len(longest_topic) + 2 <= AWS_IOT_LIMIT
    assert m >= 16_384
