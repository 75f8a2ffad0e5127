"""A head agent that joins after the run, once the coordinator process has exited, gets the
current release from what the broker retained — whole, or in parts when it is larger than
M — verifies it (the signature too, with a pinned coordinator key) and builds every head kind
its method offers, DualFed's own head included, from the global heads the release carries
(docs/PROTOCOL.md §12). Real Mosquitto, real agent processes, real ONNX.

Nobody is left to receive the agents' metrics, so the tests read what each agent installed:
its ``release.json`` (the release id, the head and its held-out metrics) and its log.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepfl.config import RunConfig, SecuritySpec
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.releases.release import PUBLISHED_FILE
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, Reassembler, decode, parse_topic, release_part_topic
from edgepfl.protocol.signing import generate_keypair, load_public_key, verify
from edgepfl.testing import TrafficCapture

from tests.fleet_helpers import run_config, wait_until

TRAINERS = 2


def run_and_exit(config: RunConfig, out: Path, url: str) -> str:
    """Train with real trainer agents until the coordinator has released and exited; the release id."""
    procs = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(TRAINERS)]
    fleet = MqttFleet(config.federation, config.broker, url=url, security=config.security)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        coordinator.run()
    finally:
        fleet.close()  # presence `done`: the process is as good as gone
        stop_agents(procs)
    return next(reversed(coordinator.releases))


def installed(out: Path, agent: str, release_id: str, timeout: float = 240) -> dict:
    """The head agent's record of ``release_id`` once it is installed (its ``release.json``)."""
    path = out / "agents" / agent / "release.json"

    def record():
        data = json.loads(path.read_text()) if path.is_file() else None
        return data if data and data["release_id"] == release_id else None

    return wait_until(record, timeout, interval=0.5, what=f"{agent} installing {release_id}")


def agent_log(out: Path, agent: str) -> str:
    return (out / "agents" / f"{agent}.log").read_text(errors="replace")


def older_head_agent_installs_the_encoder_and_ignores_the_global_heads(release, config, state, keys) -> None:
    """What a 1.1 head agent does with a 1.2 release (PROTOCOL.md §16): it reads ``artifact``
    only and fits an lr head; pinning the coordinator key, it cannot re-verify the installed
    release on restart (it re-encodes the body without ``global_heads``), so it waits for
    the retained release and installs it again."""
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.head_tier import HeadRuntime

    meta, artifact = release.meta, release.tensors["artifact"].tobytes()
    data = load_client_data(config.data, TRAINERS)
    key = load_public_key(keys / "coordinator.pub")
    runtime = HeadRuntime(state, "lr", data, coordinator_key=key)
    metrics = runtime.install_release(meta.manifest, artifact, meta.sha256, sequence=meta.sequence,
                                      expires=meta.expires, proof=release.signed_part + release.signature)
    assert metrics.head == "lr" and metrics.num_test == data.num_test
    with pytest.raises(ValueError, match="differs from the signed release"):
        HeadRuntime(state, "lr", data, coordinator_key=key).load()
    again = HeadRuntime(state, "lr", data, coordinator_key=key)
    refitted = again.install_release(meta.manifest, artifact, meta.sha256, sequence=meta.sequence,
                                     expires=meta.expires, proof=release.signed_part + release.signature)
    assert refitted.eval_correct == metrics.eval_correct


def test_a_late_head_agent_gets_a_signed_release_in_parts_and_fits_the_methods_own_head(mosquitto, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    generate_keypair(keys / "coordinator.key", keys / "coordinator.pub")
    m = 65_536
    # DualFed's device head sums its personal logits with the released global classifier's,
    # so the federation must train: at the method's default lambda (40) and the helper's lr
    # (0.05) every update overshoots the coordinator's change bound and the release would
    # hold the initial encoder. lambda 5 and lr 0.01 are the FMNIST configs' values.
    config = prepare(run_config(method={"name": "dualfed", "con_lambda": 5}, train={"lr": 0.01}, rounds=2,
                                broker={"max_message_bytes": m},
                                security=SecuritySpec(signing_key=str(keys / "coordinator.key"))),
                     TRAINERS, head_agents=1)
    out, url = tmp_path / "run", mosquitto.url
    release_id = run_and_exit(config, out, url)
    rounds = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rounds if not r["final"]]
    assert [len(r["participants"]) for r in trained] == [TRAINERS] * 2 and not any(r["rejected"] for r in trained)
    parts = json.loads((out / "releases" / PUBLISHED_FILE).read_text())["parts"]
    assert parts >= 2  # larger than M: retained in parts, not whole
    with TrafficCapture(url, f"edgepfl/v1/{config.federation}/release/#", include_retained=True) as cap:
        wanted = {release_part_topic(config.federation, i) for i in range(parts)}
        wait_until(lambda: {t for t, p in cap.snapshot() if p} >= wanted, 10, what="the retained parts")
        retained = {t: p for t, p in cap.snapshot() if p}
    assert set(retained) == wanted  # the whole-frame topic holds nothing
    reassembler, frame = Reassembler(), None
    for topic, payload in retained.items():  # release/<i> holds chunk i, from the coordinator
        chunk = decode(payload)
        assert chunk.type == MessageType.CHUNK and chunk.header.sender == "coordinator"
        assert parse_topic(topic).part == chunk.meta.index and chunk.meta.count == parts
        frame = reassembler.add("release", chunk) or frame
    assert frame is not None
    release = decode(frame)
    assert set(release.tensors) == {"artifact", "global_heads"}
    assert verify(release, load_public_key(keys / "coordinator.pub")) is None
    older_head_agent_installs_the_encoder_and_ignores_the_global_heads(release, config, tmp_path / "v1.1", keys)

    pinned = SecuritySpec(coordinator_key=str(keys / "coordinator.pub"))
    device = "device-00"
    proc = spawn_agent(config, out, url, device, TRAINERS, tier="head", head="dualfed", security=pinned)
    try:
        record = installed(out, device, release_id)
    finally:
        stop_agents([proc])
    metrics = record["metrics"]
    assert metrics["head"] == "dualfed" and metrics["num_test"] > 0
    assert metrics["accuracy"] > 0.3, metrics  # 10 classes; a head fitted on this device's own data
    assert record["global_heads_file"] and record["proof_file"] and record["sequence"] is not None
    # a restart re-verifies the installed release against the signature, global heads included
    proc = spawn_agent(config, out, url, device, TRAINERS, tier="head", head="dualfed", security=pinned)
    try:
        wait_until(lambda: f"restored release {release_id}" in agent_log(out, device), 120, interval=0.5,
                   what="the restarted agent restoring its release")
    finally:
        stop_agents([proc])
    log = agent_log(out, device)
    assert "refused" not in log and "Traceback" not in log, log[-2000:]


def test_late_head_agents_of_every_generic_kind_get_a_whole_release_after_the_run(mosquitto, tmp_path):
    config = prepare(run_config(method={"name": "repper"}, rounds=2), TRAINERS, head_agents=3)
    out, url = tmp_path / "run", mosquitto.url
    release_id = run_and_exit(config, out, url)
    assert json.loads((out / "releases" / PUBLISHED_FILE).read_text())["parts"] == 0  # fits M: retained whole

    kinds = {"device-00": "lr", "device-01": "svm", "device-02": "mlp"}
    procs = [spawn_agent(config, out, url, device, TRAINERS + i, tier="head", head=kind)
             for i, (device, kind) in enumerate(kinds.items())]
    try:
        records = {device: installed(out, device, release_id) for device in kinds}
    finally:
        stop_agents(procs)
    for device, kind in kinds.items():
        metrics = records[device]["metrics"]
        assert metrics["head"] == kind and metrics["num_test"] > 0, (device, metrics)
        assert metrics["accuracy"] > 0.3, (device, metrics)
        assert records[device]["global_heads_file"] is None  # RepPer shares nothing outside its encoder
