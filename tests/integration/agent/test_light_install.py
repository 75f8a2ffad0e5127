"""The Raspberry Pi install: ``pip install edgepfl[agent]`` in a fresh environment with
no torch, a head-tier agent from it against Mosquitto, end to end.

This test builds a real virtual environment (from the package registry, as a Pi
would) and so takes a minute or two; it is the proof that the head tier never needs
torch — torch cannot even be imported there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_config
from edgepfl.data import load_client_data

from tests.fleet_helpers import RunningFleet, run_config

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def light_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # A non-editable install: also proves the package and its 'agent' extra are complete.
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", f"{REPO}[agent]"], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        msg = f"pip install edgepfl[agent] failed:\n{proc.stderr[-2000:]}"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def test_light_environment_has_no_torch(light_venv):
    probe = subprocess.run([str(light_venv), "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    ok = subprocess.run([str(light_venv), "-c", "import edgepfl.edge_agent, edgepfl.edge_agent.head_tier, edgepfl.export.predict, "
                         "edgepfl.protocol.transport, edgepfl.data, sys; assert 'torch' not in sys.modules"],
                        capture_output=True, text=True, cwd="/",
                        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert ok.returncode == 0, ok.stderr


def test_methods_listing_and_config_validation_work_on_the_agent_extra(light_venv):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listing = subprocess.run([str(light_venv.parent / "edgepfl"), "methods"], capture_output=True, text=True,
                             cwd="/", env=env)
    assert listing.returncode == 0, listing.stderr
    assert {line.split()[0] for line in listing.stdout.splitlines()} >= {"fedavg", "repper", "dualfed", "fedpick"}
    check = subprocess.run([str(light_venv), "-c", "from edgepfl.config import load_run_config; "
                            f"print(load_run_config({str(REPO / 'configs' / 'repper.yaml')!r}).method.name)"],
                           capture_output=True, text=True, cwd="/", env=env)
    assert check.returncode == 0 and check.stdout.strip() == "repper", check.stderr


@pytest.mark.parametrize("args", [["demo", "--rounds", "1"], ["simulate", "--config", str(REPO / "configs" / "fedavg.yaml")],
                                  ["export", "--run", "r", "--out", "o"]])
def test_torch_commands_on_the_agent_extra_name_the_extra_in_one_line(light_venv, args, tmp_path):
    proc = subprocess.run([str(light_venv.parent / "edgepfl"), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 5 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip() == proc.stderr.strip().splitlines()[0] and "pip install 'edgepfl[train]'" in proc.stderr


def test_head_agent_without_torch_end_to_end(light_venv, mosquitto, tmp_path):
    config = run_config(method={"name": "fedavg"}, rounds=2, release_at_end=True, data={"samples_per_client": 300})
    out = tmp_path / "run"
    with RunningFleet(config, out, mosquitto.url, 2) as fleet:
        cfg = fleet.config.model_copy(update={"data": fleet.config.data.model_copy(update={"num_clients": 3})})
        head_cfg = agent_config(cfg, out, mosquitto.url, "pi-00", 2, "head", "svm", 1)
        path = tmp_path / "pi.yaml"
        path.write_text(yaml.safe_dump(head_cfg.model_dump(mode="json")))
        log_path = tmp_path / "pi.log"
        pi = subprocess.Popen([str(light_venv.parent / "edgepfl"), "--log-level", "info", "agent", "--config", str(path)],
                              stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, cwd="/",
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        try:
            fleet_ = MqttFleet(cfg.federation, cfg.broker, url=mosquitto.url)
            coord = Coordinator(cfg, fleet_, out, progress=False, **fleet.shape())
            coord.run()
            fleet_.close()
        finally:
            pi.terminate()
            pi.wait(timeout=30)

    log = log_path.read_text()
    assert "Traceback" not in log, log[-3000:]
    (entry,) = json.loads((out / "head_metrics.json").read_text()).values()  # one release
    report = entry["reports"]["pi-00"]
    # what the release cost: its retained copy (which this agent took), counted by release and in the summary
    release_file = next((out / "releases").glob("*/encoder.onnx"))
    assert entry["sent_bytes"]["retained"] > release_file.stat().st_size
    from edgepfl.coordinator.ops.report import write_report

    assert write_report(out)[1]["release_bytes"]["total"] == sum(entry["sent_bytes"].values())
    assert report["tier"] == "head" and report["head"] == "svm" and report["accuracy"] > 0.3
    assert report["release_id"] == json.loads((Path(head_cfg.state_dir) / "release.json").read_text())["release_id"]

    # prediction served on the device, from the light environment, with the installed files
    record = json.loads((Path(head_cfg.state_dir) / "release.json").read_text())
    data = load_client_data(cfg.data, 2)
    sample = tmp_path / "x.npy"
    np.save(sample, data.x_test[:5])
    pred = subprocess.run([str(light_venv.parent / "edgepfl"), "predict", "--preprocessed", "--json",
                           "--encoder", str(Path(head_cfg.state_dir) / record["encoder_file"]),
                           "--head", str(Path(head_cfg.state_dir) / record["head_file"]), str(sample)],
                          capture_output=True, text=True, cwd="/",
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert pred.returncode == 0, pred.stderr
    lines = [json.loads(line) for line in pred.stdout.splitlines() if line.strip()]
    assert len(lines) == 5



#: the whole head device's cap, as the unit's ``MemoryMax=`` would set it, in bytes: 150 MB
DEVICE_CAP = 150 * 10**6


@pytest.fixture
def device_cgroup():
    """A memory cgroup capped at :data:`DEVICE_CAP`: the whole device."""
    from tests.memory_cgroup import CgroupUnavailable, new_memory_cgroup

    try:
        group = new_memory_cgroup(DEVICE_CAP)
    except CgroupUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the 150 MB device test needs a memory cgroup (root, cgroup v1 or v2): {exc}")
        pytest.skip(str(exc))
    yield group
    group.remove()


def test_a_whole_head_device_installs_fits_reports_and_serves_within_150_mb(light_venv, device_cgroup, mosquitto,
                                                                            tmp_path):
    """Issue 53: the head agent, its fit child, ``serve`` and ``predict`` in one memory cgroup
    capped at 150 MB (:mod:`tests.head_device`): the agent installs the release, fits its SVM
    head in the child and reports, ``serve`` answers and ``predict`` runs beside it, and the
    kernel kills nothing. Before the fit child dropped skl2onnx and the agent its sessions
    and in-memory samples during the fit, this install peaked at 189 MiB of anonymous memory
    and the kernel killed it under this cap. The page cache is left as it is: the
    environment's libraries were read when it was built, so the cap bounds what the
    processes allocate (from an empty page cache the device needs 160 MB:
    ``benchmarks/device_memory.py``)."""
    from tests.head_device import SAMPLES, run_head_device

    run = run_head_device(light_venv.parent, device_cgroup, mosquitto.url, tmp_path)
    assert run.oom_kills == 0 and run.agent_survived, run.log[-3000:]
    assert "Traceback" not in run.log and "out of memory" not in run.log, run.log[-3000:]
    assert run.report is not None, run.log[-3000:]
    record = json.loads((tmp_path / "run" / "agents" / "pi-00" / "release.json").read_text())
    assert run.report["head"] == "svm" and run.report["accuracy"] > 0.5
    assert run.report["release_id"] == record["release_id"]
    assert run.serve is not None, run.serve_error
    assert run.serve["release_id"] == record["release_id"] and len(run.serve["results"]) == SAMPLES
    assert run.predict_lines == SAMPLES, run.predict_error
    assert run.anon_peak_bytes <= DEVICE_CAP
    print(f"whole device under a {DEVICE_CAP / 1e6:.0f} MB cap: peak {run.peak_bytes / 2**20:.1f} MiB "
          f"({run.anon_peak_bytes / 2**20:.1f} MiB anonymous)")
