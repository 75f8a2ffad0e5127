"""A straggler's late update: its change from the state it was trained
on, discounted by ``(1 + staleness) ** -0.5``, applied to a newer state (a variance never
below zero). The whole behaviour on the virtual clock, a device slower than the deadline
in a live round: tests/integration/rounds/test_stragglers_live.py."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.aggregation import rebase, staleness_weight


def test_a_late_change_is_applied_to_the_newer_state_discounted_by_its_staleness():
    rng = np.random.default_rng(0)
    zero = np.zeros(3, np.float32)
    base = {"w": rng.normal(size=5).astype(np.float32), "bn.running_mean": zero, "bn.running_var": np.ones(3, np.float32)}
    newer = {"w": base["w"] + 1.0, "bn.running_mean": zero, "bn.running_var": np.full(3, 0.5, np.float32)}
    update = {"w": base["w"] + 0.2, "bn.running_mean": zero, "bn.running_var": np.full(3, 0.1, np.float32)}
    assert staleness_weight(0) == 1.0 and staleness_weight(1) == pytest.approx(2 ** -0.5)
    assert staleness_weight(3, exponent=1.0) == 0.25
    moved = rebase(update, base, newer, factor=0.5)
    np.testing.assert_allclose(moved["w"], newer["w"] + 0.1, rtol=1e-6)
    # a statistic is an estimate, mixed in: 0.5 + 0.5 * (0.1 - 0.5) = 0.3 (as a change from
    # its base, 0.5 + 0.5 * (0.1 - 1), it would be negative)
    np.testing.assert_allclose(moved["bn.running_var"], 0.3, rtol=1e-6)
    np.testing.assert_allclose(rebase(update, base, newer, factor=1.0)["bn.running_var"], 0.1, rtol=1e-6)


def test_late_updates_never_drive_the_fleets_variance_to_zero():
    """Found on a 50-device buffered fleet: the devices' variance estimates far below the
    initial state's (1), and most updates trained on a state behind. Rebased as changes from
    their base, the state's variance went to 0 within a few states, and the update bound (in
    units of it) then clamped every honest update. Mixed in, it stays within the estimates."""
    from edgepfl.aggregation import Mean

    rng = np.random.default_rng(1)
    states = [{"bn.running_mean": np.zeros(4, np.float32), "bn.running_var": np.ones(4, np.float32)}]
    for _ in range(20):
        rule = Mean()
        rule.begin(states[-1])
        for device in range(10):
            behind = device % 4
            base = states[max(0, len(states) - 1 - behind)]
            estimate = {"bn.running_mean": rng.normal(0, 0.1, 4).astype(np.float32),
                        "bn.running_var": rng.uniform(0.01, 0.1, 4).astype(np.float32)}
            rule.add(rebase(estimate, base, states[-1], staleness_weight(behind)), weight=10)
        states.append(rule.result())
    variances = np.stack([s["bn.running_var"] for s in states])
    assert variances.min() >= 0.01 * (1 - 1e-6) and variances[-1].max() <= 0.1
