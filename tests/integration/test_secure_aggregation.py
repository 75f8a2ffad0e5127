"""Secure aggregation live (issue #35, protocol 1.9): a real coordinator and six real agent
processes over Mosquitto, the same federation run in the clear and secure. Two agents are
killed in round 1 after sealing their shares (``EDGEPFL_FAILPOINT=agent.train_task:2``: the
process SIGKILLs itself as its second training task arrives), so their neighbours' masks
with them must be removed from keys the survivors' shares rebuild. The secure run ends in
the clear run's state bit for bit, and every update that crossed the broker — what the
coordinator received — was one masked vector, never a shared tensor."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.failpoints import ENV as FAILPOINT
from edgepfl.protocol import MessageType, agent_topic, decode
from edgepfl.protocol.secagg import MASKED_TENSOR, SecAggMeta

from tests.fleet_helpers import run_config

pytest.importorskip("torch")

AGENTS = 6
KILLED = (1, 4)
NO_BOUNDS = {"max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}


def federate(secure: bool, url: str, out, monkeypatch):
    config = prepare(run_config(f"sa{uuid.uuid4().hex[:8]}", rounds=2, min_agents=AGENTS, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, aggregation=NO_BOUNDS,
                                data={"dataset": "digits", "samples_per_client": 120},
                                secure_aggregation={"enabled": secure, "step_timeout_s": 60}), AGENTS)
    ids = agent_ids(AGENTS)
    procs = []
    for index, agent_id in enumerate(ids):
        if index in KILLED:
            monkeypatch.setenv(FAILPOINT, "agent.train_task:2")
        else:
            monkeypatch.delenv(FAILPOINT, raising=False)
        procs.append(spawn_agent(config, out, url, agent_id, index))
    monkeypatch.delenv(FAILPOINT, raising=False)
    fleet = MqttFleet(config.federation, config.broker, url=url)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
    finally:
        fleet.close()
        stop_agents(procs)
    return config, coordinator, rows, [procs[i].returncode for i in KILLED]


def test_a_secure_federation_with_a_third_killed_mid_round_ends_in_the_clear_runs_state(
        mosquitto, broker_capture, tmp_path, monkeypatch):
    _, plain, plain_rows, plain_killed = federate(False, mosquitto.url, tmp_path / "plain", monkeypatch)
    broker_capture.clear()
    config, secure, secure_rows, secure_killed = federate(True, mosquitto.url, tmp_path / "secure", monkeypatch)
    assert plain_killed == secure_killed == [-9, -9]  # SIGKILL at the failpoint, in both runs

    ids = agent_ids(AGENTS)
    survivors = sorted(a for i, a in enumerate(ids) if i not in KILLED)
    for rows in (plain_rows, secure_rows):
        trained = [r for r in rows if not r.final]
        assert [sorted(r.participants) for r in trained] == [ids, survivors]
        assert not any(r.aborted for r in trained)
    x, y = plain._server_state().global_tensors, secure._server_state().global_tensors
    assert set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
    assert [r.accuracy for r in secure_rows] == [r.accuracy for r in plain_rows]

    captured = broker_capture.snapshot()
    fed = config.federation
    for agent_id in ids:
        frames = [decode(p) for t, p in captured if t == agent_topic(fed, agent_id, "update")]
        updates = [m for m in frames if m.type == MessageType.UPDATE and m.meta.kind == "train"]
        assert len(updates) == (1 if agent_id not in survivors else 2)
        for update in updates:  # one vector, uniform in the ring: no top bits of a small integer
            assert set(update.tensors) == {MASKED_TENSOR}
            top = update.tensors[MASKED_TENSOR].view("<u8") >> np.uint64(48)
            assert np.mean((top == 0) | (top == 0xFFFF)) < 0.01
        steps = [(m.header.round, m.meta_as(SecAggMeta).step) for m in frames if m.type == MessageType.SECAGG]
        expected = [(0, "keys"), (0, "shares"), (0, "reveal"), (1, "keys"), (1, "shares")]
        assert steps == (expected + [(1, "reveal")] if agent_id in survivors else expected)
