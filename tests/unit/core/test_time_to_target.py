"""The time-to-target estimator of benchmarks/async_time_to_accuracy.py: over the whole fleet,
and held, not touched. The estimator it replaces declared buffered runs at target while no
slow device had reported (8.5-19.6x "speed-ups" against 1.3-4.7x sustained, #52)."""

from __future__ import annotations

import pytest

from benchmarks.async_time_to_accuracy import (
    class_shares,
    curve,
    curve_end,
    naive_to_target,
    to_target,
)
from edgepfl.metrics import RoundMetrics


def row(r: int, per_client: dict[str, float], seconds: float = 1.0, share: dict[str, float] | None = None,
        final: bool = False) -> RoundMetrics:
    return RoundMetrics(round=r, final=final, accuracy=None, per_client=per_client, participants=sorted(per_client),
                        sampled=sorted(per_client), evaluated=len(per_client), dropped=[], rejected={}, aborted=False,
                        train_loss=None, bytes_up=100, bytes_down=100, shared_bytes=0, seconds=seconds,
                        update_share=share or {})


CLASSES = {"fast-1": "fast", "fast-2": "fast", "slow": "slow"}


def test_the_fleets_accuracy_waits_for_every_device_class_and_the_target_must_hold():
    rows = [
        row(0, {"fast-1": 0.9, "fast-2": 0.9}),  # only the fast devices so far: not the fleet's accuracy
        row(1, {"fast-1": 0.95}),
        row(2, {"slow": 0.3}),  # the slow device's first report pulls the mean down
        row(3, {"slow": 0.85}),  # (0.95 + 0.9 + 0.85) / 3 = 0.9: reached ...
        row(4, {"fast-2": 0.6}),  # ... but not held
        row(5, {"fast-2": 0.95}),  # reached again, and held to the end
        row(6, {"slow": 0.9}),
        row(7, {}, final=True),
    ]
    points = curve(rows, CLASSES)
    assert [acc is None for _, _, acc in points] == [True, True, False, False, False, False, False]
    assert to_target(points, 0.9) == (6.0, 1200)  # from row 5 on: 6 s, 6 rows of 200 bytes
    # the old estimator: the first touch, by whoever had reported (the fast devices, at once)
    assert naive_to_target(curve(rows), 0.9) == (1.0, 200)
    assert to_target(points, 0.99) == (None, None)


def test_a_device_classs_share_is_its_devices_mean_share_of_a_states_change():
    rows = [row(0, {}, share={"fast-1": 0.5, "fast-2": 0.5}), row(1, {}, share={"fast-1": 0.4, "slow": 0.4}),
            row(2, {}, final=True)]
    classes = {"fast-1": "fast", "fast-2": "fast", "slow": "slow"}
    assert class_shares(rows, classes) == {"fast": 0.7, "slow": 0.2}


def test_a_sleeper_heard_late_does_not_hold_the_curve_back_and_the_target_lies_on_the_same_curve():
    """The curve waits for a device of every class, not for every device: the sleepiest
    device's first report came 300 s into both modes' runs on the sleepy fleet, the fleet's
    wake-up times, not what a mode does (#52). And the final evaluation sends the last state
    to every sleeper, so 95 % of it may lie above everything the curve reaches, where each
    sleeper holds the state of its last round."""
    classes = {"fast-1": "fast", "slow": "slow", "sleepy-1": "sleepy", "sleepy-2": "sleepy"}
    rows = [
        row(0, {"fast-1": 0.5, "slow": 0.4}),
        row(1, {"fast-1": 0.9, "sleepy-1": 0.3}),  # every class has reported; sleepy-2 has not
        row(2, {"fast-1": 0.92, "slow": None}),  # sent a state, no report: the slow device's 0.4 stands
        row(3, {"fast-1": 0.95, "slow": 0.9, "sleepy-1": 0.9, "sleepy-2": 0.9}, final=True),
    ]
    points = curve(rows, classes)
    assert [acc for _, _, acc in points] == [None, pytest.approx((0.9 + 0.4 + 0.3) / 3), pytest.approx(0.54)]
    assert curve_end(points) == pytest.approx(0.54)
    assert to_target(points, 0.95 * 0.9) == (None, None)  # 95 % of the final evaluation: never held
    assert to_target(points, 0.95 * curve_end(points)) == (2.0, 400)
    assert curve_end([(1.0, 1, None)]) is None
