"""The streaming means: :class:`Mean` (FedAvg) and :class:`NormClippedMean`, folded in on
arrival into an exact sum (memory O(model) whatever the number of agents)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .contract import Aggregator, TensorDict, _norm
from .exact import _ExactSum


class Mean(Aggregator):
    """Sample-weighted mean of the updates (FedAvg), folded in as they arrive."""

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        self.sum_.check(params, weight)
        self.sum_.add(params, weight)

    def result(self) -> TensorDict:
        self._require_updates()
        return self.sum_.mean()


class NormClippedMean(Aggregator):
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
        self.sum_ = _ExactSum(self.reference_)
        self.clipped_ = 0
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

