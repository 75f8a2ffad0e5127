"""The coordinator announces its message size M (and its largest frame) in its retained
presence; an agent configured for a larger M publishes in messages of the announced
size and says so loudly. The case that lost updates: an agent left at the default M behind a
broker with a smaller packet limit was disconnected and its update lost (that case,
live: tests/integration/broker/test_announced_limits_live.py)."""

from __future__ import annotations

import logging

from edgepfl.config import AgentConfig
from edgepfl.edge_agent.agent import Agent
from edgepfl.protocol import CoordinatorMeta, MessageType, decode, encode
from edgepfl.protocol.transport import MqttTransport


def test_presence_without_limits_still_decodes_and_announces_none():
    # a presence frame of the earlier revision: no limit fields at all
    old = CoordinatorMeta(state="online", method="fedavg", round=3)
    frame = encode(MessageType.COORDINATOR, federation="f", sender="coordinator", round=3,
                   meta=old)
    meta = decode(frame).meta_as(CoordinatorMeta)
    assert meta.max_message_bytes is None and meta.max_payload_bytes is None
    assert "max_message_bytes" not in CoordinatorMeta.model_json_schema()["required"]


def _agent(own: int) -> Agent:
    agent = Agent(AgentConfig(agent_id="pi-1", broker={"url": "mqtt://127.0.0.1:1", "max_message_bytes": own}))
    # a real, unconnected transport: adopt_limits only sets its sizes
    agent.transport = MqttTransport("mqtt://127.0.0.1:1", client_id="x", federation="demo", sender="pi-1",
                                    subscriptions=[], max_message_bytes=own)
    return agent


def test_an_agent_publishes_in_min_of_own_and_announced_m_and_warns_once(caplog):
    agent = _agent(1_000_000)
    assert agent.transport is not None
    with caplog.at_level(logging.WARNING, logger="edgepfl.agent"):
        assert agent.adopt_limits(CoordinatorMeta(state="online", max_message_bytes=300_000)) == 300_000
        assert agent.adopt_limits(CoordinatorMeta(state="online", round=1, max_message_bytes=300_000)) == 300_000
    assert agent.transport.max_message_bytes == 300_000
    assert agent.transport.accept_message_bytes == 1_000_000
    warnings = [r.getMessage() for r in caplog.records if "announces max_message_bytes=300000" in r.getMessage()]
    assert len(warnings) == 1 and "1000000" in warnings[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgepfl.agent"):
        # a coordinator with a larger M (or one that announces none): the agent keeps its own
        assert agent.adopt_limits(CoordinatorMeta(state="online", max_message_bytes=5_000_000)) == 1_000_000
        assert agent.transport.accept_message_bytes == 5_000_000  # its chunks are accepted
        assert agent.adopt_limits(CoordinatorMeta(state="online")) == 1_000_000
        agent.adopt_limits(CoordinatorMeta(state="online", max_payload_bytes=100_000))
    assert [r.getMessage() for r in caplog.records if "at most 100000 bytes" in r.getMessage()]
    assert not [r for r in caplog.records if "announces max_message_bytes" in r.getMessage()]
