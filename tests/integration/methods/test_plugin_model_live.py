"""A user's own model on a user's own sensors, live: training over Mosquitto, export, head tier, serving.

The user's encoder is a file of their own outside the package (tests/plugins/sensor_cnn.py
copied into a temporary folder as ``wrist_cnn.py``: a 1-D CNN for 6 x 100 windows), named
``model.arch: wrist_cnn:build`` and reached through the ``PYTHONPATH`` the trainer agents'
processes inherit. The data are raw sensor windows (accelerometer-like: gravity on one axis,
offsets, std ~2, nothing in [0, 1]) in an npz; each trainer gets its own partition with its
own per-channel gain and offset (``partition: domain`` with ``gain``), so every device reads
its sensor differently.

FedAvg, FedRep and RepPer each train 2 rounds of 3 real ``edgepfl agent`` processes over a
real Mosquitto. The release, head-tier and serving half runs once, after the RepPer run:
RepPer's personal heads are what the head tier fits (a head on the frozen encoder's
features), and everything after training reads only the exported encoder and its manifest,
built by the same method-independent export from whichever method's encoder; running it
after FedAvg and FedRep as well would triple its cost without reaching other code. There,
two head agents run as processes in which importing torch fails, with the plugin's folder
*not* on their path (a head needs only the ONNX encoder and the manifest's input contract):
one fits its head on an npz of its own raw windows, the other on a CSV log of the same
windows. Each reports to the coordinator; then ``edgepfl serve``, again without torch,
answers the npz and the CSV with the classes the in-process torch model (the run's encoder
from its checkpoint, the agent's fitted head) gives the same raw windows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgepfl.config import RunConfig, parse_config
from edgepfl.coordinator.simulate import agent_config, simulate, stop_agents
from edgepfl.specs import CsvSpec, DataSpec

from tests.unit.export.test_series_release import NO_TORCH, model_classes
from tests.unit.methods.test_methods_federate import AGENTS, check_rows, tiny_config

pytest.importorskip("onnxruntime")
pytest.importorskip("sklearn")

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "plugins" / "sensor_cnn.py"
ARCH = "wrist_cnn:build"  # a module name no test folder holds: only the user's folder provides it
CHANNELS = ["ax", "ay", "az", "gx", "gy", "gz"]
STEPS = 100
CLASSES = ["still", "walk", "run", "stairs"]
SAMPLES_PER_AGENT = 60
DEVICE_WINDOWS = 48


def windows(rng: np.random.Generator, n: int, gain: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``n`` raw windows (n, 6, 100) and their labels: class k is a sine of k + 1 cycles per window
    (a random phase on each channel) over N(0, 1) noise, then per channel ``gain`` times that plus
    ``offset``; rounded to 3 decimals, as a logger writes them (a CSV of them reads back exactly)."""
    y = rng.permutation(np.arange(n) % len(CLASSES))
    t = np.arange(STEPS) / STEPS
    phase = rng.uniform(0, 2 * np.pi, (n, len(CHANNELS), 1))
    x = 2.0 * np.sin(2 * np.pi * (y[:, None, None] + 1) * t + phase) + rng.normal(0, 1, (n, len(CHANNELS), STEPS))
    x = gain[None, :, None] * x + offset[None, :, None]
    return np.round(x, 3).astype(np.float32), y.astype(np.int64)


#: a wrist's accelerometer (g, gravity on z) and gyroscope (rad/s) at rest
OFFSET = np.array([0.1, -0.3, 9.8, 0.5, -1.2, 2.0])


def write_csv_log(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """The windows as a sensor log: one row per time step, the windows one after another.

    With window = stride = 100 the reader cuts each run of same-label rows at multiples of 100
    from its start, which are the windows' own boundaries: it reads back exactly ``x``."""
    rows = [",".join(["activity", *CHANNELS])]
    for window, label in zip(x, y):
        rows += [",".join([CLASSES[label], *(f"{v:.3f}" for v in step)]) for step in window.T]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture(scope="module")
def fleet_files(tmp_path_factory) -> dict[str, Path]:
    """The user's folder (their model file) and their data: the trainers' pool and one head device's
    windows, as npz and as a CSV log of the same windows."""
    tmp = tmp_path_factory.mktemp("user")
    (tmp / "code").mkdir()
    shutil.copy(PLUGIN_SOURCE, tmp / "code" / "wrist_cnn.py")
    rng = np.random.default_rng(51)
    x, y = windows(rng, AGENTS * SAMPLES_PER_AGENT + 12, np.ones(len(CHANNELS)), OFFSET)
    np.savez(tmp / "pool.npz", x=x, y=y, class_names=np.array(CLASSES))
    # the head device: its own sensor, another gain and offset on every channel
    x, y = windows(rng, DEVICE_WINDOWS, rng.uniform(0.7, 1.4, len(CHANNELS)), OFFSET + rng.normal(0, 0.5, len(CHANNELS)))
    np.savez(tmp / "device.npz", x=x, y=y, class_names=np.array(CLASSES))
    return {"code": tmp / "code", "pool": tmp / "pool.npz", "device.npz": tmp / "device.npz",
            "device.csv": write_csv_log(tmp / "device.csv", x, y)}


@pytest.fixture
def user_path(fleet_files, monkeypatch) -> str | None:
    """The user's folder on the coordinator's path and on every trainer's (``PYTHONPATH``); the
    ``PYTHONPATH`` there was before (what head agents get)."""
    before = os.environ.get("PYTHONPATH")
    code = str(fleet_files["code"])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([code, *([before] if before else [])]))
    monkeypatch.syspath_prepend(code)
    monkeypatch.delitem(sys.modules, "wrist_cnn", raising=False)
    yield before
    sys.modules.pop("wrist_cnn", None)


def sensor_config(method: str, pool: Path, **changes) -> RunConfig:
    """The method's tiny shipped config on the pool of raw windows with the user's encoder."""
    data = tiny_config(method).model_dump(mode="json")
    data["model"]["arch"] = ARCH
    data["data"] = DataSpec(dataset="npz", root=str(pool), samples_per_client=SAMPLES_PER_AGENT, seed=0,
                            input={"kind": "series"}, partition={"kind": "domain", "domains": ["gain"]}
                            ).model_dump(mode="json")
    return parse_config(RunConfig, data | changes, f"{method} on sensor windows")


def check_trained_the_plugin(out: Path) -> None:
    """The run's checkpoint holds the user's network under ``encoder.net`` and names its import path."""
    from edgepfl.export.onnx_export import load_run

    run = load_run(out)
    assert run.meta.run.model.arch == ARCH
    assert run.meta.run.data.input_kind == "series" and tuple(run.meta.run.data.input_shape) == (len(CHANNELS), STEPS)
    assert type(run.method.encoder_module(run.model).net).__name__ == "SensorCNN"
    assert "encoder.net.body.0.weight" in run.state.global_tensors


@pytest.mark.parametrize("method", ["fedavg", "fedrep"])
def test_a_user_model_from_its_own_file_trains_over_mosquitto(method, fleet_files, user_path, mosquitto, tmp_path):
    rows, summary = simulate(sensor_config(method, fleet_files["pool"]), AGENTS, tmp_path / "run",
                             broker=mosquitto.url, progress=False)
    check_rows(rows, summary)
    check_trained_the_plugin(tmp_path / "run")


def spawn_head_agent(config: RunConfig, url: str, agent_id: str, data: DataSpec, root: Path,
                     pythonpath: str | None) -> subprocess.Popen:
    """A head-tier ``edgepfl agent`` in an interpreter where importing torch fails and the user's
    model is not on the path."""
    cfg = agent_config(config, root, url, agent_id, 0, "head", "lr", 1).model_copy(update={"data": data})
    cfg_path = root / f"{agent_id}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    script = NO_TORCH + f"from edgepfl.cli import main\nsys.exit(main(['agent', '--config', {str(cfg_path)!r}]))\n"
    log = open(root / f"{agent_id}.log", "ab")  # noqa: SIM115 - the process writes it until it is stopped
    try:
        return subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=root)
    finally:
        log.close()


def serve_without_torch(state: Path, requests: list[dict], pythonpath: str | None) -> list[dict]:
    """``edgepfl serve --state state`` without torch: its answer to each request line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    script = NO_TORCH + "from edgepfl.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run([sys.executable, "-c", script, "serve", "--state", str(state), "--label", "activity",
                           "--channels", ",".join(CHANNELS)], input="".join(json.dumps(r) + "\n" for r in requests),
                          capture_output=True, text=True, timeout=120, env=env, cwd=state)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_repper_with_a_user_model_releases_to_torch_free_head_agents_and_serve_gives_the_torch_models_classes(
        fleet_files, user_path, mosquitto, tmp_path):
    from edgepfl.edge_agent.head_tier import read_installed
    from edgepfl.export.onnx_export import PARITY_TOLERANCE, load_run, read_release
    from edgepfl.export.predict import OnnxEncoder
    from edgepfl.metrics import read_head_metrics

    config = sensor_config("repper", fleet_files["pool"], release_at_end=True, min_head_agents=2)
    devices = tmp_path / "devices"
    devices.mkdir()
    own_data = {
        "device-npz": DataSpec(dataset="npz", root=str(fleet_files["device.npz"]), num_clients=1,
                               input={"kind": "series"}),
        "device-csv": DataSpec(dataset="csv", root=str(fleet_files["device.csv"]), num_clients=1,
                               csv=CsvSpec(label="activity", channels=CHANNELS, window=STEPS, stride=STEPS,
                                           classes=CLASSES)),
    }
    heads = [spawn_head_agent(config, mosquitto.url, agent_id, data, devices, user_path)
             for agent_id, data in own_data.items()]
    try:
        rows, summary = simulate(config, AGENTS, tmp_path / "run", broker=mosquitto.url, progress=False)
        check_rows(rows, summary)
        out = tmp_path / "run"
        check_trained_the_plugin(out)

        # the release: the user's encoder in ONNX, its input contract in the manifest, parity stated and met
        (release,) = (out / "releases").glob("round-*")
        manifest, _ = read_release(release)
        assert manifest.run.model.arch == ARCH and manifest.run.data.input_kind == "series"
        assert tuple(manifest.run.data.input_shape) == (len(CHANNELS), STEPS)
        assert manifest.run.data.normalization is not None and len(manifest.run.data.normalization.mean) == 6
        assert manifest.batchnorm.statistics == "federated"
        assert manifest.parity_max_abs is not None and manifest.parity_max_abs <= PARITY_TOLERANCE
        run = load_run(out)
        encoder = run.method.encoder_module(run.model).eval()
        raw = np.load(fleet_files["device.npz"])["x"]
        onnx = OnnxEncoder.from_dir(release)
        import torch

        with torch.no_grad():
            want = encoder(torch.from_numpy(onnx.preprocess(raw))).numpy()
        assert np.abs(onnx.features(onnx.preprocess(raw)) - want).max() <= PARITY_TOLERANCE

        # both head agents installed it, fitted on their own file and reported
        reports = read_head_metrics(out)[manifest.release_id].reports
        assert sorted(reports) == sorted(own_data)
        assert all(r.refused is None and r.total > 0 for r in reports.values()), reports
        assert reports["device-npz"].total == reports["device-csv"].total
    finally:
        stop_agents(heads)
    assert all(p.returncode == 0 for p in heads), [(devices / f"{a}.log").read_text()[-2000:] for a in own_data]

    # serve answers the npz and the CSV log with the classes of the torch model and the fitted head
    classes = {}
    for agent_id in own_data:
        state = devices / "agents" / agent_id
        record = read_installed(state)  # written before the agent reported
        assert record.release_id == manifest.release_id
        expected = classes[agent_id] = model_classes(encoder, release / "manifest.json", state / record.head_file,
                                                     raw).tolist()
        assert len(set(expected)) > 1  # agreeing on one constant class would prove nothing
        answers = serve_without_torch(state, [{"id": "npz", "inputs": [str(fleet_files["device.npz"])]},
                                              {"id": "csv", "inputs": [str(fleet_files["device.csv"])]}], user_path)
        assert [a["id"] for a in answers] == ["npz", "csv"] and all("error" not in a for a in answers), answers
        for answer in answers:
            assert answer["release_id"] == manifest.release_id
            assert [r["predictions"][0]["index"] for r in answer["results"]] == expected, (agent_id, answer["id"])
    # the CSV log read back the npz's windows exactly: the two devices fitted the same head
    assert classes["device-csv"] == classes["device-npz"]
