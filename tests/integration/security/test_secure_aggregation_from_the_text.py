"""Secure aggregation from the text, live: three of six agents mask, share and open with the
second implementation (tests/foreign_agent/secagg.py, written from PROTOCOL.md §19 alone; the
process is tests/foreign_agent/secagg_agent.py), three with the project's, over a real
Mosquitto in a signed, enrolled fleet. One agent of each kind dies in round 1 after its shares
went out, so the survivors reveal shares sealed by both implementations and the coordinator
rebuilds a text agent's mask key from Shamir shares the text's split made. The secure run
ends in the state of the same federation run in the clear, bit for bit: every mask and every
grid integer of the two implementations agree."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.atomic import open_for_append, write_bytes
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_config, agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.failpoints import ENV as FAILPOINT
from edgepfl.protocol import MessageType, agent_topic, decode
from edgepfl.protocol.secagg import MASKED_TENSOR, SecAggMeta

from tests.attack_kit import signed_fleet
from tests.fleet_helpers import run_config

pytest.importorskip("torch")

AGENTS = 6
#: the agents whose secure aggregation is the text's
TEXT = (0, 1, 4)
#: killed as their second training task arrives (round 1), after their shares went out: one of each kind
KILLED = (1, 3)
TEXT_AGENT = Path(__file__).resolve().parents[2] / "foreign_agent" / "secagg_agent.py"
NO_BOUNDS = {"rule": "mean", "max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}


def spawn_text_agent(config, out: Path, url: str, agent_id: str, index: int, security, env: dict) -> subprocess.Popen:
    """``spawn_agent``'s process, its secure aggregation the text's."""
    cfg = agent_config(config, out, url, agent_id, index, "trainer", "lr", 1, security)
    path = out / "agents" / f"{agent_id}.yaml"
    write_bytes(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).encode())
    log = open_for_append(out / "agents" / f"{agent_id}.log")
    return subprocess.Popen([sys.executable, str(TEXT_AGENT), "--config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, env=env)


def federate(secure: bool, url: str, out: Path, monkeypatch, keys):
    coordinator_security, agent_security = keys
    config = prepare(run_config(f"st{uuid.uuid4().hex[:8]}", rounds=2, min_agents=AGENTS, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, aggregation=NO_BOUNDS,
                                data={"dataset": "digits", "samples_per_client": 120},
                                security=coordinator_security,
                                secure_aggregation={"enabled": secure, "step_timeout_s": 60}), AGENTS)
    procs = []
    for index, agent_id in enumerate(agent_ids(AGENTS)):
        if index in KILLED:
            monkeypatch.setenv(FAILPOINT, "agent.train_task:2")
        else:
            monkeypatch.delenv(FAILPOINT, raising=False)
        if index in TEXT:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            procs.append(spawn_text_agent(config, out, url, agent_id, index, agent_security[agent_id], env))
        else:
            procs.append(spawn_agent(config, out, url, agent_id, index, security=agent_security[agent_id]))
    monkeypatch.delenv(FAILPOINT, raising=False)
    fleet = MqttFleet(config.federation, config.broker, url=url, security=coordinator_security)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
    finally:
        fleet.close()
        stop_agents(procs)
    return config, coordinator, rows, [procs[i].returncode for i in KILLED]


def test_agents_masking_with_the_texts_implementation_and_the_projects_sum_to_the_clear_runs_state(
        mosquitto, broker_capture, tmp_path, monkeypatch):
    ids = agent_ids(AGENTS)
    keys = signed_fleet(tmp_path / "keys", ids)
    _, plain, plain_rows, plain_killed = federate(False, mosquitto.url, tmp_path / "plain", monkeypatch, keys)
    broker_capture.clear()
    config, secure, secure_rows, secure_killed = federate(True, mosquitto.url, tmp_path / "secure", monkeypatch, keys)
    assert plain_killed == secure_killed == [-9, -9]  # SIGKILL at the failpoint, in both runs

    survivors = sorted(a for i, a in enumerate(ids) if i not in KILLED)
    for rows in (plain_rows, secure_rows):
        trained = [r for r in rows if not r.final]
        assert [sorted(r.participants) for r in trained] == [ids, survivors]
        assert not any(r.aborted for r in trained)
    secure_round_1 = [r for r in secure_rows if not r.final][1].secure
    assert secure_round_1 is not None and secure_round_1.unmasked and secure_round_1.recovered == len(KILLED)
    x, y = plain.server_state().global_tensors, secure.server_state().global_tensors
    assert set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
    assert [r.accuracy for r in secure_rows] == [r.accuracy for r in plain_rows]

    # the text's agents really took the secure steps: a masked vector each round, keys, shares and reveals
    captured = broker_capture.snapshot()
    for index in TEXT:
        agent_id = ids[index]
        frames = [decode(p) for t, p in captured if t == agent_topic(config.federation, agent_id, "update")]
        updates = [m for m in frames if m.type == MessageType.UPDATE and m.meta.kind == "train"]
        assert [set(u.tensors) for u in updates] == [{MASKED_TENSOR}] * (1 if index in KILLED else 2)
        steps = [m.meta_as(SecAggMeta).step for m in frames if m.type == MessageType.SECAGG]
        assert steps[:3] == ["keys", "shares", "reveal"] and steps.count("shares") == 2
