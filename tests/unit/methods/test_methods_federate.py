"""Every built-in method trains in a real federation, in process.

Each method runs from its shipped ``configs/<method>.yaml`` (so the configs are
proven runnable, not only parseable), shrunk to 2 rounds of 3 agents on tiny data
(120 samples per client, feature_dim 16); the coordinator and trainer runtime run as
objects (about a second a method). The run must produce a finite accuracy in every
round, and every agent must have trained in every round. The same runs over Mosquitto,
every agent a process: tests/integration/methods/test_methods_federate_mqtt.py.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest
import yaml

from edgepfl.config import RunConfig, parse_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.methods import METHODS
from edgepfl.metrics import RoundMetrics

from tests.conftest import require_fmnist

REPO = Path(__file__).resolve().parents[3]
AGENTS = 3
ROUNDS = 2


@pytest.fixture(scope="module", autouse=True)
def _fmnist():
    require_fmnist()


def tiny_config(method: str) -> RunConfig:
    """``configs/<method>.yaml`` with the fleet, data and model made tiny."""
    data = yaml.safe_load((REPO / "configs" / f"{method}.yaml").read_text())
    data["federation"] = f"{data['federation']}-{uuid.uuid4().hex[:8]}"  # no retained messages shared
    data["rounds"] = ROUNDS
    data["model"]["feature_dim"] = 16
    data["data"]["samples_per_client"] = 120
    data["round_timeout_s"] = 120
    data["wait_for_agents_s"] = 180
    data["device"] = "cpu"
    return parse_config(RunConfig, data, f"configs/{method}.yaml (tiny)")


def check_rows(rows: list[RoundMetrics], summary: dict) -> None:
    assert [r.round for r in rows] == list(range(ROUNDS + 1)) and rows[-1].final
    for r in rows:
        assert r.accuracy is not None and math.isfinite(r.accuracy) and 0.0 <= r.accuracy <= 1.0, r
        assert r.evaluated == AGENTS and not r.dropped and not r.rejected, r
    expected = [f"agent-{i:02d}" for i in range(AGENTS)]
    for r in rows[:-1]:
        assert r.participants == expected, r  # every agent trained in every round
        assert r.train_loss is not None and math.isfinite(r.train_loss), r
    assert math.isfinite(summary["final_accuracy"])


@pytest.mark.parametrize("method", METHODS)
def test_method_federates_in_process(method, tmp_path):
    rows, summary = simulate(tiny_config(method), AGENTS, tmp_path / "run", in_process=local_trainers, progress=False)
    check_rows(rows, summary)
