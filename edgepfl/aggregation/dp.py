"""Client-level differential privacy at the coordinator: :class:`GaussianMean` (central
DP-FedAvg, with optional adaptive clipping) and the one clip of client-level DP
(:func:`clip_factor`), which the devices also apply under distributed DP."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import ClassVar, NamedTuple

import numpy as np

from .contract import Aggregator, TensorDict, _norm
from .exact import _ExactSum, _unit_mean


class GaussianMean(Aggregator):
    """Client-level differential privacy of the shared parameters, central (DP-FedAvg:
    McMahan et al., 2018): each update's change, over every floating-point tensor together,
    is clipped to ``clip_norm`` (L2); the clipped changes are summed unweighted, exactly and
    in any arrival order; Gaussian noise of standard deviation ``noise_multiplier *
    clip_norm`` is added to each coordinate of the sum; and the sum is divided by
    ``denominator``, the number of agents sampled for the round (a Poisson round's expected
    number), fixed before any answer so that it says nothing of who answered. Integer tensors keep the reference's value (a mean
    of counts would be an unprotected statistic). The noise is drawn once, at :meth:`result`,
    from ``noise_seed``: the result is the same in any arrival order, and a rerun draws the
    same noise.

    One device changes the sum by at most ``clip_norm``, whatever it sends: the sensitivity
    :mod:`edgepfl.privacy` accounts with. So the rule refuses nothing for its values (a
    refusal would say something about them); only a malformed update (wrong tensors, not
    finite) is refused, before anything of it counts.

    With ``adaptive`` (Andrew et al., NeurIPS 2021) the rule also counts the updates its
    clip left whole, adds Gaussian noise of ``adaptive.count_noise`` to that count, and
    moves the clip geometrically towards the norm that ``adaptive.target_quantile`` of the
    devices' changes stay under: ``next_clip_``, handed to ``on_next_clip`` for the next
    round to clip with (whether or not this round's aggregate is adopted: the count is
    released either way)."""

    #: one device, one unit: a sample count would scale its influence past the clip
    weighted: ClassVar[bool] = False

    def __init__(self, clip_norm: float, noise_multiplier: float, denominator: float, noise_seed: int | list[int],
                 adaptive: AdaptiveClip | None = None, on_next_clip: Callable[[float], None] | None = None):
        super().__init__()
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.denominator = denominator
        self.noise_seed = noise_seed
        self.adaptive = adaptive
        self.on_next_clip = on_next_clip

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)
        self.clipped_ = 0
        self.next_clip_: float | None = None

    def median_change(self) -> float | None:
        return None  # a statistic of the devices' raw updates: not for the next round to use

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        floats = [k for k, v in self.reference_.items() if v.dtype.kind == "f"]
        factor = clip_factor(params, self.reference_, self.clip_norm)
        self.clipped_ += factor < 1.0
        # one device, one unit: its sample count does not weigh (it would scale its influence)
        self.sum_.add({k: params[k] for k in floats} | {k: self.reference_[k] for k in self.reference_
                                                          if k not in floats}, 1, factor)

    def result(self) -> TensorDict:
        self._require_updates()
        rng = np.random.default_rng(self.noise_seed)
        std = self.noise_multiplier * self.clip_norm
        out = _unit_mean(self.sum_, self.reference_, self.denominator, lambda shape: rng.normal(0.0, std, shape))
        if self.adaptive is not None:  # drawn after the sum's noise: the same draws in any order of arrival
            a = self.adaptive
            within = (self.count_ - self.clipped_ + rng.normal(0.0, a.count_noise)) / self.denominator
            self.next_clip_ = float(self.clip_norm * math.exp(-a.learning_rate * (within - a.target_quantile)))
            if self.on_next_clip is not None:
                self.on_next_clip(self.next_clip_)
        return out



class AdaptiveClip(NamedTuple):
    """How :class:`GaussianMean` moves its clip each round (adaptive clipping)."""

    #: the share of devices whose change the clip should leave whole
    target_quantile: float
    #: the geometric step: the clip is multiplied by exp(-learning_rate * (share within - target))
    learning_rate: float
    #: the standard deviation of the Gaussian noise on the count of changes within the clip
    count_noise: float



def clip_factor(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], clip_norm: float) -> float:
    """What scales an update's change of the float tensors (L2 over all of them, in sorted
    key order) to at most ``clip_norm``: 1 when it is within. The one clip of client-level DP,
    at the coordinator (:class:`GaussianMean`) or on the device (distributed)."""
    floats = [k for k in sorted(reference) if np.asarray(reference[k]).dtype.kind == "f"]
    change = _norm(np.asarray(params[k], np.float64) - np.asarray(reference[k], np.float64) for k in floats)
    return 1.0 if change <= clip_norm else clip_norm / change

