"""The streaming means: :class:`Mean` (FedAvg) and :class:`NormClippedMean`, folded in on
arrival into an exact sum (memory O(model) whatever the number of agents)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from .contract import MAX_UPDATE_WEIGHT, Aggregator, TensorDict, _norm
from .exact import _ExactSum
from .partial import PartialSum, words_total
from .weights import rebase


class SummingRule(Aggregator):
    """A rule whose state over some updates is an exact sum (:attr:`sum_`) and counts that add
    to another instance's (:meth:`partial`, :meth:`add_partial`): it *composes*. A site
    aggregator sums its devices' updates, the central coordinator the sites' sums, and the
    result is the flat fleet's bit for bit (:mod:`.partial`). A rule that needs every single
    update (the robust ones) is not one."""

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)
        #: updates the rule's own clip shortened (a rule with one)
        self.clipped_ = 0

    def partial(self) -> PartialSum:
        """This round's sum so far, to be folded into the same rule begun with the same reference elsewhere."""
        low, high = self.sum_.words()
        return PartialSum(low, high, total_weight=self.sum_.total_weight, count=self.count_,
                          clipped=self.bound_clipped_, rule_clipped=self.clipped_,
                          change_norms=tuple(self.change_norms_))

    def partial_change(self, partial: PartialSum, keys: Iterable[str],
                       base: Mapping[str, np.ndarray] | None = None) -> tuple[float, float]:
        """The norm over ``keys`` of what ``partial`` sums (the weighted changes ``w * (x - reference)``
        of its updates), and how much the grid's rounding can account for (half a step a
        coordinate per update). ``partial`` must have passed :meth:`PartialSum.check`; ``base``:
        the reference it was summed over, when not this round's (:meth:`add_stale_partial`)."""
        grid = self.sum_ if base is None else _ExactSum(base)
        total = slack = 0.0
        for key in keys:
            value, step = self.partial_totals(partial, key, grid)
            total += float(np.sum(value * value))
            slack += value.size * step**2
        return math.sqrt(total), math.sqrt(slack)

    def partial_totals(self, partial: PartialSum, key: str, grid: _ExactSum | None = None) -> tuple[np.ndarray, float]:
        """What ``partial`` sums of ``key`` (``w * (x - reference)`` over its updates), as
        floats, and how much the grid's rounding can account for in one coordinate (``grid``:
        the one it was summed on, when not this round's)."""
        scale = (grid or self.sum_).scale[key]
        return words_total(partial.low[key], partial.high[key]) / scale, 0.5 * partial.count / scale

    def add_partial(self, partial: PartialSum) -> None:
        """Fold in another instance's :meth:`partial` over the same reference, as if its updates
        had been added here; :class:`AggregationRejected` for one that cannot be, checked before
        any of it counts (it may have come over the network)."""
        if not self.reference_:
            raise RuntimeError("begin() first")
        partial.check(self.reference_)
        self.sum_.add_partial(partial)
        self.count_ += partial.count
        self.bound_clipped_ += partial.clipped
        self.clipped_ += partial.rule_clipped
        self._add_norms(partial)


    def add_stale_partial(self, partial: PartialSum, base: Mapping[str, np.ndarray], discount: float) -> None:
        """Fold in a partial sum made over an older reference ``base`` (a summary site answering
        a buffered run's earlier state): the mean of its updates, moved onto this round's
        reference as each late update would be (:func:`.weights.rebase`, ``discount``), weighing
        their total weight. Not bit-exact, as a late update is not: the old sum is read once as
        floats. :class:`AggregationRejected` for one that cannot be, before any of it counts."""
        if not self.reference_:
            raise RuntimeError("begin() first")
        partial.check(base)
        old = _ExactSum(base)
        old.add_partial(partial)
        moved = rebase(old.mean(), base, self.reference_, discount)
        self.sum_.check(moved, min(partial.total_weight, MAX_UPDATE_WEIGHT))
        left = partial.total_weight
        while left > 0:  # one grid contribution holds at most MAX_UPDATE_WEIGHT of weight
            self.sum_.add(moved, min(left, MAX_UPDATE_WEIGHT))
            left -= MAX_UPDATE_WEIGHT
        self.count_ += partial.count
        self.bound_clipped_ += partial.clipped
        self.clipped_ += partial.rule_clipped
        self._add_norms(partial)


    def _add_norms(self, partial: PartialSum) -> None:
        if partial.norm_weight == 1.0:
            self.change_norms_.extend(partial.change_norms)
        else:
            self.weighted_norms_.extend((n, partial.norm_weight) for n in partial.change_norms)


class Mean(SummingRule):
    """Sample-weighted mean of the updates (FedAvg), folded in as they arrive."""

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        self.sum_.check(params, weight)
        self.sum_.add(params, weight)

    def result(self) -> TensorDict:
        self._require_updates()
        return self.sum_.mean()


class NormClippedMean(SummingRule):
    """Weighted mean of the updates' changes, each clipped to ``clip_ratio`` times the
    reference's norm (over all floating-point tensors together), added to the reference.

    One update can then move the model by at most ``clip_ratio * ||reference||`` times its
    share of the round's weight — a bound an attacker cannot talk its way past.
    """

    def __init__(self, clip_ratio: float = 1.0):
        super().__init__()
        self.clip_ratio = clip_ratio

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.bound_ = self.clip_ratio * _norm(self.reference_.values())

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        self.sum_.check(params, weight)
        floats = [k for k, v in self.reference_.items() if v.dtype.kind == "f"]
        change = _norm(np.asarray(params[k], np.float64) - self.reference_[k] for k in floats)
        factor = 1.0 if change <= self.bound_ else self.bound_ / change
        self.clipped_ += factor < 1.0
        self.sum_.add(params, weight, factor)

    def result(self) -> TensorDict:
        self._require_updates()
        return self.sum_.mean()

