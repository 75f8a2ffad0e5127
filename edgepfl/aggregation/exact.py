"""Exact, order-free sums of the updates' changes: what the streaming rules add.

**Order independence.** Over MQTT updates arrive in any order; in-process they arrive
sorted. Both must give the same bits, so the streaming rules do not add floats (whose
rounding depends on order): each contribution ``w * (x - reference)`` is rounded once, on
its own, to a fixed-point grid chosen at :meth:`~edgepfl.aggregation.Aggregator.begin` from
the reference alone, and the integers are summed exactly (in int64 with a carry word, so a
round's total weight is not bounded by the accumulator). The grid leaves room for one
update of up to :data:`MAX_UPDATE_WEIGHT` and changes of up to :data:`CHANGE_RANGE` times the
reference's largest magnitude (a BatchNorm running variance: :data:`VARIANCE_RANGE` times); an update outside that range is refused by
:meth:`~edgepfl.aggregation.Aggregator.add` (:class:`AggregationRejected`), a decision that
depends on the update alone, never on what arrived before it. The rounding error of the
mean is at most 2**-39 of that range: about 1e-10 for parameters of order one, under
float32's own precision; for a running variance 2**-23 of the layer's largest (at least 1),
about one float32 step of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from .contract import MAX_UPDATE_WEIGHT, AggregationRejected, TensorDict, change_range, variance_keys
from .partial import CONTRIBUTION_BITS as _INT64_HEADROOM  # bits one contribution may use in int64
from .partial import LOW_BITS as _CARRY_BITS  # the low word keeps this many bits; the rest is carried to the high word
from .partial import PartialSum, words_total


def ceil_log2(x: float) -> int:
    """The smallest integer ``e`` with ``2**e >= x`` (``x > 0``), exactly: ``math.log2`` may round
    a number just above a power of two down onto it. The grid's exponent (PROTOCOL.md §19 defines
    it so, for a second implementation to reproduce the grid bit for bit)."""
    mantissa, exponent = math.frexp(x)  # x = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return exponent - 1 if mantissa == 0.5 else exponent


class _ExactSum:
    """Sum of ``w * (x - reference)`` per coordinate, independent of the order of ``add``.

    Each contribution is rounded to a grid of ``2**-bits`` times the reference's scale
    and accumulated exactly as an integer ``high * 2**40 + low`` held in two int64
    arrays: a contribution fits in 62 bits, ``low`` is kept in ``[0, 2**40)`` by carrying
    into ``high``, so neither word overflows however many updates arrive. Integer
    addition is associative, so any order gives the same sum. Floating-point tensors
    only; integer tensors are averaged exactly as integers.
    """

    def __init__(self, reference: Mapping[str, np.ndarray]):
        self.reference = reference
        self.scale: dict[str, float] = {}
        self.limit: dict[str, float] = {}
        self.low: dict[str, np.ndarray] = {}
        self.high: dict[str, np.ndarray] = {}
        self.variances = variance_keys(reference)
        for key, ref in reference.items():
            if ref.dtype.kind == "f":
                span = change_range(ref, key in self.variances)  # the largest |x - reference| accepted
                self.scale[key] = 2.0 ** (_INT64_HEADROOM - ceil_log2(span * MAX_UPDATE_WEIGHT))
                self.limit[key] = span
            self.low[key] = np.zeros(ref.shape, dtype=np.int64)
            self.high[key] = np.zeros(ref.shape, dtype=np.int64)
        self.total_weight = 0

    def check(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        """Raise :class:`AggregationRejected` if this update cannot be summed (it alone decides)."""
        if weight > MAX_UPDATE_WEIGHT:
            raise AggregationRejected("malformed", f"one update's weight may be at most {MAX_UPDATE_WEIGHT}")
        for key, ref in self.reference.items():
            x = np.asarray(params[key])  # shapes, dtypes and finiteness: checked by Aggregator.add
            if ref.dtype.kind == "f":
                change = float(np.max(np.abs(x.astype(np.float64) - ref))) if x.size else 0.0
                if change > self.limit[key]:
                    raise AggregationRejected(
                        "out_of_range", f"{key} moves by {change:.3g}, more than {self.limit[key]:.3g}")

    def contribution(self, params: Mapping[str, np.ndarray], weight: int, factor: float = 1.0,
                     noise: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """``weight * factor * (params - reference)`` (plus ``noise``, per float tensor) on the
        grid: one int64 array per key. What :meth:`add` folds in, and what an agent masks for
        secure aggregation (:func:`ring_vector`): both sides compute it from the reference alone."""
        return {key: self._grid(key, params[key], weight, factor, None if noise is None else noise[key])
                for key in self.reference}

    def add(self, params: Mapping[str, np.ndarray], weight: int, factor: float = 1.0) -> None:
        """Fold ``weight * factor * (params - reference)`` in; call :meth:`check` first.

        The same integers as :meth:`add_total` of :meth:`contribution`, each key's folded in as
        soon as it is made: holding every key's at once, the coordinator spent several percent
        more CPU per update (``benchmarks/exact_sum_cost.py``)."""
        for key in self.reference:
            self._fold(key, self._grid(key, params[key], weight, factor))
        self.total_weight += weight

    def add_total(self, contributions: Mapping[str, np.ndarray], weight: int) -> None:
        """Fold in grid integers (one int64 array per key) standing for ``weight`` of updates:
        one update's :meth:`contribution`, or the unmasked sum of a secure round's."""
        for key in self.reference:
            self._fold(key, contributions[key])
        self.total_weight += weight

    def words(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of the sum's two words per key (low, high): what a :class:`PartialSum` carries."""
        return ({k: v.copy() for k, v in self.low.items()}, {k: v.copy() for k, v in self.high.items()})

    def add_partial(self, partial: PartialSum) -> None:
        """Fold in another sum's two words over the same reference (checked by the caller,
        :meth:`PartialSum.check`): the integers add exactly, so the result does not depend on
        how the updates were grouped into sums."""
        for key in self.reference:
            self._fold(key, partial.low[key])
            self.high[key] += partial.high[key]
        self.total_weight += partial.total_weight

    def _grid(self, key: str, x: np.ndarray, weight: int, factor: float = 1.0,
              noise: np.ndarray | None = None) -> np.ndarray:
        """One key's ``weight * factor * (x - reference)`` (plus ``noise``) on the grid, as int64."""
        ref = self.reference[key]
        x = np.asarray(x)
        if ref.dtype.kind == "f":
            change = (x.astype(np.float64) - ref.astype(np.float64)) * (weight * factor)
            if noise is not None:
                change = change + noise
            return np.rint(change * self.scale[key]).astype(np.int64)
        return weight * (x.astype(np.int64) - ref.astype(np.int64))

    def _fold(self, key: str, integers: np.ndarray) -> None:
        """Add grid integers to ``key``'s two words, carrying the low word's excess to the high one."""
        low = self.low[key]
        low += integers
        carry = low >> _CARRY_BITS  # floor division by 2**40, also for a negative low
        self.high[key] += carry
        low -= carry << _CARRY_BITS

    def _total(self, key: str) -> np.ndarray:
        """The exact integer sum of ``key``, rounded once to float64."""
        return words_total(self.low[key], self.high[key])

    def mean(self) -> TensorDict:
        out: TensorDict = {}
        for key, ref in self.reference.items():
            if ref.dtype.kind == "f":
                change = self._total(key) / (self.scale[key] * self.total_weight)
                mean = ref.astype(np.float64) + change
                if key in self.variances:  # a mean of variances is one; the grid's rounding may not make it negative
                    mean = np.maximum(mean, 0.0)
                out[key] = mean.astype(ref.dtype)
            else:
                out[key] = (ref.astype(np.int64) + np.rint(self._total(key) / self.total_weight)).astype(ref.dtype)
        return out



def _unit_mean(sum_: _ExactSum, reference: Mapping[str, np.ndarray], denominator: float,
               noise: Callable[[tuple[int, ...]], np.ndarray] | None = None) -> TensorDict:
    """Client-level DP's mean of clipped changes that each counted once: per float tensor the
    reference plus (the exact sum, plus ``noise`` of its shape drawn in the reference's key
    order) over ``denominator``; integer tensors keep the reference's value (a mean of counts
    would be an unprotected statistic); a variance the noise made negative is 0."""
    variances = variance_keys(reference)
    out: TensorDict = {}
    for key, ref in reference.items():
        if ref.dtype.kind != "f":
            out[key] = ref.copy()
            continue
        total = sum_._total(key) / sum_.scale[key]
        if noise is not None:
            total = total + noise(ref.shape)
        value = ref.astype(np.float64) + total / denominator
        if key in variances:  # noise may not make a variance negative (post-processing: free)
            value = np.maximum(value, 0.0)
        out[key] = value.astype(ref.dtype)
    return out

