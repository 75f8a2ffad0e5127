"""A straggler's late update (issue #31, item 4): its change from the state it was trained
on, discounted by ``(1 + staleness) ** -0.5``, applied to a newer state (a variance never
below zero). The whole behaviour on the virtual clock, a device slower than the deadline
in a live round: tests/integration/test_stragglers.py."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.aggregation import rebase, staleness_weight


def test_a_late_change_is_applied_to_the_newer_state_discounted_by_its_staleness():
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=5).astype(np.float32), "bn.running_var": np.ones(3, np.float32)}
    newer = {"w": base["w"] + 1.0, "bn.running_var": np.full(3, 0.5, np.float32)}
    update = {"w": base["w"] + 0.2, "bn.running_var": np.full(3, 0.1, np.float32)}
    assert staleness_weight(0) == 1.0 and staleness_weight(1) == pytest.approx(2 ** -0.5)
    assert staleness_weight(3, exponent=1.0) == 0.25
    moved = rebase(update, base, newer, factor=0.5)
    np.testing.assert_allclose(moved["w"], newer["w"] + 0.1, rtol=1e-6)
    # 0.5 + 0.5 * (0.1 - 1) = 0.05; a variance is never pushed below 0
    np.testing.assert_allclose(moved["bn.running_var"], 0.05, rtol=1e-6)
    assert rebase(update, base, newer, factor=1.0)["bn.running_var"].min() == 0.0
