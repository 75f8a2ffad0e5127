"""Every trainer task says how inputs are preprocessed: the ``edgepfl coordinator``
service, as a process over Mosquitto, never sends a task without the normalization, even
with a configured data shape (the trainer and the simulator in process:
tests/unit/data/test_preprocessing.py)."""

from __future__ import annotations

import subprocess
import sys

import yaml

from edgepfl.config import RunConfig
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import decode
from edgepfl.testing import TrafficCapture

from tests.fleet_helpers import run_config


def test_the_coordinator_service_with_a_configured_shape_still_sends_the_data_s_normalization(mosquitto, tmp_path):
    """The case that went wrong: ``edgepfl coordinator`` with input_shape and num_classes in its
    config sent trainer tasks with ``normalization: null``. A plain MQTT subscriber reads
    the task frames off the broker."""
    base = run_config(rounds=1, min_agents=2, model={"arch": "mlp", "feature_dim": 16}, device="cpu",
                      data={"dataset": "digits", "samples_per_client": 60}, broker={"url": mosquitto.url},
                      wait_for_agents_s=120)
    config = prepare(base, 2).model_copy(update={"input_shape": [1, 8, 8], "num_classes": 10})
    expected = data_shape(config)["normalization"]
    cfg = tmp_path / "coordinator.yaml"
    cfg.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
    capture = TrafficCapture(mosquitto.url, topic=f"edgepfl/v1/{config.federation}/agents/+/task").start()
    agents = [spawn_agent(config, tmp_path, mosquitto.url, a, i) for i, a in enumerate(agent_ids(2))]
    try:
        proc = subprocess.run([sys.executable, "-m", "edgepfl.cli", "coordinator", "--config", str(cfg),
                               "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        stop_agents(agents)
        capture.stop()
    tasks = [decode(payload) for payload in capture.payloads("/task")]
    assert len(tasks) >= 2
    for task in tasks:
        assert task.meta.run.data.input_shape == (1, 8, 8)
        assert task.meta.run.data.normalization is not None
        assert task.meta.run.data.normalization.model_dump() == expected
    assert RunConfig.model_validate(yaml.safe_load(cfg.read_text())).normalization is None
