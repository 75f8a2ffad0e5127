"""A buffered asynchronous federation under attack, and a coordinator killed mid-buffer.

The gate, signatures, bounds and NACKs keep working when rounds are buffered,
and a ``kill -9`` while the open state's buffer holds an update resumes from the last
adopted state bit for bit. A real Mosquitto, three signed agent processes, the
coordinator as its own process (it is the one killed), and an attacker that holds no
key and knows only docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import yaml

from edgepfl.coordinator.simulate import prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, TaskMeta, UpdateMeta, decode, encode
from edgepfl.protocol.signing import generate_keypair, load_signer
from edgepfl.protocol.view import FleetView, parse_view

from tests.attack_kit import Attacker, signed_fleet
from tests.fleet_helpers import checkpoint_tensors, read_rows, run_config, wait_until

TRAINERS = ("agent-00", "agent-01", "agent-02")
ROUNDS = 24  # states are fast: enough of them that the freeze below lands mid-run


def _coordinator(cmd: list[str], log_path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ))


def test_a_buffered_federation_refuses_every_attack_and_resumes_bit_identically_after_kill_9_mid_buffer(
        mosquitto, tmp_path, ref):
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", TRAINERS)
    config = run_config(
        method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
        data={"dataset": "digits", "num_clients": 3}, rounds=ROUNDS, round_timeout_s=120,
        asynchrony={"mode": "buffered", "buffer_size": 2}, stragglers={"max_staleness": 1},
        broker={"max_payload_bytes": 2**20}, observe={"view_interval_s": 0.2}, security=coordinator_security)
    config = prepare(config, len(TRAINERS))
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    spec = config.model_dump(mode="json")
    spec["broker"]["url"] = url
    (tmp_path / "coordinator.yaml").write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "edgepfl.cli", "coordinator", "--config", str(tmp_path / "coordinator.yaml"),
           "--out", str(out)]
    state_json = out / "checkpoint" / "state.json"

    def checkpointed() -> int:
        return json.loads(state_json.read_text())["round"] if state_json.exists() else -1

    attacker = Attacker(url, fed)
    procs = {agent: spawn_agent(config, out, url, agent, i, security=agent_security[agent])
             for i, agent in enumerate(TRAINERS)}
    first = second = None
    try:
        first = _coordinator(cmd, tmp_path / "coordinator1.log")

        # --- state 0: a forged answer (no key, then a key nobody enrolled) and an oversized frame
        task = decode(wait_until(lambda: next(iter(attacker.frames("agents/agent-00/task")), None), 300,
                                 what="agent-00's first task"))
        forged = {"task_id": task.meta_as(TaskMeta).task_id, "kind": "train", "num_train": 10**6, "num_test": 10,
                  "eval_correct": 10}
        attacker.publish("agents/agent-00/update", ref["encode_frame"]("update", fed, "agent-00", task.header.round,
                                                                      forged))
        generate_keypair(tmp_path / "mallory.key", tmp_path / "mallory.pub")
        attacker.publish("agents/agent-00/update", encode(
            MessageType.UPDATE, federation=fed, sender="agent-00", round=task.header.round,
            meta=UpdateMeta(**forged), tensors=dict(task.tensors), signer=load_signer(tmp_path / "mallory.key")))
        attacker.publish("agents/agent-01/update", b"EPF1" + os.urandom(2 * 2**20))

        # --- replays of agent-00's first real update: while its state is still open to late
        # updates (a duplicate), then once it is older than max_staleness (stale)
        real = wait_until(lambda: [f for f in attacker.frames("agents/agent-00/update")
                                   if decode(f).header.round == task.header.round
                                   and decode(f).meta_as(UpdateMeta).num_train != 10**6], 300,
                          what="agent-00's real update")[0]
        wait_until(lambda: checkpointed() >= 0, 300, what="state 0")
        attacker.publish("agents/agent-00/update", real)
        wait_until(lambda: checkpointed() >= 2, 300, what="state 2")
        attacker.publish("agents/agent-00/update", real)
        # the stale replay counted (the view), and in a row (a state adopted since)
        wait_until(lambda: any(parse_view(v).rejected.get("stale") for v in attacker.frames("view")), 60,
                   what="the stale replay rejected")
        counted = checkpointed()
        wait_until(lambda: checkpointed() > counted, 60, what="a state after the stale replay")

        # --- mid-buffer: with two devices frozen, at most one more update can come in (agent-00
        # answers one task per state), so the open state's buffer of 2 holds it and waits
        for agent in TRAINERS[1:]:
            procs[agent].send_signal(signal.SIGSTOP)
        frozen_at = time.time()

        def open_buffer() -> FleetView | None:
            # the coordinator's own view, published after the freeze had settled: a state open,
            # an update folded into its buffer, not yet adopted
            views = [parse_view(v) for v in attacker.frames("view")]
            view = views[-1] if views else None
            settled = view is not None and view.updated > frozen_at + 2.0 and view.phase == "training"
            return view if settled and view.updates >= 1 and view.round == checkpointed() + 1 else None

        view = wait_until(open_buffer, 100, interval=0.2, what="an update in the open buffer")
        first.send_signal(signal.SIGKILL)
        first.wait()
        k = checkpointed()
        assert (k + 1, view.buffer_size) == (view.round, 2)  # killed with the buffer of state k + 1 partly full
        saved = checkpoint_tensors(out / "checkpoint")
        rows_before = read_rows(out)
        assert [r.round for r in rows_before] == list(range(k + 1))
        for agent in TRAINERS[1:]:
            procs[agent].send_signal(signal.SIGCONT)

        # --- the restarted coordinator goes on from state k, bit for bit
        resumed_from = len(attacker.drain())
        second = _coordinator(cmd, tmp_path / "coordinator2.log")
        assert second.wait(timeout=600) == 0, (tmp_path / "coordinator2.log").read_text()[-3000:]
        time.sleep(0.5)  # the last frames in flight to the attacker's client
        attacker.drain()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        stop_agents(list(procs.values()))
        attacker.close()

    log2 = (tmp_path / "coordinator2.log").read_text()
    assert f"resuming from checkpoint after round {k}" in log2
    tasks = [decode(p) for t, p in attacker.log[resumed_from:] if t.endswith("/task") and p]
    assert tasks and min(m.header.round for m in tasks) == k + 1
    for resumed_task in (m for m in tasks if m.header.round == k + 1):
        for key, value in resumed_task.tensors.items():
            np.testing.assert_array_equal(value, saved[f"global::{key}"])

    rows = read_rows(out)
    assert [r.round for r in rows if not r.final] == list(range(ROUNDS))  # no state lost, none repeated
    assert rows[:k + 1] == rows_before  # the first coordinator's rows, as it wrote them
    for row in rows[:-1]:
        folded = row.participants + row.late
        assert len(folded) == 2 == len(set(folded)) and set(folded) <= set(TRAINERS), row
        assert not row.aborted, row
    rejected: dict[str, int] = {}
    for row in rows:
        for reason, count in row.rejected.items():
            rejected[reason] = rejected.get(reason, 0) + count
    assert rejected.get("unsigned", 0) >= 1 and rejected.get("bad_signature", 0) >= 1, rejected
    assert rejected.get("oversized", 0) >= 1, rejected
    assert rejected.get("stale", 0) >= 1 and rejected.get("duplicate", 0) + rejected["stale"] >= 2, rejected
    assert rejected.keys() <= {"unsigned", "bad_signature", "oversized", "duplicate", "stale", "unexpected"}, rejected
    # every honest device kept contributing after the restart
    assert {a for row in rows[k + 1:-1] for a in row.participants + row.late} == set(TRAINERS)
