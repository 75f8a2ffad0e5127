"""A whole head device in one memory cgroup, live: the scenario the 150 MB test asserts on and
``benchmarks/device_memory.py`` measures at several caps.

Two trainer agents and a coordinator (this interpreter, torch) train a FedAvg CNN on
Fashion-MNIST for two rounds and release the encoder; a head agent from a torch-free
environment (``[agent]`` only), holding a tenth of the pool as its own ``.npz`` (about 3,700
images), installs the release in the cgroup, fits its SVM head (C cross-validated) in its
fit child and reports; then ``edgepfl serve`` answers a request and ``edgepfl predict`` runs,
both in the same cgroup beside the resident agent. The kernel enforces the cap on all of them
together, as systemd's ``MemoryMax=`` does on the unit.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_config

from tests.fleet_helpers import RunningFleet, run_config
from tests.memory_cgroup import MemoryCgroup

#: the device's partition of a ten-way split of the pool
DEVICE_PARTITION, PARTITIONS = 9, 10
#: one request to ``serve`` and one ``predict``: this many of the device's own images
SAMPLES = 64


@dataclass
class DeviceRun:
    """What happened in the cgroup."""

    report: dict | None  #: the head agent's report as the coordinator recorded it (None: none came)
    install_seconds: float | None  #: agent start to its report reaching the coordinator
    serve: dict | None  #: serve's answer (None: it failed)
    serve_error: str
    predict_lines: int  #: lines ``predict --json`` printed (one per sample)
    predict_error: str
    agent_survived: bool  #: running until it was asked to stop, then exited 0
    peak_bytes: int  #: the cgroup's high-water mark: anonymous memory and page cache
    anon_peak_bytes: int  #: the most anonymous memory sampled (page cache excluded)
    oom_kills: int
    log: str = field(repr=False)


def write_device_npz(path: Path, federation_data) -> None:
    """One device's own images as a Pi holds them: raw pixels and class names in a ``.npz``."""
    from edgepfl.data import client_indices, load_pool

    spec = federation_data.model_copy(update={"num_clients": PARTITIONS, "samples_per_client": None})
    pool = load_pool(spec)
    train, test = client_indices(spec, DEVICE_PARTITION)
    idx = np.sort(np.concatenate([train, test]))
    np.savez(path, x=np.asarray(pool.pixels[idx]), y=np.asarray(pool.y[idx]),
             class_names=np.asarray(pool.class_names))


def _anon_sampler(group: MemoryCgroup, stop: threading.Event, peak: list[int]) -> None:
    while not stop.wait(0.05):
        try:
            peak[0] = max(peak[0], group.anon_bytes)
        except (OSError, KeyError, ValueError):
            return


def run_head_device(venv_bin: Path, group: MemoryCgroup, broker_url: str, work: Path, *,
                    drop_page_cache: bool = False, head: str = "svm") -> DeviceRun:
    """The scenario in ``group``; ``venv_bin``: the torch-free environment's ``bin``.
    ``drop_page_cache``: empty the machine's page cache first (root), so that the device's
    libraries are read in anew and charged to ``group`` as they are on a board after boot."""
    config = run_config(method={"name": "fedavg"}, rounds=2, release_at_end=True, data={"samples_per_client": 300})
    out = work / "run"
    device_data = work / "device.npz"
    write_device_npz(device_data, config.data)
    sample = work / "pixels.npy"
    np.save(sample, np.load(device_data)["x"][:SAMPLES])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    edgepfl = str(venv_bin / "edgepfl")
    log_path = work / "pi.log"
    stop, anon = threading.Event(), [0]
    sampler = threading.Thread(target=_anon_sampler, args=(group, stop, anon), daemon=True)
    with RunningFleet(config, out, broker_url, 2) as fleet:
        cfg = fleet.config.model_copy(update={"data": fleet.config.data.model_copy(update={"num_clients": 3})})
        head_cfg = agent_config(cfg, out, broker_url, "pi-00", 2, "head", head, 1)
        own_data = type(cfg.data)(dataset="npz", root=str(device_data), num_clients=1)
        head_cfg = head_cfg.model_copy(update={"data": own_data, "client_index": 0})
        path = work / "pi.yaml"
        path.write_text(yaml.safe_dump(head_cfg.model_dump(mode="json")))
        if drop_page_cache:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1")
        started = time.monotonic()
        sampler.start()
        pi = subprocess.Popen(group.command([edgepfl, "--log-level", "info", "agent", "--config", str(path)]),
                              stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, cwd="/", env=env)
        serve: dict | None = None
        serve_error = predict_error = ""
        predict_lines = 0
        try:
            fleet_ = MqttFleet(cfg.federation, cfg.broker, url=broker_url)
            Coordinator(cfg, fleet_, out, progress=False, **fleet.shape()).run()
            fleet_.close()
            metrics = out / "head_metrics.json"
            entries = list(json.loads(metrics.read_text()).values()) if metrics.is_file() else []
            report = entries[0]["reports"].get("pi-00") if entries else None
            install_seconds = time.monotonic() - started if report else None
            state = Path(head_cfg.state_dir)
            if report:  # serve and predict beside the resident agent, in the same cap
                record = json.loads((state / "release.json").read_text())
                server = subprocess.run(group.command([edgepfl, "serve", "--state", str(state)]),
                                        input=json.dumps({"id": "a", "inputs": [str(sample)]}) + "\n",
                                        capture_output=True, text=True, cwd="/", env=env, timeout=300)
                lines = [line for line in server.stdout.splitlines() if line.strip()]
                serve = json.loads(lines[0]) if server.returncode == 0 and len(lines) == 1 else None
                serve_error = server.stderr[-2000:] if serve is None else ""
                predicted = subprocess.run(group.command([
                    edgepfl, "predict", "--json", "--encoder", str(state / record["encoder_file"]),
                    "--head", str(state / record["head_file"]), str(sample)]),
                    capture_output=True, text=True, cwd="/", env=env, timeout=300)
                predict_lines = len([line for line in predicted.stdout.splitlines() if line.strip()])
                predict_error = predicted.stderr[-2000:] if predicted.returncode else ""
        finally:
            alive = pi.poll() is None
            pi.terminate()
            pi.wait(timeout=60)
            stop.set()
            sampler.join(timeout=5)
    return DeviceRun(report=report, install_seconds=install_seconds, serve=serve, serve_error=serve_error,
                     predict_lines=predict_lines, predict_error=predict_error,
                     agent_survived=alive and pi.returncode == 0, peak_bytes=group.peak_bytes,
                     anon_peak_bytes=anon[0], oom_kills=group.oom_kills, log=log_path.read_text(errors="replace"))
