"""An agent written from docs/PROTOCOL.md, docs/MODELS.md and docs/schemas alone
(tests/foreign_agent/agent.py) trains in a real federation beside edgepfl's agents.

Client k of the federation is run twice: by a project agent and by the foreign agent,
same data, same split. The foreign agent runs in a process that cannot import edgepfl
(``-I`` and an import hook that refuses the name), so what it gets right it got from
the documents. (Its computations against edgepfl's, in process:
tests/contract/test_foreign_agent.py.)
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.data import client_indices, fmnist_available, load_pool
from edgepfl.protocol import MessageType, decode

from tests.contract.test_foreign_agent import AGENT, SCHEMAS
from tests.fleet_helpers import RunningFleet, run_config

# Runs a script in an interpreter that refuses every edgepfl module: -I drops PYTHONPATH and
# the current folder from sys.path, the hook catches the editable install in site-packages.
ISOLATED = """
import runpy, sys
class NoEdgepfl:
    def find_spec(self, name, path=None, target=None):
        if name == "edgepfl" or name.startswith("edgepfl."):
            raise ImportError("the foreign agent must not import " + name)
        return None
sys.meta_path.insert(0, NoEdgepfl())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_isolated(script: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-I", "-c", ISOLATED, str(script), *args], **popen)


def test_the_isolated_interpreter_refuses_edgepfl(tmp_path):
    script = tmp_path / "sneaky.py"
    script.write_text("import json\nfrom edgepfl.protocol import encode\n")
    proc = run_isolated(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and b"must not import edgepfl" in err


def write_client_npz(config, client: int, path: Path) -> None:
    """Client ``client``'s split as raw 8-bit images: what a device holds, before preprocessing."""
    pool = load_pool(config.data)
    assert pool.pixels.dtype == np.uint8
    train, test = client_indices(config.data, client)
    np.savez(path, x_train=pool.pixels[train], y_train=pool.y[train], x_test=pool.pixels[test],
             y_test=pool.y[test], num_classes=pool.num_classes, class_names=np.array(pool.class_names))


FOREIGN = "foreign-01"
TWIN = "agent-01"  # the project agent of the same client


def start_foreign(cfg, url: str, agent_id: str, client: int, workdir: Path) -> tuple[subprocess.Popen, Path]:
    """The foreign agent on client ``client``'s split, in the isolated interpreter."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_client_npz(cfg, client, workdir / "client.npz")
    log_path = workdir / "foreign.log"
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        proc = run_isolated(AGENT, "--broker", url, "--federation", cfg.federation, "--agent-id", agent_id,
                            "--data", str(workdir / "client.npz"), "--schemas", str(SCHEMAS),
                            "--state-dir", str(workdir / "state"), stdout=log, stderr=subprocess.STDOUT)
    return proc, log_path


def run_coordinator(cfg, url: str, out: Path, shape: dict) -> list:
    mfleet = MqttFleet(cfg.federation, cfg.broker, url=url)
    try:
        return Coordinator(cfg, mfleet, out, progress=False, **shape).run()
    finally:
        mfleet.close()


def coordinate(cfg, url: str, out: Path, shape: dict, foreign: subprocess.Popen, log_path: Path) -> tuple[list, str]:
    """One federation run to its end; the foreign agent is stopped after it and must exit cleanly."""
    try:
        rows = run_coordinator(cfg, url, out, shape)
    finally:
        foreign.terminate()
        foreign.wait(timeout=30)
    log = log_path.read_text(errors="replace")
    assert foreign.returncode == 0, log[-3000:]
    assert len(rows) == cfg.rounds + 1 and rows[-1].final
    for row in rows:
        assert row.rejected == {} and row.dropped == [] and not row.aborted, (row, log[-3000:])
    return rows, log


def captured_updates(capture, federation: str) -> dict:
    updates = {}
    for topic, payload in capture.snapshot():
        if topic.endswith("/update") and federation in topic:
            message = decode(payload)
            if message.type == MessageType.UPDATE:
                updates[(message.header.sender, message.header.round, message.meta.kind)] = message.meta.model_dump()
    return updates


@pytest.mark.timeout(300)
def test_a_foreign_agent_beside_the_project_agents_evaluates_the_global_model_as_they_do(
        mosquitto, broker_capture, tmp_path):
    """FedAvg: the foreign agent and the project agent of the same client evaluate the same
    global model on the same split, so the foreign model, preprocessing and evaluation must
    agree with the project's to the last sample, every round."""
    if not fmnist_available():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    config = run_config(f"foreign{uuid.uuid4().hex[:8]}", method={"name": "fedavg"},
                        model={"arch": "cnn", "feature_dim": 32}, data={"dataset": "fmnist"})
    with RunningFleet(config, tmp_path / "run", mosquitto.url, 4) as fleet:
        cfg = fleet.config.model_copy(update={"min_agents": 5})
        foreign, log_path = start_foreign(cfg, mosquitto.url, FOREIGN, fleet.ids.index(TWIN), tmp_path / "foreign")
        rows, log = coordinate(cfg, mosquitto.url, tmp_path / "run", fleet.shape(), foreign, log_path)

    for row in rows[:-1]:
        assert FOREIGN in row.participants and TWIN in row.participants, row
    final = rows[-1].per_client
    assert final[FOREIGN] == final[TWIN] and final[FOREIGN] > 0.5, (final, log[-3000:])  # chance is 0.1
    updates = captured_updates(broker_capture, cfg.federation)
    compared = 0
    for (sender, round_, kind), meta in updates.items():
        if sender != FOREIGN:
            continue
        twin = updates[(TWIN, round_, kind)]
        assert (meta["num_train"], meta["num_test"]) == (twin["num_train"], twin["num_test"])
        if kind == "train":
            assert meta["train_loss"] is not None and abs(meta["train_loss"] - twin["train_loss"]) < 0.25
        assert meta["eval_correct"] == twin["eval_correct"], (round_, meta, twin)
        assert meta["eval_loss"] == pytest.approx(twin["eval_loss"], abs=1e-4)
        compared += 1
    assert compared >= cfg.rounds + 1


@pytest.mark.timeout(400)
def test_a_foreign_agent_standing_in_for_a_project_agent_leaves_every_client_s_accuracy_as_it_was(
        mosquitto, tmp_path):
    """FedRep, personal heads: the same federation twice, first with four project agents, then
    with the foreign agent in agent-01's place (same id, so the same task seeds and personal
    initialisation; same split). Its local update is the project's to float rounding (the
    step-for-step test), so every client's accuracy in every round is the first run's, up to
    two of 500 held-out images for rounding on another CPU (identical in the runs measured).
    Beside its twin under another id, sampling noise alone put 1.2 points between them."""
    if not fmnist_available():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    config = run_config(f"foreign{uuid.uuid4().hex[:8]}", method={"name": "fedrep"}, rounds=5,
                        model={"arch": "mlp", "feature_dim": 32}, train={"lr": 0.02, "batch_size": 64},
                        data={"dataset": "fmnist", "samples_per_client": 2000})
    with RunningFleet(config, tmp_path / "project", mosquitto.url, 4) as fleet:
        project_rows = run_coordinator(fleet.config, mosquitto.url, tmp_path / "project", fleet.shape())

    stand_in = RunningFleet(config, tmp_path / "stand-in", mosquitto.url, 4)
    try:
        for index, agent_id in enumerate(stand_in.ids):
            if agent_id != TWIN:
                stand_in.start_agent(index)
        cfg = stand_in.config
        foreign, log_path = start_foreign(cfg, mosquitto.url, TWIN, stand_in.ids.index(TWIN), tmp_path / "foreign")
        rows, log = coordinate(cfg, mosquitto.url, tmp_path / "stand-in", stand_in.shape(), foreign, log_path)
    finally:
        stand_in.__exit__(None, None, None)

    assert "foreign-agent" in log and "evaluate task answered" in log  # it was the foreign agent that ran
    assert len(project_rows) == len(rows)
    for theirs, ours in zip(project_rows, rows, strict=True):
        assert set(ours.per_client) == set(theirs.per_client) == set(stand_in.ids)
        for agent_id, accuracy in ours.per_client.items():
            assert abs(accuracy - theirs.per_client[agent_id]) <= 2 / 500 + 1e-9, (ours.round, agent_id, ours, theirs)
    assert rows[-1].per_client[TWIN] > 0.5  # it learned: ten classes, chance is 0.1


@pytest.mark.timeout(400)
def test_the_foreign_agent_passes_every_conformance_must_of_its_version(tmp_path):
    """The kit against an implementation written from the documents: every check of 1.1 or
    earlier passes; a 1.2 requirement it does not meet is a skip (it announces 1.1). It has
    no signatures (optional, §3a) and no head tier, so those scenarios are left out."""
    import json

    from edgepfl.conformance import CHECKS, SCENARIOS
    from edgepfl.conformance.cli import main_conformance
    from edgepfl.protocol.evolution import parse_version, supports

    from tests.conftest import require_mosquitto

    require_mosquitto()
    runner = tmp_path / "isolated.py"
    runner.write_text(ISOLATED)
    command = (f"{{python}} -I {runner} {AGENT} --broker {{broker}} --federation {{federation}} "
               f"--agent-id {{agent_id}} --data {{data}} --test-fraction 0.25 --schemas {SCHEMAS} "
               f"--state-dir {{state_dir}}")
    out = tmp_path / "report.json"
    code = main_conformance(["--agent-cmd", command, "--skip", "signatures", "--skip", "head",
                             "--workdir", str(tmp_path / "work"), "--json", str(out)])
    report = json.loads(out.read_text())
    verdicts = {c["id"]: c for c in report["checks"]}
    assert report["agent_version"] == "1.1"
    not_run = {*SCENARIOS["signatures"], *SCENARIOS["head"]}
    for check_id, check in CHECKS.items():
        result = verdicts[check_id]
        if check_id in not_run:
            assert result["verdict"] == "skip", check_id
        elif supports("1.1", parse_version(check.since)):
            assert result["verdict"] == "pass", f"{check_id}: {result['verdict']} — {result['evidence']}"
        else:
            assert result["verdict"] in ("pass", "skip"), f"{check_id}: {result['evidence']}"
    assert report["conformant"] and code == 0
