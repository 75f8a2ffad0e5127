"""The in-process simulator runs on virtual time (issue #31, item 1): devices differ by
their profile, deadlines pass in simulated device time, and the host's load changes
nothing — the same seed gives the same ``metrics.jsonl`` bit for bit, idle or beside a
CPU hog, and no client is dropped because the host is slow.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from edgepfl.config import RunConfig
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.metrics import read_metrics
from edgepfl.simulation import Availability, DeviceClass, FleetTiming, SimulationSpec, task_samples


# --------------------------------------------------------------------------- the timing model
def test_agents_are_dealt_to_classes_by_share_reproducibly():
    spec = SimulationSpec(devices=[DeviceClass(name="jetson", share=3), DeviceClass(name="pi", share=1)])
    ids = [f"agent-{i:02d}" for i in range(10)]
    first = {a: d.profile.name for a, d in FleetTiming(spec, ids, seed=7).devices.items()}
    again = {a: d.profile.name for a, d in FleetTiming(spec, ids, seed=7).devices.items()}
    other = {a: d.profile.name for a, d in FleetTiming(spec, ids, seed=8).devices.items()}
    assert first == again
    assert list(first.values()).count("pi") in (2, 3) and list(first.values()).count("jetson") in (7, 8)
    assert first != other  # another seed, another dealing (for these ten agents)


def test_work_stops_while_a_device_is_offline_and_resumes_when_it_is_back():
    availability = Availability(100.0, 50.0, np.random.default_rng(3))
    t, on = 0.0, []
    while t < 2000:
        on.append((t, availability.online_at(t)))
        t = availability.next_change(t)
    assert any(not state for _, state in on) and any(state for _, state in on)
    for start in (0.0, 17.0, 333.0, 1200.0):
        busy = 40.0
        done = availability.finish(start, busy)
        # the online time between start and done is exactly the work
        grid = np.linspace(start, done, 40001)
        online_share = np.mean([availability.online_at(x) for x in grid[:-1]])
        assert online_share * (done - start) == pytest.approx(busy, rel=2e-3)


def test_a_slow_link_and_a_slow_device_take_what_their_profile_says():
    spec = SimulationSpec(devices=[DeviceClass(seconds_per_sample=0.01, downlink_mbps=8, uplink_mbps=1, latency_ms=100)])
    device = FleetTiming(spec, ["a"], seed=0)["a"]
    samples = task_samples("train", num_train=300, num_test=90, epochs=2)
    assert samples == 2 * 300 + 90 / 3
    arrives = device.answer_time(10.0, task_bytes=1_000_000, samples=samples, answer_bytes=500_000)
    assert arrives == pytest.approx(10.0 + 0.1 + 1.0 + 6.3 + 4.0 + 0.1)
    # a second task waits for the first: one device computes one task at a time
    second = device.answer_time(10.0, task_bytes=1_000_000, samples=samples, answer_bytes=500_000)
    assert second == pytest.approx(arrives + 6.3 + 4.0)


# --------------------------------------------------------------------------- whole runs
def _config(**overrides) -> RunConfig:
    base = dict(federation="vclock", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "num_clients": 4},
                rounds=3, min_agents=4, device="cpu", seed=5, round_timeout_s=2.0)
    base.update(overrides)
    return RunConfig.model_validate(base)


def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
