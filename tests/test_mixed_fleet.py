"""A mixed fleet over Mosquitto: trainer agents train, the coordinator releases the
frozen encoder, head-tier agents (torch-free) fit their heads and report."""

from __future__ import annotations

import json

import pytest

from edgepfl.coordinator.simulate import simulate
from edgepfl.protocol import decode

from fleet_helpers import run_config

pytestmark = pytest.mark.slow


def test_mixed_fleet_reports_both_tiers(mosquitto, broker_capture, tmp_path):
    config = run_config(method={"name": "fedavg"}, rounds=3, data={"samples_per_client": 300})
    out = tmp_path / "run"
    rows, summary = simulate(config, 3, out, broker=mosquitto.url, head_agents=2, head="lr", progress=False)

    # trainer tier: the usual per-round personalized accuracy
    assert rows[-1].final and set(rows[-1].per_client) == {"agent-00", "agent-01", "agent-02"}
    # head tier: both devices installed the release, fitted a head on their own data and reported
    heads = json.loads((out / "head_metrics.json").read_text())
    assert set(heads) == {"device-00", "device-01"}
    for report in heads.values():
        assert report["tier"] == "head" and report["head"] == "lr" and report["total"] > 0
        assert report["accuracy"] > 0.3  # 10 classes: far above chance on data no trainer saw
    assert summary["head_tier"] == heads
    releases = [decode(p) for t, p in broker_capture.snapshot() if t.endswith("/release")]
    assert len(releases) == 1 and releases[0].meta.release_id == next(iter(heads.values()))["release_id"]
    # the head agents' torch-free path: nothing in their logs came from the trainer runtime
    for device in ("device-00", "device-01"):
        log = (out / "agents" / f"{device}.log").read_text()
        assert "edgepfl.edge_agent.trainer" not in log and "Traceback" not in log
    assert "head-tier agents:" in (out / "results.txt").read_text()
