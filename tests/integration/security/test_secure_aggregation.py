"""Secure aggregation live (protocol 1.9): a real coordinator and six real agent
processes over Mosquitto, a signed and enrolled fleet, the same federation run in the clear
and secure. Two agents are killed in round 1 after sealing their shares
(``EDGEPFL_FAILPOINT=agent.train_task:2``: the process SIGKILLs itself as its second
training task arrives), so their neighbours' masks with them must be removed from keys the
survivors' shares rebuild. Meanwhile an attacker on the broker who has read PROTOCOL.md,
with no key, answers every ``advertise`` with a roster of its own keys, sends every agent
that gets a secure task an ``unmask`` calling its neighbours dropped, and injects keys in
each agent's name. The secure run ends in the clear run's state bit for bit, the forgeries
changed nothing, and every update that crossed the broker — what the coordinator received —
was one masked vector, never a shared tensor."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.failpoints import ENV as FAILPOINT
from edgepfl.protocol import MessageType, TaskMeta, agent_topic, decode, encode
from edgepfl.protocol.secagg import MASKED_TENSOR, PeerKeys, SecAggMeta, b64

from tests.attack_kit import Attacker, signed_fleet
from tests.fleet_helpers import run_config

pytest.importorskip("torch")

AGENTS = 6
KILLED = (1, 4)
#: the clear run is compared with the secure one's sum: both aggregate with the mean, with no
#: per-update bound (the coordinator's in the clear; none can apply to a masked update). An
#: enrolled fleet in the clear would default to centered_clip (aggregation.rule: auto)
NO_BOUNDS = {"rule": "mean", "max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}
#: the attacker's own X25519 public key (any 32 bytes serve the forgery)
FAKE_KEY = b64(bytes(range(32)))


class Forger:
    """The attacker's loop: reads the coordinator's steps off the broker and forges its own."""

    def __init__(self, url: str, federation: str, ids: list[str]):
        self.attacker, self.federation, self.ids = Attacker(url, federation), federation, ids
        self.forged = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, agent: str, channel: str, meta: SecAggMeta, round: int, sender: str) -> None:
        frame = encode(MessageType.SECAGG, federation=self.federation, sender=sender, round=round, meta=meta)
        self.attacker.publish(f"agents/{agent}/{channel}", frame)
        self.forged += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                topic, payload = self.attacker.seen.get(timeout=0.2)
            except Exception:
                continue
            parts = topic.split("/")
            if len(parts) < 6 or parts[-1] != "task" or not payload:
                continue
            try:
                message = decode(payload)
            except Exception:
                continue  # a chunk of a large task
            agent, round = parts[-2], message.header.round
            others = [a for a in self.ids if a != agent]
            if message.type == MessageType.SECAGG and message.meta_as(SecAggMeta).step == "advertise":
                session = message.meta_as(SecAggMeta).session
                self._send(agent, "task", SecAggMeta(session=session, step="roster", threshold=len(others) // 2 + 1,
                           neighbours=[PeerKeys(agent=a, mask_public=FAKE_KEY, share_public=FAKE_KEY)
                                       for a in others]), round, "coordinator")
                self._send(agent, "update", SecAggMeta(session=session, step="keys", keys=PeerKeys(
                    agent=agent, mask_public=FAKE_KEY, share_public=FAKE_KEY)), round, agent)
            elif message.type == MessageType.TASK and message.meta_as(TaskMeta).secagg is not None:
                secagg = message.meta_as(TaskMeta).secagg
                self._send(agent, "task", SecAggMeta(session=secagg.session, step="unmask",
                           dropped=[s.peer for s in secagg.shares]), round, "coordinator")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.attacker.close()


def federate(secure: bool, url: str, out, monkeypatch, keys):
    coordinator_security, agent_security = keys
    config = prepare(run_config(f"sa{uuid.uuid4().hex[:8]}", rounds=2, min_agents=AGENTS, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, aggregation=NO_BOUNDS,
                                data={"dataset": "digits", "samples_per_client": 120},
                                security=coordinator_security,
                                secure_aggregation={"enabled": secure, "step_timeout_s": 60}), AGENTS)
    ids = agent_ids(AGENTS)
    procs = []
    for index, agent_id in enumerate(ids):
        if index in KILLED:
            monkeypatch.setenv(FAILPOINT, "agent.train_task:2")
        else:
            monkeypatch.delenv(FAILPOINT, raising=False)
        procs.append(spawn_agent(config, out, url, agent_id, index, security=agent_security[agent_id]))
    monkeypatch.delenv(FAILPOINT, raising=False)
    forger = Forger(url, config.federation, ids) if secure else None
    fleet = MqttFleet(config.federation, config.broker, url=url, security=coordinator_security)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
    finally:
        fleet.close()
        stop_agents(procs)
        if forger is not None:
            forger.close()
    return config, coordinator, rows, [procs[i].returncode for i in KILLED], forger


def test_a_secure_federation_with_a_third_killed_and_an_attacker_on_the_broker_ends_in_the_clear_runs_state(
        mosquitto, broker_capture, tmp_path, monkeypatch):
    keys = signed_fleet(tmp_path / "keys", agent_ids(AGENTS))
    _, plain, plain_rows, plain_killed, _ = federate(False, mosquitto.url, tmp_path / "plain", monkeypatch, keys)
    broker_capture.clear()
    config, secure, secure_rows, secure_killed, forger = federate(True, mosquitto.url, tmp_path / "secure",
                                                                  monkeypatch, keys)
    assert plain_killed == secure_killed == [-9, -9]  # SIGKILL at the failpoint, in both runs

    ids = agent_ids(AGENTS)
    survivors = sorted(a for i, a in enumerate(ids) if i not in KILLED)
    for rows in (plain_rows, secure_rows):
        trained = [r for r in rows if not r.final]
        assert [sorted(r.participants) for r in trained] == [ids, survivors]
        assert not any(r.aborted for r in trained)
    x, y = plain.server_state().global_tensors, secure.server_state().global_tensors
    assert set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)
    assert [r.accuracy for r in secure_rows] == [r.accuracy for r in plain_rows]

    # the forgeries: keys in an agent's name rejected unsigned; rosters and unmasks dropped by the agents
    assert forger is not None and forger.forged >= 3 * AGENTS
    assert sum(r.rejected.get("unsigned", 0) for r in secure_rows) >= AGENTS
    for agent_id in ids:
        log = (tmp_path / "secure" / "agents" / f"{agent_id}.log").read_text()
        assert "dropped secagg" in log and "unsigned" in log, log[-2000:]

    captured = broker_capture.snapshot()
    fed = config.federation
    for agent_id in ids:
        frames = [decode(p) for t, p in captured if t == agent_topic(fed, agent_id, "update")]
        own = [m for m in frames if m.header.signer is not None]  # the attacker's frames on it are unsigned
        updates = [m for m in own if m.type == MessageType.UPDATE and m.meta.kind == "train"]
        assert len(updates) == (1 if agent_id not in survivors else 2)
        for update in updates:  # one vector, uniform in the ring: no top bits of a small integer
            assert set(update.tensors) == {MASKED_TENSOR}
            top = update.tensors[MASKED_TENSOR].view("<u8") >> np.uint64(48)
            assert np.mean((top == 0) | (top == 0xFFFF)) < 0.01
        steps = [(m.header.round, m.meta_as(SecAggMeta).step) for m in own if m.type == MessageType.SECAGG]
        expected = [(0, "keys"), (0, "shares"), (0, "reveal"), (1, "keys"), (1, "shares")]
        assert steps == (expected + [(1, "reveal")] if agent_id in survivors else expected)
