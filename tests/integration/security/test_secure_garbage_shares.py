"""One enrolled device of six attacks every secure round (edgepfl's own agent with one answer
changed: tests/hostile_agents/). Live over Mosquitto, a signed and enrolled fleet, real agent
processes.

* It seals garbage shares to its neighbours: they refuse their tasks as ``bad_shares`` naming
  it, that one round goes without them, and from the next round on the device is in no roster.
* It sends its masked vector scaled x1000: with ``group_size: 3`` its group's sum is set aside
  and the other group makes the round, until it is the one device common to the set-aside
  groups, within three rounds; then it is in no roster.

Either way the rounds go on with the five honest devices, and the fleet view says why it is
suspended and until when."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import yaml

from edgepfl.atomic import write_bytes
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.ops.status import fetch_view
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_config, agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, agent_topic, decode

from tests.attack_kit import signed_fleet
from tests.fleet_helpers import run_config

pytest.importorskip("torch")

AGENTS, ROUNDS = 6, 4


def _hostile(module: str):
    """A spawner of ``tests.hostile_agents.<module>`` in place of edgepfl's agent."""
    def spawn(config, out, url: str, agent_id: str, index: int, security) -> subprocess.Popen:
        cfg = agent_config(config, out, url, agent_id, index, "trainer", "lr", 1, security)
        path = out / "agents" / f"{agent_id}.yaml"
        write_bytes(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).encode())
        log = open(out / "agents" / f"{agent_id}.log", "ab")
        return subprocess.Popen([sys.executable, "-m", f"tests.hostile_agents.{module}", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT)
    return spawn


def _run(tmp_path, mosquitto, attacker: str, module: str, rounds: int, **secure):
    """The secure run with ``attacker`` as ``module``: its training rows and the fleet view."""
    ids = agent_ids(AGENTS)
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", ids)
    config = prepare(run_config(f"gs{uuid.uuid4().hex[:8]}", rounds=rounds, min_agents=3, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, aggregation={"rule": "mean"},
                                data={"dataset": "digits", "samples_per_client": 120},
                                security=coordinator_security,
                                secure_aggregation={"enabled": True, "step_timeout_s": 60, **secure}), AGENTS)
    out = tmp_path / "run"
    (out / "agents").mkdir(parents=True)
    procs = [(_hostile(module) if a == attacker else spawn_agent)(config, out, mosquitto.url, a, i,
                                                                  security=agent_security[a])
             for i, a in enumerate(ids)]
    fleet = MqttFleet(config.federation, config.broker, url=mosquitto.url, security=coordinator_security)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
        view = fetch_view(mosquitto.url, config.federation)
    finally:
        fleet.close()
        stop_agents(procs)
    return config, out, rows, view


@pytest.mark.timeout(600)
def test_a_device_sealing_garbage_shares_costs_one_round_then_is_out_of_every_roster(
        mosquitto, broker_capture, tmp_path):
    ids = agent_ids(AGENTS)
    attacker = ids[2]
    config, out, rows, view = _run(tmp_path, mosquitto, attacker, "garbage_sealer", ROUNDS)
    rows = [r for r in rows if not r.final]
    honest = [a for a in ids if a != attacker]
    # round 0: every neighbour of it (all five: six devices are one neighbourhood) refused, naming it
    assert rows[0].refused == {"bad_shares": len(honest)}
    for row in rows[1:]:  # then: out of every roster, and the rounds whole again
        assert not row.aborted and sorted(row.participants) == honest and not row.refused, row
    steps_to_it = [decode(p).header.round for t, p in broker_capture.snapshot()
                   if t == agent_topic(config.federation, attacker, "task") and p
                   and decode(p).type is MessageType.SECAGG]
    assert steps_to_it and set(steps_to_it) == {0}
    shown = next(a for a in view.agents if a.id == attacker)
    assert shown.suspended is not None and f"did not open for {len(honest)} of its neighbours" in shown.suspended
    assert all(next(a for a in view.agents if a.id == h).suspended is None for h in honest)
    for agent_id in honest:
        log = (out / "agents" / f"{agent_id}.log").read_text()
        assert f"the shares from {attacker} do not open" in log, log[-2000:]


@pytest.mark.timeout(600)
def test_a_device_scaling_its_masked_vector_costs_its_group_then_is_out_of_every_roster(mosquitto, tmp_path):
    ids = agent_ids(AGENTS)
    attacker = ids[4]
    _, _, rows, view = _run(tmp_path, mosquitto, attacker, "scaled_masker", 5, group_size=3)
    training = [r for r in rows if not r.final]
    honest = [a for a in ids if a != attacker]
    shown = next(a for a in view.agents if a.id == attacker)
    assert shown.suspended is not None and "the only one in common" in shown.suspended
    named_in = int(shown.suspended.split("in common (round ")[1].split(")")[0])
    assert named_in <= 2  # k = 1 + ceil(log2 3) = 3 rounds: 0, 1, 2
    for row in training[:named_in + 1]:  # its group's sum set aside, the other group's taken: no round lost
        assert not row.aborted and row.secure.unmasked and (row.secure.groups, row.secure.set_aside) == (2, 1), row
    for row in training[named_in + 1:]:
        assert not row.aborted and sorted(row.participants) == honest and row.secure.set_aside == 0, row
    assert all(next(a for a in view.agents if a.id == h).suspended is None for h in honest)
    # every round adopted a state: the model learnt (how close to an all-honest run: the unit test of the same name)
    assert rows[-1].final and rows[-1].accuracy > training[0].accuracy
