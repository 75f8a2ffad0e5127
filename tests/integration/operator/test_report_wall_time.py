"""The run report tells the truth: a real run's report gives its real wall time (the rest
of the report: tests/unit/coordinator/test_report.py)."""

from __future__ import annotations

import time

import pytest

from edgepfl.coordinator.ops.report import write_report
from edgepfl.metrics import read_run_times


def test_a_runs_report_gives_its_real_wall_time(tmp_path):
    from edgepfl.config import RunConfig
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
    from edgepfl.edge_agent.tiers import local_trainers

    config = prepare(RunConfig(federation="walltime", method={"name": "fedavg"},
                               model={"arch": "mlp", "feature_dim": 16}, train={"epochs": 1, "batch_size": 32},
                               data={"dataset": "digits"}, rounds=2, min_agents=2, device="cpu"), 2)
    out = tmp_path / "run"
    coordinator = Coordinator(config, LocalFleet(local_trainers(config, agent_ids(2), out), config.federation), out,
                              progress=False,
                              **data_shape(config))
    coordinator.init_or_resume()
    started = time.time()
    coordinator.run()
    elapsed = time.time() - started
    _, summary = write_report(out, "fedavg")
    times = read_run_times(out)
    assert len(times.sessions) == 1 and times.sessions[0].resumed_from is None and not summary["resumed"]
    assert summary["wall_seconds"] == pytest.approx(elapsed, abs=0.5)
    # in-process rounds run on the simulation's clock: their seconds are the devices' simulated time
    assert times.sessions[0].virtual_clock and summary["round_clock"] == "virtual"
    assert summary["round_seconds"] > 0
