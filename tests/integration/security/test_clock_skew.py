"""Devices whose clocks are 20 minutes off, either way, in a live signed federation: each
either works or is told why (docs/SECURITY.md, "Clocks: a device requirement").

A real coordinator (its own signing key, every agent enrolled) and three real agent
processes that pin its key, on the test Mosquitto. Two run with libfaketime preloaded
(Debian's `faketime`: the process's whole clock is shifted, not a patched function):

* agent-01, 20 minutes **ahead**: every signed task is past its deadline by its clock. It
  runs none and answers each with a refusal `expired` whose detail says how far ahead its
  clock reads: the operator sees it in every row's `refused`, and the round does not wait
  for it.
* agent-02 runs with the right clock, then is restarted 20 minutes **behind**: its new
  process's birth is older than its last process's statuses. It was refused
  `stale_status` and never sampled again; a session the run has not heard is a new
  process, so it is heard and trains again. (A replay of a heard session's birth stays
  refused: tests/unit/protocol/test_signing.py.)

agent-00 keeps the right clock throughout.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import yaml

from edgepfl.atomic import write_bytes
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_config, data_shape, prepare, spawn_agent, stop_agents

from tests.attack_kit import signed_fleet
from tests.conftest import _require
from tests.fleet_helpers import read_rows, run_config, run_in_thread, wait_until

AGENTS = ("agent-00", "agent-01", "agent-02")


def libfaketime() -> str:
    """The preload library of Debian's ``faketime`` package."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")) + sorted(glob.glob("/usr/lib/faketime/libfaketime.so.1"))
    return _require(found[0] if found else None, "libfaketime is not installed: apt-get install faketime")


def spawn_skewed(config, out, url, agent_id: str, index: int, security, offset: str) -> subprocess.Popen:
    """``edgepfl agent`` with its clock shifted by ``offset`` (e.g. "+20m"), as spawn_agent starts it.
    The library is preloaded into the agent itself (what ``faketime -f`` does, without the
    ``faketime`` process in between, which would not pass SIGTERM on and leave the agent running)."""
    cfg = agent_config(config, out, url, agent_id, index, "trainer", "lr", 1, security)
    path = out / "agents" / f"{agent_id}-skewed.yaml"
    write_bytes(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).encode())
    log = open(out / "agents" / f"{agent_id}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "edgepfl.cli", "agent", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LD_PRELOAD=libfaketime(),
                                     FAKETIME=offset, FAKETIME_DONT_RESET="1"))


def test_a_clock_20_minutes_ahead_is_told_why_and_one_20_minutes_behind_after_a_restart_works(mosquitto, tmp_path):
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", AGENTS)
    # quorum one of the three: agent-01 refuses every task, so when agent-02 is stopped mid-round
    # agent-00's update alone is the quorum and the round closes on agent-02's offline status, not
    # at twice its timeout (60 s of nothing); each round still waits for every sampled agent online,
    # and the next one for agent-02's new process (one round timeout at most per round)
    config = run_config(rounds=8, round_timeout_s=30, quorum=0.3, security=coordinator_security,
                        model={"arch": "mlp", "feature_dim": 16}, data={"dataset": "digits"})
    config = prepare(config, len(AGENTS))  # min_agents = 3
    out, url = tmp_path / "run", mosquitto.url
    procs = {
        "agent-00": spawn_agent(config, out, url, "agent-00", 0, security=agent_security["agent-00"]),
        "agent-01": spawn_skewed(config, out, url, "agent-01", 1, agent_security["agent-01"], "+20m"),
        "agent-02": spawn_agent(config, out, url, "agent-02", 2, security=agent_security["agent-02"]),
    }
    fleet = MqttFleet(config.federation, config.broker, url=url, security=coordinator_security)
    coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
    thread, box = run_in_thread(coordinator.run)
    try:
        # two rounds with agent-02 on the right clock, then it restarts 20 minutes behind
        wait_until(lambda: len(read_rows(out)) >= 2 or "error" in box, 600, what="two rounds")
        first_session = coordinator.registry.agents["agent-02"].session
        stop_agents([procs["agent-02"]])
        procs["agent-02"] = spawn_skewed(config, out, url, "agent-02", 2, agent_security["agent-02"], "-20m")
        wait_until(lambda: coordinator.registry.agents["agent-02"].session not in (None, first_session)
                   or "error" in box, 300, what="agent-02's new process heard")
        restarted_in = len(read_rows(out))
        thread.join(timeout=900)
        assert not thread.is_alive() and "error" not in box, box.get("error")
    finally:
        stop_agents(list(procs.values()))
        fleet.close()
    assert all(proc.poll() is not None for proc in procs.values())  # no agent outlives the test
    rows = read_rows(out)
    training = [row for row in rows if not row.final]
    assert len(training) == 8
    # ahead: refused as expired in every round, the round not waiting for it, never trained
    assert all(row.refused.get("expired", 0) == 1 for row in training), [row.refused for row in training]
    assert all("agent-01" not in row.participants for row in training)
    log = (out / "agents" / "agent-01.log").read_text(errors="replace")
    assert "device's clock is that far ahead" in log
    # behind, after a restart: heard again (no stale_status) and trained in the rounds after it
    assert all("stale_status" not in row.rejected for row in rows), [row.rejected for row in rows]
    assert any("agent-02" in row.participants for row in training[restarted_in:]), \
        [(row.round, row.participants) for row in training]
    assert all("agent-00" in row.participants for row in training)
