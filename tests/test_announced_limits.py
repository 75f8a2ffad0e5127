"""The coordinator announces its message size M (and its largest frame) in its retained
presence; an agent configured for a larger M publishes in messages of the announced
size and says so loudly. The issue's case: an agent left at the default M behind a
broker with a smaller packet limit was disconnected and its update lost."""

from __future__ import annotations

import logging

import pytest

from edgepfl.config import AgentConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, prepare, service_data_shape, spawn_agent, stop_agents
from edgepfl.edge_agent.agent import Agent
from edgepfl.protocol import CoordinatorMeta, MessageType, decode, encode
from edgepfl.protocol.transport import MqttTransport
from edgepfl.testing import MosquittoBroker, TrafficCapture

from tests.fleet_helpers import run_config


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


@pytest.mark.slow
def test_an_agent_left_at_the_default_m_behind_a_small_packet_limit_still_delivers(tmp_path):
    """Mosquitto refuses packets over 50 kB; the coordinator is configured for it (M = 40 kB),
    the agents are left at the default 1 MB. Their ~85 kB updates get through, in chunks
    of the announced size, and the round is complete."""
    broker = MosquittoBroker(max_packet_bytes=50_000)
    broker.start()
    capture = None
    agents = []
    fleet = None
    try:
        base = run_config(rounds=1, min_agents=2, model={"arch": "mlp", "feature_dim": 16}, device="cpu",
                          data={"dataset": "digits", "samples_per_client": 60}, round_timeout_s=40)
        agent_side = prepare(base, 2)
        assert agent_side.broker.max_message_bytes == 1_000_000
        coord = agent_side.model_copy(update={"broker": agent_side.broker.model_copy(
            update={"url": broker.url, "max_message_bytes": 40_000})})
        capture = TrafficCapture(broker.url, topic=f"edgepfl/v1/{coord.federation}/#").start()
        fleet = MqttFleet(coord.federation, coord.broker)
        agents = [spawn_agent(agent_side, tmp_path, broker.url, a, i) for i, a in enumerate(agent_ids(2))]
        rows = Coordinator(coord, fleet, tmp_path / "run", progress=False, **service_data_shape(coord)).run()
    finally:
        if fleet is not None:
            fleet.close()
        stop_agents(agents)
        if capture is not None:
            capture.stop()
        broker.stop()
    assert rows[0].participants == agent_ids(2) and rows[0].rejected == {}
    updates = [(t, p) for t, p in capture.snapshot() if t.endswith("/update")]
    assert updates and max(len(p) for _, p in updates) <= 40_000
    assert any(decode(p).type == MessageType.CHUNK for _, p in updates)  # the update did not fit one message
    presence = [decode(p).meta_as(CoordinatorMeta) for t, p in capture.snapshot() if t.endswith("/coordinator")]
    assert presence and all(m.max_message_bytes == 40_000 for m in presence)
    for agent_id in agent_ids(2):
        log = (tmp_path / "agents" / f"{agent_id}.log").read_text()
        assert "announces max_message_bytes=40000, below this agent's 1000000" in log
