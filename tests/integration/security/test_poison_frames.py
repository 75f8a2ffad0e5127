"""Poison frames on every topic of a live federation: no process exits, each frame is one
counted rejection, the run completes with every honest agent (the red team's first finding, docs/SECURITY.md).

The attacker is a plain paho client on the default (unsigned, anonymous) deployment. It
publishes the red team's frame — a header of JSON nested 200,000 deep — and the rest of
the poison corpus of ``test_bounded_json`` on every topic of the protocol: retained
before the agents start (so each of them reads it on subscribe, as after a restart), on
an enrolled agent's retained status before the coordinator starts (the frame that
crash-looped a restarted coordinator), and live during round 0 on the coordinator's and
the agents' topics. The conformance kit's network thread gets the same corpus.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgepfl.conformance.wire import Wire
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, StatusMeta, encode

from tests.fleet_helpers import read_rows, run_config, run_in_thread, wait_until
from tests.integration.security.test_hostile_fleet import Attacker, agent_log
from tests.unit.protocol.test_bounded_json import POISON_FRAMES, POISON_JSON

TRAINERS = ("agent-00", "agent-01")
HEAD = "device-00"
RETAINED_BEFORE_START = ("coordinator", "release", "release/0", "view", "agents/ghost/status")


def run_while_forging(attacker, forge: Callable[[str, bytes], None], config, url: str, out: Path,
                      fleets: list[MqttFleet]) -> None:
    """Run the federation to its end with a real coordinator while every task it sends is
    handed to ``forge(agent_id, task frame)`` on a thread of its own, as the attacker reads
    it off the broker (the fleet goes into ``fleets``, for the caller to close)."""
    def on_message(client, userdata, msg) -> None:
        attacker.seen.put((msg.topic, bytes(msg.payload)))
        parts = msg.topic.split("/")
        if len(parts) == 6 and parts[5] == "task" and msg.payload:
            threading.Thread(target=forge, args=(parts[4], bytes(msg.payload)), daemon=True).start()

    attacker.client.on_message = on_message
    wait_until(lambda: all(attacker.frames(f"agents/{a}/status") for a in TRAINERS), 180, what="agents' births")
    fleet = MqttFleet(config.federation, config.broker, url=url)
    fleets.append(fleet)
    coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
    thread, box = run_in_thread(coordinator.run)
    thread.join(timeout=900)
    assert not thread.is_alive() and "error" not in box, box.get("error")


def test_poison_on_every_topic_kills_nothing_and_each_frame_is_one_rejection(mosquitto, tmp_path):
    config = prepare(run_config(rounds=2, round_timeout_s=60), len(TRAINERS), head_agents=1)
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    procs: list[subprocess.Popen] = []
    fleet = None
    try:
        for suffix in RETAINED_BEFORE_START:
            attacker.publish(suffix, POISON_FRAMES[0], retain=True)
        procs = [spawn_agent(config, out, url, agent, i) for i, agent in enumerate(TRAINERS)]
        procs.append(spawn_agent(config, out, url, HEAD, len(TRAINERS), tier="head"))
        # the head agent too: the poison below goes to its task topic live, so it must be
        # listening (trainers forked warm come online long before a fresh head agent)
        wait_until(lambda: all(attacker.frames(f"agents/{a}/status") for a in (*TRAINERS, HEAD)), 180,
                   what="agents' births")
        # the enrolled agent's own retained status replaced by poison: the coordinator reads it first
        attacker.publish("agents/agent-00/status", POISON_FRAMES[0], retain=True)

        fleet = MqttFleet(fed, config.broker, url=url)
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        thread, box = run_in_thread(coordinator.run)
        wait_until(lambda: attacker.frames("agents/agent-00/task"), 240, what="agent-00's first task")
        # round 0, live: the whole corpus on every topic the coordinator and the agents read
        live_to_coordinator = ("agents/agent-00/update", "agents/agent-01/metrics", "agents/agent-01/status")
        for frame in POISON_FRAMES:
            for suffix in (*live_to_coordinator, "agents/agent-00/task", f"agents/{HEAD}/task", "coordinator"):
                attacker.publish(suffix, frame)

        thread.join(timeout=600)
        assert not thread.is_alive(), "the coordinator did not finish"
        assert "error" not in box, box.get("error")
        for proc, agent in zip(procs, (*TRAINERS, HEAD)):
            assert proc.poll() is None, f"{agent} exited:\n{agent_log(out, agent)[-2000:]}"

        rows = read_rows(out)
        assert len(rows) == config.rounds + 1 and rows[-1].final
        for row in rows[:-1]:  # agent-00 announced itself again: nobody was shut out
            assert set(row.participants) == set(TRAINERS), row
        # one rejection per frame: the live corpus, the ghost's retained status, the retained
        # release and release part 0 (a coordinator with no release of its own reads them, to
        # adopt an earlier run's), and agent-00's poisoned retained status unless agent-00
        # re-announced itself before the coordinator subscribed (its new birth replaces the poison)
        live = len(POISON_FRAMES) * len(live_to_coordinator)
        assert live + 3 <= coordinator.counters.rejected["malformed"] <= live + 4, coordinator.counters.rejected
        for agent in (*TRAINERS, HEAD):
            assert "malformed" in agent_log(out, agent), agent

        # edgepfl status reading a poisoned view: one line, and its documented exit code for "no view"
        fleet.close()
        fleet = None
        attacker.publish("view", POISON_FRAMES[0], retain=True)
        status = subprocess.run([sys.executable, "-m", "edgepfl.cli", "status", "--broker", url, "--federation", fed],
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 1, status.stderr
        assert status.stderr.count("\n") == 1 and "fleet view" in status.stderr, status.stderr
    finally:
        for suffix in (*RETAINED_BEFORE_START, "agents/agent-00/status"):
            attacker.client.publish(f"edgepfl/v1/{fed}/{suffix}", b"", qos=1, retain=True)
        attacker.close()
        if fleet is not None:
            fleet.close()
        stop_agents(procs)


def test_the_conformance_kits_network_thread_records_poison_as_errors_and_keeps_going(mosquitto):
    fed = f"kit{time.time_ns() % 10**9}"
    will = encode(MessageType.STATUS, federation=fed, sender="coordinator", round=-1,
                  meta=StatusMeta(state="offline"))
    wire = Wire(mosquitto.url, fed, will=will).start()
    attacker = Attacker(mosquitto.url, fed)
    try:
        for frame in POISON_FRAMES:
            for channel in ("status", "update", "metrics"):
                attacker.publish(f"agents/agent-00/{channel}", frame)
        honest = encode(MessageType.STATUS, federation=fed, sender="agent-00", round=-1,
                        meta=StatusMeta(state="online", num_train=10))
        attacker.publish("agents/agent-00/status", honest)
        assert wire.wait(lambda f: f.data == honest and f.message is not None, 60) is not None
        poisoned = [f for f in wire.since(0) if f.data in POISON_FRAMES]
        assert len(poisoned) == 3 * len(POISON_JSON)
        assert all(f.message is None and "malformed" in (f.error or "") for f in poisoned)
    finally:
        attacker.close()
        wire.stop()




def test_forged_frames_ahead_of_every_real_update_cost_no_agent_its_task(mosquitto, tmp_path, ref):
    """Unsigned deployment. The moment a task goes out, the attacker answers it in the
    agent's name three ways — meta that does not parse, a count the agent never announced,
    a non-finite tensor — before the agent can. Every one is rejected, NACKed to the agent
    (the header names it), and none may cost the agent its task: every round aggregates
    both agents' real updates."""
    config = prepare(run_config(rounds=3, round_timeout_s=120), len(TRAINERS))
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    procs = [spawn_agent(config, out, url, agent, i) for i, agent in enumerate(TRAINERS)]
    forged_per_task: dict[str, int] = {}

    def forge(agent: str, task_frame: bytes) -> None:
        header, tensors = ref["decode_frame"](task_frame)
        meta = header["meta"]
        if header["type"] != "task" or meta.get("kind") != "train" or meta["task_id"] in forged_per_task:
            return
        base = {"task_id": meta["task_id"], "kind": "train", "num_test": 10, "eval_correct": 1}
        nan = {k: (np.full_like(v, np.nan) if v.dtype.kind == "f" else v) for k, v in tensors.items()}
        for frame in (ref["encode_frame"]("update", fed, agent, header["round"], {**base, "num_train": "many"}),
                      ref["encode_frame"]("update", fed, agent, header["round"], {**base, "num_train": 10**9}, tensors),
                      ref["encode_frame"]("update", fed, agent, header["round"], {**base, "num_train": 1}, nan)):
            attacker.publish(f"agents/{agent}/update", frame)
        forged_per_task[meta["task_id"]] = 3

    fleets: list[MqttFleet] = []
    try:
        run_while_forging(attacker, forge, config, url, out, fleets)
        rows = read_rows(out)
        assert len(forged_per_task) == len(TRAINERS) * config.rounds  # every train task was raced
        for row in rows[:-1]:
            assert set(row.participants) == set(TRAINERS) and not row.dropped, row
            assert row.rejected.get("malformed", 0) + row.rejected.get("non_finite", 0) >= 3 * len(TRAINERS), row
        for agent in TRAINERS:
            assert "stays open" in agent_log(out, agent)  # the NACKs named frames it never sent
            assert "is closed" not in agent_log(out, agent)
    finally:
        attacker.close()
        for fleet in fleets:
            fleet.close()
        stop_agents(procs)


def test_one_forged_refusal_or_status_dated_ten_years_ahead_costs_an_agent_one_round_at_most(mosquitto, tmp_path, ref):
    """Unsigned deployment, the red team's two one-message lockouts. When
    agent-00's first training task goes out, the attacker answers it with a refusal
    ``unsupported_method`` in agent-00's name (it read the task id off the task topic): that
    excluded agent-00 for the rest of the run. When agent-01's first task goes out, the
    attacker replays agent-01's birth as an ``offline`` of a session it never had, dated ten
    years ahead, retained: agent-01's own births were "older" for the rest of the run. Either
    costs at most the round it lands in: both agents train again in every later round."""
    config = prepare(run_config(rounds=3, round_timeout_s=120), len(TRAINERS))
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    procs = [spawn_agent(config, out, url, agent, i) for i, agent in enumerate(TRAINERS)]
    forged: dict[str, str] = {}

    def forge(agent: str, task_frame: bytes) -> None:
        header, _ = ref["decode_frame"](task_frame)
        if header["type"] != "task" or header["meta"].get("kind") != "train" or agent in forged:
            return
        forged[agent] = header["meta"]["task_id"]
        if agent == "agent-00":
            meta = {"task_id": header["meta"]["task_id"], "reason": "unsupported_method", "detail": "no such method"}
            attacker.publish("agents/agent-00/update", ref["encode_frame"]("refusal", fed, agent, header["round"], meta))
            return
        birth, _ = ref["decode_frame"](attacker.frames(f"agents/{agent}/status")[-1])
        meta = {**birth["meta"], "state": "offline", "session": uuid.uuid4().hex}
        frame = ref["encode_frame"]("status", fed, agent, -1, meta)
        head_len = struct.unpack(">I", frame[4:8])[0]
        head = json.loads(frame[8:8 + head_len])
        head["created"] += 10 * 365 * 86_400  # the header's time, as the protocol spells it
        head_bytes = json.dumps(head).encode()
        attacker.publish(f"agents/{agent}/status", frame[:4] + struct.pack(">I", len(head_bytes)) + head_bytes,
                         retain=True)

    fleets: list[MqttFleet] = []
    try:
        run_while_forging(attacker, forge, config, url, out, fleets)
        assert set(forged) == set(TRAINERS)  # both attacks went out in round 0
        rows = read_rows(out)
        assert len(rows) == config.rounds + 1 and rows[-1].final
        assert rows[0].refused.get("unsupported_method") == 1  # the forged refusal cost agent-00 round 0's task
        for row in rows[1:-1]:
            assert set(row.participants) == set(TRAINERS), row
        assert set(rows[-1].per_client) == set(TRAINERS), rows[-1]  # the final evaluation hears both
        assert "announcing itself again" in agent_log(out, "agent-01")  # it answered the foreign status
    finally:
        attacker.client.publish(f"edgepfl/v1/{fed}/agents/agent-01/status", b"", qos=1, retain=True)
        attacker.close()
        for fleet in fleets:
            fleet.close()
        stop_agents(procs)
