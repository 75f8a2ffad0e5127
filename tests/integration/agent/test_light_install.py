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
