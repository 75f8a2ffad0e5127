"""The fleet goes on: dead agents, a restarted coordinator, hostile payloads.

Real Mosquitto, real agent processes; the coordinator runs in this process (or as
its own process where it is the one being killed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import yaml

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import (
    AgentChannel,
    MessageType,
    NackMeta,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    agent_topic,
    decode,
    encode,
)

from tests.fleet_helpers import RunningFleet, checkpoint_tensors, read_rows, run_config, run_in_thread, wait_until


def _coordinator(config, url, out, shape):
    fleet = MqttFleet(config.federation, config.broker, url=url)
    return Coordinator(config, fleet, out, progress=False, **shape), fleet


def test_agent_killed_mid_round_round_closes_on_quorum_and_agent_resumes_its_state(mosquitto, broker_capture, tmp_path):
    config = run_config(rounds=4, quorum=0.5, round_timeout_s=20, method={"name": "fedper"},
                        data={"samples_per_client": 400})
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 4) as fleet:
        coord, mfleet = _coordinator(fleet.config, mosquitto.url, out, fleet.shape())
        thread, box = run_in_thread(coord.run)
        victim = "agent-03"
        task_topic = agent_topic(fleet.config.federation, victim, AgentChannel.TASK)
        # Kill the victim as soon as its round-1 task is on the wire: it is evaluating/training.
        wait_until(lambda: any(t == task_topic and decode(p).header.round == 1 for t, p in broker_capture.snapshot()),
                   timeout=240, what="round-1 task for the victim")
        fleet.procs[victim].send_signal(signal.SIGKILL)
        fleet.procs[victim].wait()
        saved = json.loads(next((out / "agents" / victim).glob("personal-*.json")).read_text())
        assert saved["round"] == 0  # its personal state as of the last completed task

        wait_until(lambda: len(read_rows(out)) >= 2, timeout=120, what="round 1 closed")
        fleet.start_agent(3)  # same id, same state directory
        thread.join(timeout=300)
        mfleet.close()
        assert "error" not in box, box.get("error")

    rows = read_rows(out)
    round1 = rows[1]
    assert round1.round == 1 and victim in round1.dropped and victim not in round1.participants
    assert len(round1.participants) == 3 and not round1.aborted
    assert "restored personal state" in fleet.log(victim)
    later = [r for r in rows[2:] if victim in r.participants or victim in r.per_client]
    assert later, "the restarted agent never took part again"
    assert json.loads(next((out / "agents" / victim).glob("personal-*.json")).read_text())["round"] >= 2


def test_coordinator_killed_after_round_k_resumes_at_k_plus_1_with_same_global_weights(mosquitto, broker_capture, tmp_path):
    config = run_config(rounds=4, method={"name": "fedavg"})
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 3) as fleet:
        cfg_path = tmp_path / "coordinator.yaml"
        data = fleet.config.model_dump(mode="json")
        data["broker"]["url"] = mosquitto.url
        cfg_path.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "edgepfl.cli", "coordinator", "--config", str(cfg_path), "--out", str(out)]
        log1 = open(tmp_path / "coordinator1.log", "wb")
        first = subprocess.Popen(cmd, stdout=log1, stderr=subprocess.STDOUT, env=dict(os.environ))
        state_json = out / "checkpoint" / "state.json"
        wait_until(lambda: state_json.exists() and json.loads(state_json.read_text())["round"] >= 1, timeout=300,
                   interval=0.02, what="checkpoint of round 1")
        first.send_signal(signal.SIGKILL)
        first.wait()
        k = json.loads(state_json.read_text())["round"]
        saved = checkpoint_tensors(out / "checkpoint")
        broker_capture.clear()

        log2 = open(tmp_path / "coordinator2.log", "wb")
        second = subprocess.run(cmd, stdout=log2, stderr=subprocess.STDOUT, timeout=400)
        assert second.returncode == 0, (tmp_path / "coordinator2.log").read_text()[-3000:]

    assert f"resuming from checkpoint after round {k}" in (tmp_path / "coordinator2.log").read_text()
    tasks = [decode(p) for t, p in broker_capture.snapshot() if t.endswith("/task")]
    first_round = min(m.header.round for m in tasks)
    assert first_round == k + 1
    for task in (m for m in tasks if m.header.round == k + 1):
        for key, value in task.tensors.items():
            np.testing.assert_array_equal(value, saved[f"global::{key}"])
    rows = [r for r in read_rows(out) if not r.final]
    assert [r.round for r in rows] == list(range(4))  # no round lost, none repeated


class Mallory:
    """A registered agent that answers its tasks with every kind of bad update.

    Round 0: frames that are rejected (unreadable, stale, oversized, an unknown agent's, a
    wrong shape): on this unsigned deployment none of them closes its task (PROTOCOL §7), so
    the valid update after them is accepted and its second copy is a `duplicate`. Every
    later task: a truncated update, a non-finite one and one of another dtype, none of which
    answers the task: mallory is dropped at the deadline, then sits out rounds (§10)."""

    def __init__(self, url: str, federation: str, agent_id: str = "mallory"):
        self.federation, self.agent_id = federation, agent_id
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-{agent_id}-{federation}")
        self.client.on_message = self._on_message
        self.client.connect(host, int(port))
        self.client.subscribe(agent_topic(federation, agent_id, AgentChannel.TASK), qos=1)
        self.client.loop_start()
        status = StatusMeta(state="online", tier="trainer", num_train=100, num_test=20)
        self.publish(agent_topic(federation, agent_id, AgentChannel.STATUS),
                     encode(MessageType.STATUS, federation=federation, sender=agent_id, round=-1, meta=status),
                     retain=True)
        self.sent: list[str] = []
        self.nacks: list[NackMeta] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(10)

    def _update(self, task, tensors, round=None, message_id=None, sender=None) -> bytes:
        meta = UpdateMeta(task_id=task.meta.task_id, kind=task.meta.kind, num_train=100, num_test=20, eval_correct=2)
        return encode(MessageType.UPDATE, federation=self.federation, sender=sender or self.agent_id,
                      round=task.header.round if round is None else round, meta=meta, tensors=tensors,
                      message_id=message_id)

    def _on_message(self, client, userdata, msg) -> None:
        message = decode(msg.payload)
        if message.type == MessageType.NACK:
            self.nacks.append(message.meta_as(NackMeta))
            return
        # Publishing with wait_for_publish from paho's network thread would deadlock.
        threading.Thread(target=self._answer, args=(message,), daemon=True).start()

    def _answer(self, task) -> None:
        if task.meta.kind != "train":
            return
        topic = agent_topic(self.federation, self.agent_id, AgentChannel.UPDATE)
        good = {k: v for k, v in task.tensors.items()}
        key = next(k for k, v in good.items() if v.dtype == np.float32 and v.ndim == 2)
        if task.header.round == 0:
            valid = self._update(task, good)
            frames = [
                ("malformed", b"\x00garbage\xff" * 10),
                ("stale", self._update(task, good, round=task.header.round + 5)),
                ("oversized", b"EPF1" + os.urandom(5 * 2**20)),
                ("wrong_shape", self._update(task, dict(good, **{key: good[key][:, :-1]}))),
                ("accepted", valid),  # the task was still open: no rejection closed it
                ("duplicate", valid),
            ]
            ghost = agent_topic(self.federation, "ghost", AgentChannel.UPDATE)
            self.publish(ghost, self._update(task, good, sender="ghost"))
        else:  # a readable header with a truncated body, NaN tensors, another dtype
            frames = [("malformed", self._update(task, good)[:-100]),
                      ("non_finite", self._update(task, dict(good, **{key: np.full_like(good[key], np.nan)}))),
                      ("wrong_shape", self._update(task, dict(good, **{key: good[key].astype(np.float64)})))]
        for _, frame in frames:
            self.publish(topic, frame)
        self.sent += [reason for reason, _ in frames]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def test_malformed_payloads_are_rejected_with_a_reason_and_the_round_completes(mosquitto, tmp_path, caplog):
    timeout_s = 8  # rounds 1 and 3 run to their deadline: mallory's rejected frames answer nothing
    config = run_config(rounds=4, min_agents=3, broker={"max_payload_bytes": 4 * 2**20}, round_timeout_s=timeout_s)
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 2) as fleet:
        cfg = fleet.config.model_copy(update={"min_agents": 3})
        mallory = Mallory(mosquitto.url, cfg.federation)
        try:
            coord, mfleet = _coordinator(cfg, mosquitto.url, out, fleet.shape())
            with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
                rows = coord.run()
            mfleet.close()
        finally:
            mallory.close()

    rows = [r for r in rows if not r.final]
    rejected = rows[0].rejected
    assert rejected.get("malformed") == 1
    assert rejected.get("stale") == 1
    assert rejected.get("oversized") == 1
    assert rejected.get("wrong_shape") == 1
    assert rejected.get("duplicate") == 1
    assert rejected.get("unknown_agent") == 1
    for r in (1, 3):
        assert rows[r].rejected == {"malformed": 1, "non_finite": 1, "wrong_shape": 1}, rows[r]
    # round 0 took mallory's valid update, sent after four rejected frames in its name
    assert rows[0].participants == ["agent-00", "agent-01", "mallory"] and rows[0].dropped == []
    # later rounds went on with the honest agents; mallory's rejected frames answered nothing, so
    # after missing round 1 it sat out round 2 and was asked again in round 3 (PROTOCOL §10)
    for row in rows[1:]:
        assert row.participants == ["agent-00", "agent-01"], row
    assert [row.dropped for row in rows[1:]] == [["mallory"], [], ["mallory"]]
    assert "mallory" not in rows[2].sampled
    # mallory was told, naming its frames (a 1.2 agent: its status announced the default version)
    reasons = [n.reason for n in mallory.nacks]
    assert {"wrong_shape", "non_finite", "stale", "malformed"} <= set(reasons) and "duplicate" not in reasons


def test_broker_restart_mid_federation_agents_and_coordinator_reconnect(tmp_path):
    from edgepfl.testing import MosquittoBroker

    from tests.conftest import require_mosquitto

    require_mosquitto()
    broker = MosquittoBroker()
    url = broker.start()
    port = broker.port
    config = run_config(rounds=4, round_timeout_s=10, quorum=0.5)
    out = tmp_path / "run"
    try:
        with RunningFleet(config, out, url, 2) as fleet:
            coord, mfleet = _coordinator(fleet.config, url, out, fleet.shape())
            thread, box = run_in_thread(coord.run)
            wait_until(lambda: len(read_rows(out)) >= 1, timeout=240, what="round 0 done")
            broker.stop()  # every connection drops, retained presence is gone (no persistence)
            time.sleep(2)
            broker = MosquittoBroker(port=port)
            broker.start()
            thread.join(timeout=300)
            mfleet.close()
            assert "error" not in box, box.get("error")
            logs = [fleet.log(a) for a in fleet.ids]
    finally:
        broker.stop()

    rows = read_rows(out)
    assert [r.round for r in rows] == [0, 1, 2, 3, 4]
    # after the reconnect the agents re-announced themselves and re-subscribed: later rounds have both
    assert rows[-2].participants == ["agent-00", "agent-01"] and not rows[-2].aborted
    assert all("reconnected" in text for text in logs)


def test_transport_started_before_the_broker_connects_once_it_appears():
    """An agent booted before its broker (a Pi after a power cut) keeps retrying with backoff."""
    from edgepfl.broker import free_port
    from edgepfl.protocol import AgentChannel, agent_topic
    from edgepfl.protocol.transport import MqttTransport
    from edgepfl.testing import MosquittoBroker

    from tests.conftest import require_mosquitto

    require_mosquitto()
    port = free_port(restartable=True)  # a broker starts on it later
    transport = MqttTransport(f"mqtt://127.0.0.1:{port}", client_id="early-bird", federation="early",
                              sender="bird", subscriptions=[agent_topic("early", "bird", AgentChannel.TASK)])
    thread, box = run_in_thread(lambda: transport.start(timeout=60))
    time.sleep(2)
    assert not transport.connected.is_set()
    broker = MosquittoBroker(port=port)
    broker.start()
    try:
        thread.join(timeout=60)
        assert "error" not in box, box.get("error")
        assert transport.connected.is_set() and transport.connect_count == 1
    finally:
        transport.stop()
        broker.stop()


def test_a_task_lost_with_a_broker_restart_is_sent_again_when_its_agent_reconnects(tmp_path):
    """PROTOCOL.md §10: a federation whose coordinator the agents know (their births carry
    `connection` 1) loses its broker: it crashes and comes back with its retained statuses
    saved but no session. The coordinator and one agent reconnect (connection 2); a third
    agent joins and round 0 opens while the victim is still away, so its task is lost. The
    victim's birth on its connection 2 brings the same task again, once; the round closes
    with every answer, no rejection and no copy to anyone else, instead of waiting out the
    victim's deadline (15 min here: the test would time out first)."""
    from edgepfl.broker import free_port
    from edgepfl.testing import MosquittoBroker, TrafficCapture

    from tests.conftest import require_mosquitto

    require_mosquitto()
    port, store = free_port(), tmp_path / "mosquitto-store"
    store.mkdir()
    # retained births survive the crash (saved every second); an agent's session queue does not
    keep = f"persistence true\npersistence_location {store}/\nautosave_interval 1\n"
    config = run_config(rounds=1, round_timeout_s=900, wait_for_agents_s=600,
                        model={"arch": "mlp", "feature_dim": 16}, data={"samples_per_client": 100})
    out = tmp_path / "run"
    broker = MosquittoBroker(port, extra_config=keep)
    url = broker.start()
    capture = None
    fleet = RunningFleet(config, out, url, 3)
    fed, victim = fleet.config.federation, "agent-01"
    status_of = {a: agent_topic(fed, a, AgentChannel.STATUS) for a in fleet.ids}

    def numbered(agent: str, at_least: int) -> bool:
        return any(t == status_of[agent] and p and (decode(p).meta_as(StatusMeta).connection or 0) >= at_least
                   for t, p in capture.snapshot())
    try:
        capture = TrafficCapture(url, f"edgepfl/v1/{fed}/agents/+/+").start()
        fleet.start_agent(0), fleet.start_agent(1)
        coord, mfleet = _coordinator(fleet.config, url, out, fleet.shape())
        thread, box = run_in_thread(coord.run)  # waits for its third agent
        wait_until(lambda: numbered("agent-00", 1) and numbered(victim, 1), 240, what="births on connection 1")
        seen = time.time()
        fleet.procs[victim].send_signal(signal.SIGSTOP)  # it cannot see the crash, nor resubscribe
        saved = store / "mosquitto.db"
        wait_until(lambda: saved.exists() and saved.stat().st_mtime > seen, 60, what="the births saved")
        capture.stop()
        os.kill(broker.pid, signal.SIGKILL)  # a crash: no wills published, the births stay "online"
        broker.stop()
        broker = MosquittoBroker(port, extra_config=keep)
        broker.start()
        capture = TrafficCapture(url, f"edgepfl/v1/{fed}/agents/+/+").start()
        wait_until(lambda: numbered("agent-00", 2), 240, what="agent-00 back on connection 2")
        fleet.start_agent(2)  # round 0 opens with the victim still away
        victim_task = agent_topic(fed, victim, AgentChannel.TASK)
        wait_until(lambda: any(t == victim_task and p and decode(p).type == MessageType.TASK
                               for t, p in capture.snapshot()), 240,
                   what="round 0's task to the stopped agent, into the void")
        fleet.procs[victim].send_signal(signal.SIGCONT)  # it reconnects: a birth on connection 2
        thread.join(timeout=600)
        mfleet.close()
        assert not thread.is_alive() and "error" not in box, box.get("error")
        traffic = capture.snapshot()
    finally:
        if capture is not None:
            capture.stop()
        fleet.__exit__()
        broker.stop()
    round0 = read_rows(out)[0]
    assert sorted(round0.participants) == fleet.ids and not round0.dropped, round0
    assert round0.rejected == {}, round0.rejected  # no copy crossed a delivered task: no duplicate
    tasks = {a: [decode(p) for t, p in traffic if t == agent_topic(fed, a, AgentChannel.TASK) and p] for a in fleet.ids}
    trained = {a: [m.meta_as(TaskMeta) for m in frames if m.type == MessageType.TASK and m.header.round == 0
                   and m.meta_as(TaskMeta).kind == "train"] for a, frames in tasks.items()}
    # a coordinator that re-reads the retained births after its reconnect finds nothing stale to NACK
    assert not [m for frames in tasks.values() for m in frames if m.type == MessageType.NACK]
    assert len(trained[victim]) == 2 and len({m.task_id for m in trained[victim]}) == 1  # the same task again
    assert [len(trained[a]) for a in ("agent-00", "agent-02")] == [1, 1]  # nobody else got a copy
