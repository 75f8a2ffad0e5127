"""The virtual clock's timing model: agents dealt to device classes by
share, devices coming and going, what a slow link and a slow device take. Whole runs on
virtual time, idle and beside a CPU hog: tests/integration/rounds/test_virtual_time_runs.py."""

from __future__ import annotations

import numpy as np
import pytest

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
