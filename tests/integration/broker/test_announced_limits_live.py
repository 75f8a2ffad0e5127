"""The coordinator announces its message size M (and its largest frame) in its retained
presence; an agent configured for a larger M publishes in messages of the announced
size and says so loudly. The case that lost updates, live: an agent left at the default M behind a
broker with a smaller packet limit was disconnected and its update lost (the agent's
side in process: tests/unit/edge_agent/test_announced_limits.py)."""

from __future__ import annotations

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, prepare, service_data_shape, spawn_agent, stop_agents
from edgepfl.protocol import CoordinatorMeta, MessageType, decode
from edgepfl.testing import MosquittoBroker, TrafficCapture

from tests.fleet_helpers import run_config


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
