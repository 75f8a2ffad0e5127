"""Helpers for tests that run real agent processes against a real broker."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

from edgepfl.config import RunConfig, parse_config
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.metrics import RoundMetrics, read_metrics
from edgepfl.simulation import FleetTiming
from edgepfl.state import load_checkpoint


def run_config(federation: str | None = None, **overrides) -> RunConfig:
    """A small, fast FMNIST federation (falls back to digits only where FMNIST is absent)."""
    base = {
        "federation": federation or f"t{uuid.uuid4().hex[:10]}",
        "method": {"name": "fedavg"},
        "model": {"arch": "cnn", "feature_dim": 32},
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "data": {"dataset": "auto", "samples_per_client": 200, "partition": {"kind": "dirichlet", "alpha": 0.5}},
        "rounds": 3,
        "round_timeout_s": 60,
        "wait_for_agents_s": 180,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return parse_config(RunConfig, base, "test config")


class RunningFleet:
    """N real agent processes for one federation; stops them on exit."""

    def __init__(self, config: RunConfig, out: Path, url: str, agents: int):
        self.config = prepare(config, agents)
        self.out = Path(out)
        self.url = url
        self.ids = agent_ids(agents)
        self.procs = {}

    def start_agent(self, index: int):
        agent_id = self.ids[index]
        pace = None
        if self.config.simulation.pace_processes:  # as `simulate` paces them
            pace = FleetTiming(self.config.simulation, self.ids, self.config.seed)[agent_id].pace
        self.procs[agent_id] = spawn_agent(self.config, self.out, self.url, agent_id, index, pace=pace)
        return self.procs[agent_id]

    def __enter__(self) -> RunningFleet:
        for i in range(len(self.ids)):
            self.start_agent(i)
        return self

    def __exit__(self, *exc) -> None:
        stop_agents(list(self.procs.values()))

    def log(self, agent_id: str) -> str:
        path = self.out / "agents" / f"{agent_id}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def shape(self) -> dict:
        return data_shape(self.config)


def run_in_thread(target) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def wrapper():
        try:
            box["result"] = target()
        except BaseException as exc:  # surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=wrapper, daemon=True)
    thread.start()
    return thread, box


def read_rows(out: Path) -> list[RoundMetrics]:
    path = Path(out) / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def checkpoint_tensors(directory: Path) -> dict:
    """The flattened tensors of the checkpoint in ``directory`` (``global::<key>``, ``client::...``)."""
    found = load_checkpoint(directory)
    assert found is not None, f"no checkpoint in {directory}"
    return found[0].to_flat()


def release_frame(federation: str, release_dir: Path, round: int) -> bytes:
    """A release frame of an exported encoder (``export_dir``), as a coordinator sends it on an
    agent's task topic (unsigned, no sequence)."""
    import hashlib

    import numpy as np

    from edgepfl.export.onnx_export import read_release
    from edgepfl.protocol import MessageType, ReleaseMeta, encode

    manifest, artifact = read_release(release_dir)
    meta = ReleaseMeta(release_id=manifest.release_id, manifest=manifest, sha256=hashlib.sha256(artifact).hexdigest(),
                       size_bytes=len(artifact))
    return encode(MessageType.RELEASE, federation=federation, sender="coordinator", round=round, meta=meta,
                  tensors={"artifact": np.frombuffer(artifact, dtype=np.uint8)})


def retained_state(url: str, topic: str) -> str | None:
    """The ``state`` of the status retained on ``topic`` (None: nothing retained)."""
    from edgepfl.protocol import StatusMeta, decode
    from edgepfl.testing import TrafficCapture

    capture = TrafficCapture(url, topic, include_retained=True).start()
    try:
        try:
            messages = capture.wait_for(lambda m: m, timeout=2)
        except TimeoutError:
            return None
        return decode(messages[-1][1]).meta_as(StatusMeta).state
    finally:
        capture.stop()
