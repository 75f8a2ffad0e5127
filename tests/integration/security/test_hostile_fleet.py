"""A signed federation under attack, end to end.

A live coordinator and real agent processes (two trainers, one head agent), every one
with its own Ed25519 key generated in a tmp dir, on the test Mosquitto. The attacker is
a plain paho client on the anonymous broker that knows only docs/PROTOCOL.md: it builds
its frames with the reference codec printed there (exec'd from the doc) and replays
what it records off the wire. Every attack of the threat model (docs/SECURITY.md) is made while the federation runs,
and the run must complete with each attack refused for its counted reason.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, ReleaseMeta, decode, encode
from edgepfl.protocol.signing import generate_keypair, load_signer

from tests.attack_kit import Attacker, signed_fleet
from tests.fleet_helpers import read_rows, run_config, run_in_thread, wait_until

TRAINERS = ("agent-00", "agent-01")
HEAD = "device-00"
SYBILS = [f"sybil-{i:02d}" for i in range(20)]


def agent_log(out, agent: str) -> str:
    path = out / "agents" / f"{agent}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_signed_federation_completes_under_attack_and_refuses_every_forgery(mosquitto, tmp_path, ref):
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", (*TRAINERS, HEAD))
    # compression on: every forgery is refused as before, the honest updates travel compressed
    config = run_config(rounds=3, round_timeout_s=40, method={"name": "fedper"}, security=coordinator_security,
                        compression={"uplink": "q8"})
    config = prepare(config, len(TRAINERS), head_agents=1)  # min_agents = 2, release at the end
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    procs = [spawn_agent(config, out, url, agent, i, security=agent_security[agent])
             for i, agent in enumerate(TRAINERS)]
    procs.append(spawn_agent(config, out, url, HEAD, len(TRAINERS), tier="head", security=agent_security[HEAD]))
    coordinator = fleet = None
    try:
        wait_until(lambda: all(attacker.frames(f"agents/{a}/status") for a in TRAINERS), 180, what="agents' births")

        # --- before the coordinator starts: forged retained offlines and 20 Sybils
        for agent in TRAINERS:
            forged = ref["encode_frame"]("status", fed, agent, -1, {"state": "offline", "session": uuid.uuid4().hex})
            attacker.publish(f"agents/{agent}/status", forged, retain=True)
        mallory_key = tmp_path / "mallory.key"
        generate_keypair(mallory_key, tmp_path / "mallory.pub")
        mallory = load_signer(mallory_key)
        for i, sybil in enumerate(SYBILS):
            meta = {"state": "online", "tier": "trainer", "num_train": 10**6, "num_test": 100}
            if i % 2:  # half of them signed, by a key nobody enrolled
                from edgepfl.protocol import StatusMeta

                frame = encode(MessageType.STATUS, federation=fed, sender=sybil, round=-1,
                               meta=StatusMeta(**meta), signer=mallory)
            else:
                frame = ref["encode_frame"]("status", fed, sybil, -1, meta)
            attacker.publish(f"agents/{sybil}/status", frame, retain=True)
        time.sleep(1.0)

        fleet = MqttFleet(fed, config.broker, url=url, security=coordinator_security)
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        thread, box = run_in_thread(coordinator.run)

        # --- round 0: the attacker races agent-00's answer, replays its task elsewhere, forges tasks
        task_frame = wait_until(lambda: next(iter(attacker.frames("agents/agent-00/task")), None), 240,
                                what="agent-00's first task")
        header = decode(task_frame).header
        task_id = header.meta["task_id"]
        forged_answer = ref["encode_frame"](
            "update", fed, "agent-00", header.round,
            {"task_id": task_id, "kind": header.meta["kind"], "num_train": 10**6, "num_test": 10, "eval_correct": 10})
        attacker.publish("agents/agent-00/update", forged_answer)
        attacker.publish("agents/agent-01/task", task_frame)  # signed, but for agent-00
        garbage_run = dict(header.meta["run"], train=dict(header.meta["run"]["train"], epochs=100000),
                           method={"name": "fedrep", "options": {}})
        attacker.publish("agents/agent-00/task", ref["encode_frame"](
            "task", fed, "coordinator", header.round,
            {"task_id": uuid.uuid4().hex, "kind": "train", "run": garbage_run, "seed": 1, "deadline_s": 60}))
        ghost = {"tier": "head", "release_id": "x", "head": "lr", "num_test": 1000, "eval_correct": 37}
        attacker.publish("agents/ghost/metrics", ref["encode_frame"]("metrics", fed, "ghost", 0, ghost))
        for agent in TRAINERS:  # and, mid-run, forged retained offlines again
            forged = ref["encode_frame"]("status", fed, agent, -1, {"state": "offline", "session": uuid.uuid4().hex})
            attacker.publish(f"agents/{agent}/status", forged, retain=True)

        # the real answer arrives; the attacker replays it
        real = wait_until(lambda: [f for f in attacker.frames("agents/agent-00/update") if f != forged_answer],
                          240, what="agent-00's real update")[0]
        wait_until(lambda: len(read_rows(out)) >= 1, 240, what="round 0 closed")
        attacker.publish("agents/agent-00/update", real)

        thread.join(timeout=600)
        assert not thread.is_alive(), "the coordinator did not finish"
        assert "error" not in box, box.get("error")
        release_frame = wait_until(lambda: next(iter(attacker.frames("release")), None), 60, what="the release")
        wait_until(lambda: "release" in agent_log(out, HEAD) and (out / "agents" / HEAD / "release.json").exists(),
                   120, what="the head agent installing the release")

        # --- the run completed, with only the enrolled agents, and every forgery counted
        rows = read_rows(out)
        assert len(rows) == config.rounds + 1 and rows[-1].final
        for row in rows[:-1]:
            assert set(row.sampled) == set(TRAINERS) and set(row.participants) == set(TRAINERS)
        assert sum(row.update_bytes.get("q8", 0) for row in rows) > 0  # the honest updates came compressed
        assert set(coordinator.registry.agents) == {*TRAINERS, HEAD}  # no Sybil ever entered
        rejected = coordinator.counters.rejected
        assert rejected["not_enrolled"] >= len(SYBILS) // 2
        # unsigned Sybils (10) + the forged answer + ghost metrics + the mid-run forged offlines (2)
        assert rejected["unsigned"] >= len(SYBILS) // 2 + 1 + 1 + 2
        assert rows[0].rejected.get("unsigned", 0) >= 1  # the forged answer, in its round's counters
        assert rejected["duplicate"] + rejected["stale"] >= 1  # the replayed update
        assert "ghost" not in coordinator.head_reports
        report = coordinator.head_reports[HEAD]
        assert report.accuracy == pytest.approx(report.correct / report.total)
        assert rows[0].per_client["agent-00"] is not None and rows[0].per_client["agent-00"] <= 1.0

        # --- the agents refused what was not for them, and kept their personal state
        wait_until(lambda: "wrong_recipient" in agent_log(out, "agent-01"), 30, what="agent-01 refusing")
        log0 = agent_log(out, "agent-00")
        assert "dropped task" in log0 and "unsigned" in log0
        assert "fedrep" not in log0  # the forged run was never built
        personal = sorted(p.name for p in (out / "agents" / "agent-00").glob("personal-*.json"))
        assert len(personal) == 1  # fedper's only: nothing of the forged fedrep run
        saved = json.loads((out / "agents" / "agent-00" / personal[0]).read_text())
        assert saved["round"] == config.rounds - 1

        # --- releases: forged, rolled back, expired: all refused, the installed one kept
        installed = json.loads((out / "agents" / HEAD / "release.json").read_text())
        genuine = decode(release_frame)
        gmeta = genuine.meta_as(ReleaseMeta)
        assert installed["sequence"] == gmeta.sequence
        artifact = {"artifact": genuine.tensors["artifact"]}
        fake = ref["encode_frame"]("release", fed, "coordinator", genuine.header.round,
                                   {**genuine.header.meta, "sequence": gmeta.sequence + 10**6}, artifact)
        # Retained, and on the head agent's task topic too: since 1.4 a head agent whose release
        # the coordinator's presence names as current does not take the retained copies at all.
        attacker.publish("release", fake, retain=True)
        attacker.publish(f"agents/{HEAD}/task", fake)
        coordinator_signer = load_signer(coordinator_security.signing_key)

        def signed_release(**changes) -> bytes:  # as the coordinator signed it once (a recorded old release)
            return encode(MessageType.RELEASE, federation=fed, sender="coordinator", round=genuine.header.round,
                          meta=gmeta.model_copy(update=changes), tensors=artifact, signer=coordinator_signer)

        attacker.publish(f"agents/{HEAD}/task", signed_release(sequence=gmeta.sequence - 1))
        attacker.publish(f"agents/{HEAD}/task", signed_release(sequence=gmeta.sequence + 1, expires=time.time() - 3600))
        head_log = lambda: agent_log(out, HEAD)  # noqa: E731
        wait_until(lambda: "rollback" in head_log() and "expired" in head_log(), 60, what="head refusals")
        assert "dropped release" in head_log() and "unsigned" in head_log()
        assert procs[-1].poll() is None, "the head agent died"
        after = json.loads((out / "agents" / HEAD / "release.json").read_text())
        assert (after["sequence"], after["encoder_sha256"]) == (installed["sequence"], installed["encoder_sha256"])

        # a restart with the forged release still retained: the installed release re-verified, and
        # the coordinator's last presence naming it, the forged copy is not even downloaded
        procs[-1].terminate()
        procs[-1].wait(timeout=30)
        before = len(head_log())
        procs[-1] = spawn_agent(config, out, url, HEAD, len(TRAINERS), tier="head", security=agent_security[HEAD])
        wait_until(lambda: "restored release" in head_log()[before:] and "nothing to download" in head_log()[before:],
                   120, what="the restarted head agent")
        assert procs[-1].poll() is None
        assert json.loads((out / "agents" / HEAD / "release.json").read_text())["sequence"] == installed["sequence"]
    finally:
        attacker.client.publish(f"edgepfl/v1/{fed}/release", b"", qos=1, retain=True)
        for sybil in SYBILS:
            attacker.client.publish(f"edgepfl/v1/{fed}/agents/{sybil}/status", b"", qos=1, retain=True)
        attacker.close()
        if fleet is not None:
            fleet.close()
        stop_agents(procs)


def test_an_unsigned_retained_release_does_not_crash_loop_a_head_agent_without_one_installed(mosquitto, tmp_path, ref):
    """A fresh head agent pinned to a coordinator key, with only a forged release retained."""
    _, agent_security = signed_fleet(tmp_path / "keys", (*TRAINERS, HEAD))
    config = prepare(run_config(), 1, head_agents=1)
    fed, out = config.federation, tmp_path / "run"
    attacker = Attacker(mosquitto.url, fed)
    from tests.wire_samples import sample_manifest

    manifest = sample_manifest().model_dump(mode="json")
    fake = ref["encode_frame"]("release", fed, "coordinator", 0, {"release_id": "evil", "manifest": manifest,
                                                                   "sha256": "0" * 64, "size_bytes": 3},
                               {"artifact": np.zeros(3, np.uint8)})
    attacker.publish("release", fake, retain=True)
    proc = spawn_agent(config, out, mosquitto.url, HEAD, 1, tier="head", security=agent_security[HEAD])
    try:
        wait_until(lambda: "dropped release" in agent_log(out, HEAD), 120, what="the forged release refused")
        assert "unsigned" in agent_log(out, HEAD)
        time.sleep(2)
        assert proc.poll() is None, agent_log(out, HEAD)
        assert not (out / "agents" / HEAD / "release.json").exists()
    finally:
        attacker.client.publish(f"edgepfl/v1/{fed}/release", b"", qos=1, retain=True)
        attacker.close()
        stop_agents([proc])


def run_beside_the_attacker(config, out, url: str, attacker: Attacker, announce, coordinator_security,
                            agent_security, running: list | None = None) -> None:
    """Start the honest trainers, let the attacker ``announce`` agent-02, run the coordinator
    to its end and take the attacker's retained status away again, whatever happened.
    ``running`` is given the coordinator before it runs."""
    fed = config.federation
    procs = [spawn_agent(config, out, url, agent, i, security=agent_security[agent]) for i, agent in enumerate(TRAINERS)]
    fleet = None
    try:
        announce()
        wait_until(lambda: all(attacker.frames(f"agents/{a}/status") for a in TRAINERS), 180, what="agents' births")
        fleet = MqttFleet(fed, config.broker, url=url, security=coordinator_security)
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        if running is not None:
            running.append(coordinator)
        thread, box = run_in_thread(coordinator.run)
        thread.join(timeout=900)
        assert not thread.is_alive() and "error" not in box, box.get("error")
    finally:
        attacker.client.publish(f"edgepfl/v1/{fed}/agents/agent-02/status", b"", qos=1, retain=True)
        attacker.close()
        if fleet is not None:
            fleet.close()
        stop_agents(procs)


def test_an_enrolled_device_that_announces_itself_and_never_answers_costs_a_deadline_ever_more_rarely(
        mosquitto, tmp_path):
    """The red team's cheap denial of service on a provisioned fleet: with one
    enrolled device's key, a plain client keeps announcing that device — a signed birth
    before the run, a signed status again on every task it is sent — and never answers.
    Every round waited its full deadline (8 rounds: 305 s instead of 13 s). Now its k-th
    miss in a row benches it for 2^(k-1) rounds: it is asked again (not shut out), ever
    more rarely, and the honest agents' rounds go on."""
    from edgepfl.protocol import Capabilities, StatusMeta

    devices = (*TRAINERS, "agent-02")  # agent-02's key is the attacker's
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", devices)
    config = prepare(run_config(rounds=4, round_timeout_s=10, security=coordinator_security,
                                model={"arch": "mlp", "feature_dim": 16}, data={"dataset": "digits"}), len(TRAINERS))
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    key = load_signer(agent_security["agent-02"].signing_key)
    session = uuid.uuid4().hex

    def announce() -> None:
        # with capabilities, as a device that read the presence declares them (one that never does
        # is first asked CAPABILITIES_WAIT_S after its birth)
        meta = StatusMeta(state="online", tier="trainer", num_train=100, num_test=20, session=session,
                          capabilities=Capabilities())
        attacker.publish("agents/agent-02/status",
                         encode(MessageType.STATUS, federation=fed, sender="agent-02", round=-1, meta=meta, signer=key),
                         retain=True)

    def on_message(client, userdata, msg) -> None:
        attacker.seen.put((msg.topic, bytes(msg.payload)))
        if msg.topic.endswith("/agents/agent-02/task") and msg.payload:
            threading.Thread(target=announce, daemon=True).start()  # "still here", and no answer

    attacker.client.on_message = on_message
    run_beside_the_attacker(config, out, url, attacker, announce, coordinator_security, agent_security)
    training = [row for row in read_rows(out) if not row.final]
    assert len(training) == config.rounds
    asked = [row.round for row in training if "agent-02" in row.sampled]
    # one miss may be excused (it announced itself during the round), then it is asked in rounds
    # k, k+2, k+5, …: of 4 rounds, 2 or 3 wait for it (every one did before), and it is asked again
    assert 2 <= len(asked) <= 3, asked
    assert all("agent-02" not in row.participants for row in training)
    # the honest devices' rounds go on (one slow to its first task on a busy box sits a round out too)
    assert all(set(row.participants) & set(TRAINERS) for row in training), [row.participants for row in training]


def test_an_enrolled_device_that_refuses_each_task_once_the_others_answered_costs_a_wait_ever_more_rarely(
        mosquitto, tmp_path):
    """The red team's bypass of the bench: with one enrolled device's key, a client answers
    every task with a signed refusal, sent late — once the round, the honest devices' updates
    in, has waited for it alone past its patience of a quarter of its 60 s deadline — so the
    round waits for it and gets nothing. A refusal used to reset the count: 8 of 9
    rounds waited for it, the final evaluation too. Now the round waiting for it alone is a
    miss like a timeout: it is asked in rounds 0, 2, 5 (2^(k-1) rounds out after its k-th),
    and the final evaluation, after three misses in a row, leaves it out."""
    from edgepfl.protocol import Capabilities, RefusalMeta, StatusMeta

    devices = (*TRAINERS, "agent-02")  # agent-02's key is the attacker's
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", devices)
    # a deadline the honest devices never come near on a loaded box: the attacker's refusal is
    # always the last answer, so which rounds ask it is the bench's doing alone
    config = prepare(run_config(rounds=6, round_timeout_s=60, security=coordinator_security,
                                model={"arch": "mlp", "feature_dim": 16}, data={"dataset": "digits"}), len(devices))
    fed, out, url = config.federation, tmp_path / "run", mosquitto.url
    attacker = Attacker(url, fed)
    key = load_signer(agent_security["agent-02"].signing_key)
    refused_at: list[int] = []
    running: list[Coordinator] = []

    def waited_past_patience(r: int) -> bool:  # the round's own reckoning (RoundTasks.held_up_by's)
        if not running:
            return False
        tasks, now = running[0].inbox._tasks, running[0].clock.now()
        return (tasks.round == r and tasks.waiting == {"agent-02"} and tasks._alone_since is not None
                and now - tasks._alone_since >= tasks.patience_s)

    def refuse_late(task_frame: bytes) -> None:
        task = decode(task_frame)
        r = task.header.round
        topics = [f"{attacker.base}/agents/{a}/update" for a in TRAINERS]

        def others_answered() -> bool:  # the honest updates of this round went by on the broker
            return all(any(t == topic and p and decode(p).header.round == r for t, p in list(attacker.log))
                       for topic in topics)
        try:
            wait_until(lambda: attacker.drain() is not None and others_answered(), 50, what=f"round {r}'s updates")
        except TimeoutError:
            pass  # refused anyway: the assertions below say what it cost
        try:  # the round waits for it alone, past its patience (a quarter of the deadline, 15 s)
            wait_until(lambda: waited_past_patience(r), 50, interval=0.1, what=f"round {r} waiting past its patience")
        except TimeoutError:
            pass  # refused anyway: the assertions below say what it cost
        refusal = encode(MessageType.REFUSAL, federation=fed, sender="agent-02", round=r, signer=key,
                         meta=RefusalMeta(task_id=task.meta.task_id, reason="busy", detail="not now"))
        attacker.publish("agents/agent-02/update", refusal)
        refused_at.append(r)

    def on_message(client, userdata, msg) -> None:
        attacker.seen.put((msg.topic, bytes(msg.payload)))
        if msg.topic.endswith("/agents/agent-02/task") and msg.payload:
            threading.Thread(target=refuse_late, args=(bytes(msg.payload),), daemon=True).start()

    attacker.client.on_message = on_message

    def announce() -> None:
        meta = StatusMeta(state="online", tier="trainer", num_train=100, num_test=20, session=uuid.uuid4().hex,
                          capabilities=Capabilities())
        attacker.publish("agents/agent-02/status", encode(MessageType.STATUS, federation=fed, sender="agent-02",
                                                          round=-1, meta=meta, signer=key), retain=True)

    run_beside_the_attacker(config, out, url, attacker, announce, coordinator_security, agent_security, running)
    rows = read_rows(out)
    training, final = [row for row in rows if not row.final], rows[-1]
    assert len(training) == config.rounds and final.final
    assert all(row.participants == list(TRAINERS) and row.dropped == [] for row in training), \
        [(row.participants, row.dropped) for row in training]
    # one full wait per 2^(k-1) rounds: asked in rounds 0, 2, 5 and each time refused last
    assert [row.round for row in training if "agent-02" in row.sampled] == [0, 2, 5]
    assert [row.round for row in training if row.refused] == [0, 2, 5] == refused_at
    assert all(row.refused == {"busy": 1} for row in training if row.refused)
    # the final evaluation leaves out a device that kept it waiting three times in a row
    assert final.refused == {} and "agent-02" not in final.per_client and final.evaluated == len(TRAINERS)
