"""Staged rollout, halt and rollback over a live fleet (docs/ROLLOUT.md; protocol 1.8).

Real Mosquitto, 20 real head agent processes pinned to the coordinator's key, no
coordinator running: ``edgepfl release`` (a real process each time) is the operator's
tool between runs.

1. A first release reaches the whole fleet (one stage).
2. A deliberately bad release — the good encoder with its weights zeroed, so every image
   gives the same features — is rolled out by stages 20 % / 50 % / 100 %: it is halted at
   the canary (4 devices) by the paired accuracy gate (the default gate) and rolled back. No device beyond
   the canary ever installs it; both canary devices are back on the first release from
   their own kept files (no download, no fit); every device now refuses the bad release.
3. A good release, held by the operator after the canary (``--hold``), is promoted
   (``edgepfl release promote``) through the other two stages to 100 %, each stage's time
   recorded.
4. ``edgepfl release rollback`` puts the whole fleet back on the first release without
   downloading it: each head agent restores it from the files it kept.
5. The good release once more, held at the canary and halted by the operator (``edgepfl
   release halt``): the canary goes back, no other device installs it.
6. The first release's encoder again under a manifest whose normalization is in pixel
   units (mean and std x 255, the scale applied twice): the same encoder file, every input
   changed. The canary fits it and measures it, and it is halted there (it used to be
   adopted with the old head, re-sending the old report: passed unmeasured).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.config import SecuritySpec
from edgepfl.coordinator.ops.status import fetch_view
from edgepfl.coordinator.simulate import spawn_agent, stop_agents
from edgepfl.errors import ExitCode
from edgepfl.protocol.signing import generate_keypair
from edgepfl.rollout import stage_members

from tests.export_fixtures import export_dir
from tests.fleet_helpers import run_config, wait_until

HEADS = 20
STAGES = "0.2,0.5,1"


def installed(out: Path, agent: str) -> dict:
    path = out / "agents" / agent / "release.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def agent_log(out: Path, agent: str) -> str:
    path = out / "agents" / f"{agent}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def zeroed_copy(good: Path, bad: Path) -> str:
    """``good``'s export with every weight matrix of the encoder set to zero, under its own
    release id: it loads and runs, and gives every image the same features."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    model = onnx.load(str(bad / manifest["encoder"]["file"]))
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        if array.ndim >= 2:
            init.CopyFrom(numpy_helper.from_array(np.zeros_like(array), init.name))
    data = model.SerializeToString()
    name = "encoder-zeroed.onnx"
    (bad / name).write_bytes(data)
    manifest["encoder"] = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest["release_id"] = "fedavg-zeroed-encoder"
    manifest["variants"] = {}
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return manifest["release_id"]


def pixel_units_copy(good: Path, bad: Path) -> str:
    """``good``'s export, the same encoder file, its manifest's normalization given in pixel
    units (mean and std x 255) under its own release id."""
    shutil.copytree(good, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    norm = manifest["run"]["data"]["normalization"]
    manifest["run"]["data"]["normalization"] = {"mean": [255 * m for m in norm["mean"]],
                                                "std": [255 * v for v in norm["std"]]}
    manifest["release_id"] = "fedavg-pixel-units"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    return manifest["release_id"]


def release_command(*args: str, timeout: float = 600, log: Path | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "edgepfl", "--log-level", "info", "release", *args],
                          capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    return done


@pytest.mark.timeout(1500)
def test_a_bad_release_is_halted_at_the_canary_and_rolled_back_and_a_good_one_reaches_everyone(
        mosquitto, tmp_path, request):
    keys = tmp_path / "keys"
    keys.mkdir()
    generate_keypair(keys / "coordinator.key", keys / "coordinator.pub")
    first_export = export_dir(tmp_path / "first", "fedavg", rounds=1)
    good_export = export_dir(tmp_path / "good", "fedavg", rounds=3)
    bad = zeroed_copy(good_export, tmp_path / "bad")
    first_id = json.loads((first_export / "manifest.json").read_text())["release_id"]
    good_id = json.loads((good_export / "manifest.json").read_text())["release_id"]

    config = run_config(data={"dataset": "digits", "samples_per_client": 80, "num_clients": HEADS},
                        security=SecuritySpec(signing_key=str(keys / "coordinator.key")),
                        rollout={"stage_timeout_s": 120})
    out = tmp_path / "run"
    (out / "agents").mkdir(parents=True)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True)))
    common = ("--config", str(config_file), "--run", str(out), "--broker", mosquitto.url)
    pinned = SecuritySpec(coordinator_key=str(keys / "coordinator.pub"))
    agents = [f"pi-{i:02d}" for i in range(HEADS)]
    procs: list = []
    request.addfinalizer(lambda: stop_agents(procs))
    procs.extend(spawn_agent(config, out, mosquitto.url, a, i, tier="head", security=pinned)
                 for i, a in enumerate(agents))

    # 1. the first release, to everyone at once
    done = release_command("publish", *common, "--export", str(first_export), "--stages", "1", "--heads", str(HEADS),
                           "--wait", "300")
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(installed(out, a).get("release_id") == first_id for a in agents)

    # 2. the bad release: halted at the canary, rolled back there
    canary = set(stage_members(agents, 0.2, config.federation))
    assert len(canary) == 4
    marks = {a: len(agent_log(out, a)) for a in agents}
    halted = release_command("publish", *common, "--export", str(tmp_path / "bad"), "--stages", STAGES,
                             "--heads", str(HEADS), log=tmp_path / "halted.log")
    assert halted.returncode == int(ExitCode.HALTED), halted.stdout + halted.stderr
    assert "halted at a gate and rolled back" in halted.stderr
    events = [json.loads(line) for line in (out / "releases" / "rollout.jsonl").read_text().splitlines()]
    stage, halt, back = events[-3:]
    assert (stage["event"], stage["stage"], set(stage["agents"])) == ("stage", 1, canary)
    assert not stage["verdict"]["passed"] and stage["verdict"]["mean_change"] < -0.2, stage
    assert (halt["event"], back["event"], back["to_release"]) == ("halted", "rolled_back", first_id)
    shown = fetch_view(mosquitto.url, config.federation)  # what the dashboard and edgepfl status show
    assert shown.rollout is not None and (shown.rollout.release, shown.rollout.state, shown.rollout.stage,
                                          shown.rollout.to_release) == (bad, "rolled_back", 1, first_id)
    assert shown.release == first_id and shown.phase == "done" and shown.rollout.reasons
    # and what the canary measured, as the operator reads it beside the state
    assert (shown.rollout.paired, shown.rollout.mean_change) == (stage["verdict"]["paired"],
                                                                 stage["verdict"]["mean_change"])
    assert shown.rollout.paired == len(canary) and shown.rollout.mean_change < -0.2
    for agent in agents:
        log = agent_log(out, agent)
        if agent in canary:  # installed it, then went back from its own files
            assert f"release {bad} installed" in log and "restored from the kept files" in log, log[-2000:]
        else:  # never installed it, and downloaded nothing: its status named the release it has
            assert f"release {bad} installed" not in log and f"installing release {bad}" not in log
            assert "already installed" not in log[marks[agent]:], log[marks[agent]:]
        assert installed(out, agent)["release_id"] == first_id, agent

    # 3. a good release, held after the canary by the operator, then promoted through the other stages
    held = release_command("publish", *common, "--export", str(good_export), "--stages", STAGES,
                           "--heads", str(HEADS), "--hold")
    assert held.returncode == 0 and "is held" in held.stdout, held.stdout + held.stderr
    assert {a for a in agents if installed(out, a)["release_id"] == good_id} == canary
    assert fetch_view(mosquitto.url, config.federation).rollout.state == "held"
    promoted = release_command("promote", *common, "--stages", STAGES, "--heads", str(HEADS))
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    events = [json.loads(line) for line in (out / "releases" / "rollout.jsonl").read_text().splitlines()]
    stages = [e for e in events if e.get("release_id") == good_id and e["event"] == "stage"]
    assert [len(e["agents"]) for e in stages] == [4, 10, 20] and all(e["verdict"]["passed"] for e in stages)
    assert events[-1]["event"] == "promoted"
    assert all(e["seconds"] > 0 for e in stages)
    assert all(installed(out, a)["release_id"] == good_id for a in agents)
    shown = fetch_view(mosquitto.url, config.federation)
    assert (shown.rollout.state, shown.rollout.stage, shown.release) == ("promoted", 3, good_id)
    assert shown.rollout.paired == stages[-1]["verdict"]["paired"] and shown.rollout.mean_change is not None
    assert shown.releases == {good_id: HEADS}
    shown = release_command("status", "--run", str(out))
    assert shown.returncode == 0 and "promoted" in shown.stdout and "halted" in shown.stdout
    table = subprocess.run([sys.executable, "-m", "edgepfl", "status", "--broker", mosquitto.url, "--federation",
                            config.federation], capture_output=True, text=True, timeout=60)
    assert f"rollout    {good_id} promoted to the whole fleet" in table.stdout, table.stdout + table.stderr

    # 4. an operator's rollback: every device back on the first release from its own files
    marks = {a: len(agent_log(out, a)) for a in agents}
    rolled = release_command("rollback", *common, "--heads", str(HEADS))
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    wait_until(lambda: all(installed(out, a)["release_id"] == first_id for a in agents), 60, interval=0.5,
               what="every head agent back on the first release")
    for agent in agents:
        since = agent_log(out, agent)[marks[agent]:]
        assert "restored from the kept files" in since and "installing release" not in since, since[-2000:]

    # 5. the good release again, held at the canary, and halted by the operator: the canary goes back
    marks = {a: len(agent_log(out, a)) for a in agents}
    held = release_command("publish", *common, "--export", str(good_export), "--stages", STAGES,
                           "--heads", str(HEADS), "--hold")
    assert held.returncode == 0 and "is held" in held.stdout, held.stdout + held.stderr
    halted = release_command("halt", *common, "--stages", STAGES, "--heads", str(HEADS))
    assert halted.returncode == 0 and f"the fleet is back on {first_id}" in halted.stdout, halted.stdout + halted.stderr
    assert all(installed(out, a)["release_id"] == first_id for a in agents)
    for agent in agents:
        since = agent_log(out, agent)[marks[agent]:]
        assert (f"release {good_id} installed" in since) == (agent in canary), (agent, since[-2000:])
    assert release_command("halt", *common).returncode == int(ExitCode.DATA)  # nothing held any more

    # 6. the installed encoder under another preprocessing: fitted and measured at the canary, halted there
    rescaled = pixel_units_copy(first_export, tmp_path / "pixel-units")
    marks = {a: len(agent_log(out, a)) for a in agents}
    halted = release_command("publish", *common, "--export", str(tmp_path / "pixel-units"), "--stages", STAGES,
                             "--heads", str(HEADS), log=tmp_path / "pixel-units.log")
    assert halted.returncode == int(ExitCode.HALTED), halted.stdout + halted.stderr
    events = [json.loads(line) for line in (out / "releases" / "rollout.jsonl").read_text().splitlines()]
    stage, halt, back = events[-3:]
    assert (stage["event"], stage["release_id"], set(stage["agents"])) == ("stage", rescaled, canary), stage
    assert not stage["verdict"]["passed"] and stage["verdict"]["mean_change"] < -0.2, stage
    assert (halt["event"], back["event"], back["to_release"]) == ("halted", "rolled_back", first_id)
    for agent in canary:
        since = agent_log(out, agent)[marks[agent]:]
        assert f"installing release {rescaled}" in since and "carries the installed encoder" not in since, since[-2000:]
    assert all(installed(out, a)["release_id"] == first_id for a in agents)

    # 7. the bad release from a new run folder: the fleet's release is adopted from the broker, so the
    #    canary is paired with its reports on it (not "n/a") and halted, and rolled back to it
    new_run = tmp_path / "new-run"
    halted = release_command("publish", "--config", str(config_file), "--run", str(new_run), "--broker", mosquitto.url,
                             "--export", str(tmp_path / "bad"), "--stages", STAGES, "--heads", str(HEADS),
                             log=tmp_path / "new-run.log")
    assert halted.returncode == int(ExitCode.HALTED), halted.stdout + halted.stderr
    assert f"adopted release {first_id}" in halted.stderr, halted.stderr[-3000:]
    events = [json.loads(line) for line in (new_run / "releases" / "rollout.jsonl").read_text().splitlines()]
    stage, halt, back = events[-3:]
    assert (stage["event"], set(stage["agents"])) == ("stage", canary), stage
    assert stage["verdict"]["paired"] == len(canary) and stage["verdict"]["mean_change"] < -0.2, stage
    assert (halt["event"], back["event"], back["to_release"]) == ("halted", "rolled_back", first_id)
    assert all(installed(out, a)["release_id"] == first_id for a in agents)
    assert fetch_view(mosquitto.url, config.federation).release == first_id

    stop_agents(procs)
    for agent in agents:
        assert "Traceback" not in agent_log(out, agent)

