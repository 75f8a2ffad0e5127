"""The walk-throughs in ``examples/`` run as a user runs them, and do what they say.

Each script runs as a subprocess in a temporary folder on a free port, with the real
Mosquitto, coordinator, agents, onnxruntime and ``edgepfl`` command line; the test reads
what it printed and the files it left. A script that breaks (a changed flag, a product
regression on the way) fails here before it fails a user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgepfl.broker import free_port
from edgepfl.metrics import read_head_metrics
from edgepfl.protocol.view import parse_view

from tests.conftest import require_mosquitto

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
OWNER_CLASSES = {"Trouser", "Sandal", "Bag"}


def run_walkthrough(script: str, work: Path, **extra_env: str) -> str:
    """Run ``examples/<script>`` with its work folder and a free port; its output, asserted complete."""
    env = dict(os.environ, EDGEPFL=str(Path(sys.executable).with_name("edgepfl")), OMP_NUM_THREADS="1", **extra_env)
    done = subprocess.run(["bash", str(EXAMPLES / script), str(work), str(free_port())], cwd=work.parent, env=env,
                          capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "walk-through completed" in output
    return output


def test_operators_walkthrough_provisions_runs_over_tls_shows_status_and_reports(tmp_path):
    require_mosquitto()
    work = tmp_path / "operator"
    output = run_walkthrough("walkthrough_operator.sh", work)

    # the coordinator and every agent ran from their provisioned bundles: TLS and signatures on
    for bundle in ("coordinator/coordinator.yaml", "agents/trainer-01/agent.yaml", "agents/pi-01/agent.yaml"):
        text = (work / "fleet" / bundle).read_text()
        assert "url: mqtts://localhost:" in text and "signing_key: signing.key" in text
    # status, read with the operator's read-only credentials while the run was going on
    view = parse_view((work / "status.json").read_text())
    assert view.federation == "walkthrough" and view.rounds_completed >= 1 and view.rejected == {}
    assert view.online == {"trainer": 2, "head": 1}
    assert {(a.id, a.tier, a.online) for a in view.agents} == {
        ("trainer-01", "trainer", True), ("trainer-02", "trainer", True), ("pi-01", "head", True)}
    assert "edgepfl status --config" in output and "2 trainer, 1 head" in output  # the table too

    # the report: every round, and the head tier labelled by the release it reported on
    run = work / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[-1]["final"]
    assert all(r["participants"] == ["trainer-01", "trainer-02"] and not r["rejected"] for r in rows[:-1])
    head = read_head_metrics(run)
    assert len(head) == 1
    release_id, reports = next(iter(head.items()))
    assert set(reports.reports) == {"pi-01"} and reports.accuracy() > 0.5
    assert f"head-tier agents, release {release_id}" in output
    assert f"head-tier agents, release {release_id}" in (run / "results.txt").read_text()
    assert (run / "accuracy.png").stat().st_size > 0


def test_pi_owners_walkthrough_predicts_the_owners_class_names(tmp_path):
    from edgepfl.data import fmnist_available

    require_mosquitto()
    if not fmnist_available():
        pytest.skip("Fashion-MNIST not installed (scripts/setup.sh installs it as root)")
    work = tmp_path / "pi"
    output = run_walkthrough("walkthrough_pi_owner.sh", work)

    # the owner's folders sort in another order than the federation's classes
    from edgepfl.config import DataSpec
    from edgepfl.data import load_pool

    federation_order = load_pool(DataSpec(dataset="fmnist")).class_names
    folders = sorted(p.name for p in (work / "photos").iterdir())
    assert set(folders) == OWNER_CLASSES
    assert folders != sorted(folders, key=federation_order.index)

    # the head agent installed the federation's release
    log = (work / "pi" / "agent.log").read_text()
    assert "(head tier) online" in log and "installed: svm head" in log
    record = json.loads((work / "pi" / "state" / "release.json").read_text())
    assert (work / "pi" / "state" / record["head_file"]).is_file()

    # predict printed one line per photo, with the owner's names, mostly right
    lines = (work / "predictions.tsv").read_text().splitlines()
    photos = sorted((work / "to-classify").iterdir())
    assert len(lines) == len(photos) == 60
    printed = {Path(line.split("\t")[0]).name: line.split("\t")[1].split()[0] for line in lines}
    assert set(printed) == {p.name for p in photos}
    assert set(printed.values()) <= OWNER_CLASSES
    right = sum(name.split("-")[0] == cls for name, cls in printed.items())
    assert right / len(printed) >= 0.8, printed
    assert f"== right: {right} of 60" in output

    # serve answered the same photos with the same names, from the installed release
    served = json.loads((work / "served.jsonl").read_text())
    assert served["release_id"] == record["release_id"]
    assert {Path(r["input"]).name: r["predictions"][0]["class"] for r in served["results"]} == printed


def test_sensors_walkthrough_trains_the_users_model_and_serves_a_new_watch(tmp_path):
    """examples/sensors: the user's 1-D CNN from their own file trains on real BasicMotions windows
    (label skew and sensor gain per device), exports with parity, and a new watch's torch-free
    head agent, fit-head, predict and serve name its raw windows. Five rounds instead of the
    config's twenty (ROUNDS): the commands are the same, the run shorter."""
    import importlib.util

    require_mosquitto()
    if importlib.util.find_spec("sktime") is None:
        pytest.skip("the sensors extra is not installed (pip install 'edgepfl[sensors]'); CI installs every extra")
    work = tmp_path / "sensors"
    output = run_walkthrough("sensors/walkthrough.sh", work, ROUNDS="5")

    # the user's plugin model, trained on the series, is what the release runs
    manifest = json.loads((work / "release" / "manifest.json").read_text())
    assert manifest["run"]["model"]["arch"] == "my_model:build"
    assert manifest["run"]["data"]["input_kind"] == "series" and manifest["run"]["data"]["input_shape"] == [6, 100]
    assert manifest["run"]["data"]["class_names"] == ["Standing", "Running", "Walking", "Badminton"]
    assert manifest["parity_max_abs"] < 1e-3
    rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows[:-1]] == [0, 1, 2, 3, 4] and rows[-1]["final"]

    # the watch's head agent fitted its head on its CSV log and reported on the run's release
    record = json.loads((work / "watch" / "state" / "release.json").read_text())
    log = (work / "watch" / "agent.log").read_text()
    assert "(head tier) online: 18 train / 6 test samples" in log and "installed: lr head" in log
    assert f"head-tier agents, release {record['release_id']}" in output

    # predict named the new windows with the activities, most of them right
    truth = np.load(work / "watch" / "new-windows.npz")
    answers = [json.loads(line) for line in (work / "predictions.jsonl").read_text().splitlines()]
    names = [a["predictions"][0]["class"] for a in answers]
    assert len(names) == len(truth["y"]) == 16
    right = sum(name == str(truth["class_names"][y]) for name, y in zip(names, truth["y"]))
    assert right >= 8 and f"== predict: {right} of 16 windows right" in output

    # serve answered from the agent's installed release as predict does with the agent's head
    served = json.loads((work / "served.jsonl").read_text())
    assert served["release_id"] == record["release_id"] and len(served["results"]) == 16
    agent_named = [json.loads(line)["predictions"][0]["class"]
                   for line in (work / "agent-predictions.jsonl").read_text().splitlines()]
    assert [r["predictions"][0]["class"] for r in served["results"]] == agent_named
