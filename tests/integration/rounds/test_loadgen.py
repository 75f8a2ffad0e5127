"""The load generator and the capacity benchmark, small: so that neither can rot unnoticed.

50 virtual agents (benchmarks/loadgen.py: one MQTT connection each, driven by one event
loop per process) against the real ``edgepfl coordinator`` process and a real Mosquitto,
through benchmarks/capacity.py. With ``fraction`` and ``eval_fraction`` set, this is also
evaluation sampling over MQTT: the agents count the tasks of each kind they were sent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT, require_mosquitto

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def test_fifty_virtual_agents_run_a_sampled_federation_against_the_real_coordinator(tmp_path: Path):
    require_mosquitto()
    import capacity

    args = argparse.Namespace(rounds=2, fraction=0.2, eval_fraction=0.4, arch="mlp", feature_dim=16,
                              local_work_s=0.05, processes=2, round_timeout_s=60, timeout_s=240)
    run = capacity.measure(50, args, tmp_path)
    # rounds 0 and 1 train 10 agents and evaluate 20 (the 10 trainers + 10 evaluate tasks);
    # the final round evaluates 40 % of the fleet: 20 evaluate tasks
    assert run["loadgen"]["tasks"] == {"train": 20, "evaluate": 40}
    assert run["loadgen"]["answers"] == 60 and run["loadgen"]["rejected"] == 0
    assert run["loadgen"]["disconnects"] == 0 and run["loadgen"]["connected"] == 50
    (row,) = run["rounds"]  # round 1: rounds 1..R-1 are measured
    assert row["participants"] == 10 and row["evaluated"] == 20 and row["dropped"] == 0
    # every update made it through the gate and into the aggregate: 10 model-sized uploads
    assert row["bytes_up"] > 10 * run["shared_bytes"]
    assert row["bytes_down"] > 20 * run["shared_bytes"]
    assert run["coordinator_peak_rss_mb"] > 0 and run["broker_peak_rss_mb"] > 0
    assert run["coordinator_cpu_ms_per_agent_round"] > 0
