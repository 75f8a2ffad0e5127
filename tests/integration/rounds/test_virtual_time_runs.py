"""The in-process simulator runs on virtual time: devices differ by
their profile, deadlines pass in simulated device time, and the host's load changes
nothing — the same seed gives the same ``metrics.jsonl`` bit for bit, idle or beside a
CPU hog, and no client is dropped because the host is slow.

The timing model alone: tests/unit/core/test_virtual_clock.py.
"""

from __future__ import annotations

import subprocess
import sys

from edgepfl.config import RunConfig
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.metrics import read_metrics
from edgepfl.simulation import DeviceClass, FleetTiming


# --------------------------------------------------------------------------- whole runs
def _config(**overrides) -> RunConfig:
    base = dict(federation="vclock", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "num_clients": 4},
                rounds=3, min_agents=4, device="cpu", seed=5, round_timeout_s=2.0)
    base.update(overrides)
    return RunConfig.model_validate(base)


def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_the_same_seed_gives_the_same_metrics_bit_for_bit_idle_or_beside_a_cpu_hog(tmp_path):
    """A 2 s round deadline, on a host where a round's training alone takes longer than that
    once two busy loops share the cores: the rows are identical and nobody is dropped."""
    config = _config()
    simulate(config, 4, tmp_path / "idle", in_process=local_trainers, progress=False)
    hogs = _hogs(2)
    try:
        simulate(config, 4, tmp_path / "loaded", in_process=local_trainers, progress=False)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    idle = (tmp_path / "idle" / "metrics.jsonl").read_bytes()
    assert idle == (tmp_path / "loaded" / "metrics.jsonl").read_bytes()
    rows = read_metrics(tmp_path / "idle")
    assert all(row.dropped == [] and row.rejected == {} and len(row.participants) == 4 for row in rows if not row.final)


def test_a_device_slower_than_the_deadline_is_dropped_by_its_profile_alone(tmp_path):
    """One device of four is 50x slower: its answer comes after the (virtual) deadline in
    every run, whatever the host; the round closes on the quorum without it."""
    slow = DeviceClass(name="pi-zero", share=1, seconds_per_sample=0.05)
    fast = DeviceClass(name="jetson", share=3, seconds_per_sample=0.001)
    config = _config(simulation={"devices": [fast.model_dump(), slow.model_dump()]}, round_timeout_s=5.0)
    timing = FleetTiming(config.simulation, [f"agent-{i:02d}" for i in range(4)], config.seed)
    laggard = next(a for a, d in timing.devices.items() if d.profile.name == "pi-zero")
    rows, _ = simulate(config, 4, tmp_path / "a", in_process=local_trainers, progress=False)
    again, _ = simulate(config, 4, tmp_path / "b", in_process=local_trainers, progress=False)
    assert (tmp_path / "a" / "metrics.jsonl").read_bytes() == (tmp_path / "b" / "metrics.jsonl").read_bytes()
    assert rows[0].dropped == [laggard] and laggard not in rows[0].participants
    assert all(laggard not in row.participants for row in rows if not row.final)
    # the round closed at its deadline (virtual seconds), not when the laggard finished
    assert 5.0 <= rows[0].seconds < 6.0


def test_devices_that_come_and_go_are_sampled_while_online_and_waited_for_only_while_online(tmp_path):
    """Devices online a third of the time, rounds of about 9 virtual seconds: statuses go off
    and on in virtual time, only online devices are sampled, a device that goes offline
    mid-task is dropped when the round closes on its quorum, and over the run most
    devices train."""
    sometimes = DeviceClass(seconds_per_sample=0.02, mean_online_s=15.0, mean_offline_s=30.0)
    config = _config(simulation={"devices": [sometimes.model_dump()]}, min_agents=1, rounds=8, round_timeout_s=30.0)
    rows, _ = simulate(config, 4, tmp_path / "run", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    assert all(len(row.sampled) < 4 for row in training)  # never all four online at a round's start
    assert any(row.dropped and len(row.participants) >= 1 for row in training)  # closed on quorum, not at 2 x timeout
    assert len({a for row in training for a in row.participants}) >= 3


def test_a_time_budget_ends_training_on_the_fleets_clock_and_evaluates(tmp_path):
    """time_budget_s: training stops at the first round that would start past the budget
    (virtual seconds here, so the same rounds on any host), then the final evaluation."""
    from edgepfl.config import RunConfig
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers

    base = dict(federation="budget", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "num_clients": 4}, rounds=50,
                device="cpu", seed=3, simulation={"devices": [{"seconds_per_sample": 0.01}]})
    unbounded, _ = simulate(RunConfig.model_validate({**base, "rounds": 6}), 4, tmp_path / "a",
                            in_process=local_trainers, progress=False)
    per_round = unbounded[0].seconds
    budget = 3.5 * per_round
    rows, _ = simulate(RunConfig.model_validate({**base, "time_budget_s": budget}), 4, tmp_path / "b",
                       in_process=local_trainers, progress=False)
    training, final = rows[:-1], rows[-1]
    assert final.final and final.round == len(training) == 4  # rounds 0-3 start within 3.5 rounds' time
    assert sum(r.seconds for r in training[:-1]) < budget <= sum(r.seconds for r in training)
    assert [r.accuracy for r in training] == [r.accuracy for r in unbounded[:4]]
