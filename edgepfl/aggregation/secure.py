"""Secure aggregation's side of the rules (:mod:`edgepfl.secagg`): the ring a masked
contribution lives in (``ring_*``), an agent's grid contribution, and :class:`SecureMean`,
which sums masked vectors modulo 2**64 and reads the unmasked sum on the clear rules' grid."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from .contract import (
    _INSIDE,
    MAX_UPDATE_WEIGHT,
    STATISTIC_LEAVES,
    AggregationRejected,
    Aggregator,
    OwnRecord,
    TensorDict,
    _norm,
)
from .dp import clip_factor
from .exact import _ExactSum, _unit_mean

#: a secure round's sums are taken modulo 2**64 (:mod:`edgepfl.secagg`): one unit of weight adds
#: at most 2**62 / MAX_UPDATE_WEIGHT to a coordinate, so the sum stays below 2**63 in magnitude,
#: and reads back exactly, while the round's total weight is below this
MAX_SECURE_WEIGHT = 2 * MAX_UPDATE_WEIGHT


def ring_keys(reference: Mapping[str, np.ndarray]) -> list[str]:
    """The order a secure round lays a contribution out in: the reference's keys, sorted."""
    return sorted(reference)


def ring_vector(contributions: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """Grid integers (:meth:`_ExactSum.contribution`) as one flat vector of the ring of
    integers modulo 2**64 (``<u8``; a negative integer as its two's complement)."""
    parts = [np.asarray(contributions[k], np.int64).reshape(-1) for k in ring_keys(reference)]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return flat.view(np.uint64).astype("<u8", copy=False)


def ring_size(reference: Mapping[str, np.ndarray]) -> int:
    """How many integers a secure round's vector holds for ``reference``."""
    return int(sum(np.asarray(v).size for v in reference.values()))


def from_ring(vector: np.ndarray, reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of :func:`ring_vector`: per-key int64 arrays (a sum below 2**63 in magnitude reads exactly)."""
    signed = np.asarray(vector, dtype="<u8").view(np.int64)
    out, at = {}, 0
    for key in ring_keys(reference):
        ref = np.asarray(reference[key])
        out[key] = signed[at:at + ref.size].reshape(ref.shape)
        at += ref.size
    return out



def grid_contribution(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], weight: int,
                      clip_norm: float | None = None, noise_std: float = 0.0,
                      rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """An agent's contribution to a secure round: ``weight * (params - reference)`` on the
    round's exact grid, each change first clamped into the grid's range (a change the
    coordinator would refuse as ``out_of_range`` in the clear; an honest device's never is).

    With ``clip_norm`` (distributed DP, weight 1): the float tensors' change clipped as
    :class:`GaussianMean` clips it, plus Gaussian noise of ``noise_std`` per coordinate from
    ``rng``; integer tensors contribute nothing (the state keeps their value)."""
    exact = _ExactSum(reference)
    if clip_norm is not None:
        floats = {k for k, v in exact.reference.items() if v.dtype.kind == "f"}
        kept = {k: (params[k] if k in floats else exact.reference[k]) for k in exact.reference}
        noise = {k: rng.normal(0.0, noise_std, exact.reference[k].shape) if rng is not None and noise_std > 0
                 else np.zeros(exact.reference[k].shape) for k in floats}
        return exact.contribution(kept, 1, clip_factor(kept, exact.reference, clip_norm), noise)
    clamped = {}
    for key, ref in exact.reference.items():
        x = np.asarray(params[key])
        if ref.dtype.kind == "f":
            limit = exact.limit[key] * _INSIDE
            x = np.clip(x.astype(np.float64), ref.astype(np.float64) - limit, ref.astype(np.float64) + limit)
        clamped[key] = x
    return exact.contribution(clamped, weight)



class SecureMean(Aggregator):
    """The sample-weighted mean of a secure round (:mod:`edgepfl.secagg`): what is added is
    each agent's *masked* vector (:data:`edgepfl.protocol.secagg.MASKED_TENSOR`), summed
    modulo 2**64; the coordinator never holds one unmasked update. Once the round's masks
    are removed from the sum (:meth:`unmask`), :meth:`result` is the mean of the same grid
    integers :class:`Mean` would have summed in the clear: the same bits, in any order.

    Per-update bounds cannot apply (no update is seen): the rule takes none.

    With ``denominator`` (distributed differential privacy) each device's clipped, noised
    change counts once and the sum is divided by ``denominator``, the devices sampled,
    as :class:`GaussianMean` does; integer tensors keep the reference's value.

    **Groups.** The round's agents may be split into groups, each its own secure sum
    (:meth:`assign`; ``secure_aggregation.group_size``): each group's sum is unmasked and
    taken on its own (:meth:`take_group`) if its mean change is within what every one
    update is held to in the clear: each coordinate within the grid's range (an honest
    agent clamps its contribution into it) and the learned parameters' change within
    ``max_update_ratio`` times their norm (plus what the devices' noise can add). Both
    bounds are convex, so a mean past them proves that one of the group's updates was past
    them: a group of honest devices is never set aside, and one masked vector scaled or
    garbled sets aside its group, not the round."""

    #: what is added is a masked vector, not the shared tensors
    masked: ClassVar[bool] = True

    def __init__(self, denominator: int | None = None, max_update_ratio: float | None = None):
        super().__init__()
        self.denominator = denominator
        self.max_update_ratio = max_update_ratio

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        if self.bound is not None:
            raise ValueError("a secure round's updates are masked: no per-update bound can apply")
        super().begin(reference, typical_change)
        self.size_ = ring_size(self.reference_)
        self.masked_sum_ = np.zeros(self.size_, dtype="<u8")
        self.weight_ = 0
        self.sum_: _ExactSum | None = None
        #: the grid's scale and range per tensor (what :meth:`out_of_bounds` measures a sum on)
        self.grid_ = _ExactSum(self.reference_)
        #: why the masks could not be removed (None: not tried, or removed)
        self.failure_: str | None = None
        #: agent -> its group (:meth:`assign`; an agent not named is in group 0)
        self.groups_: dict[str, int] = {}
        #: per group: its masked sum, its weight and how many vectors it holds
        self.group_sums_: dict[int, np.ndarray] = {}
        self.group_weights_: dict[int, int] = {}
        self.group_counts_: dict[int, int] = {}
        #: group -> why its unmasked sum was set aside (:meth:`take_group`)
        self.set_aside_: dict[int, str] = {}

    def median_change(self) -> float | None:
        return None  # no update's change is seen

    def assign(self, groups: Mapping[str, int]) -> None:
        """Which group each agent's masked vector is summed in (before any is added)."""
        self.groups_ = dict(groups)

    def add_masked(self, agent_id: str, params: Mapping[str, np.ndarray], weight: int = 1) -> tuple[str, ...]:
        """:meth:`add` ``agent_id``'s masked vector into its group's sum as well as the round's."""
        from edgepfl.protocol.secagg import MASKED_TENSOR

        self.add(params, weight)
        group = self.groups_.get(agent_id, 0)
        vector = np.asarray(params[MASKED_TENSOR]).view("<u8")
        if group not in self.group_sums_:
            self.group_sums_[group] = np.zeros(self.size_, dtype="<u8")
        self.group_sums_[group] += vector
        self.group_weights_[group] = self.group_weights_.get(group, 0) + int(weight)
        self.group_counts_[group] = self.group_counts_.get(group, 0) + 1
        return ()

    def add(self, params: Mapping[str, np.ndarray], weight: int = 1,
            own: OwnRecord | None = None, discount: float = 1.0) -> tuple[str, ...]:
        from edgepfl.protocol.secagg import MASKED_TENSOR

        if set(params) != {MASKED_TENSOR}:
            raise AggregationRejected("wrong_tensors", f"a masked update carries {MASKED_TENSOR} alone")
        if not isinstance(weight, (int, np.integer)) or not 1 <= weight <= MAX_UPDATE_WEIGHT:
            raise AggregationRejected("malformed", f"weight must be a positive integer up to {MAX_UPDATE_WEIGHT}")
        vector = np.asarray(params[MASKED_TENSOR])
        if vector.dtype != np.dtype("<i8") or vector.shape != (self.size_,):
            raise AggregationRejected("wrong_shape", f"{MASKED_TENSOR}: {vector.dtype}{list(vector.shape)}, "
                                                     f"want int64[{self.size_}]")
        self.masked_sum_ += vector.view("<u8")  # modulo 2**64: numpy's unsigned arithmetic wraps
        self.weight_ += int(weight)
        self.count_ += 1
        return ()  # a masked vector has no change to bound

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:  # add is whole here
        raise NotImplementedError

    def unmask(self, total: np.ndarray, noise_std: float = 0.0) -> None:
        """Take the unmasked sum of the whole round (:func:`edgepfl.secagg.unmask` of
        :attr:`masked_sum_`); raise :class:`AggregationRejected` if it is past the bounds
        (:meth:`out_of_bounds`)."""
        why = self._take(total, self.weight_, self.count_, noise_std)
        if why is not None:
            raise AggregationRejected("out_of_range", f"the unmasked sum of {self.count_} updates: {why}")

    def take_group(self, group: int, total: np.ndarray, noise_std: float = 0.0) -> str | None:
        """Take one group's unmasked sum into the round's, or set it aside: None, or why."""
        why = self._take(total, self.group_weights_[group], self.group_counts_[group], noise_std)
        if why is not None:
            self.set_aside_[group] = why
        return why

    def _take(self, total: np.ndarray, weight: int, count: int, noise_std: float) -> str | None:
        """Fold an unmasked sum of ``count`` updates of ``weight`` into the round's, unless it is past
        the bounds (then: why)."""
        if weight >= MAX_SECURE_WEIGHT:
            raise AggregationRejected("out_of_range", f"a secure sum's total weight {weight} is not below "
                                                      f"{MAX_SECURE_WEIGHT}: it would wrap")
        integers = from_ring(total, self.reference_)
        why = self.out_of_bounds(integers, weight, count, noise_std)
        if why is not None:
            return why
        if self.sum_ is None:
            self.sum_ = _ExactSum(self.reference_)
        self.sum_.add_total(integers, weight)
        return None

    def out_of_bounds(self, integers: Mapping[str, np.ndarray], weight: int, count: int,
                      noise_std: float = 0.0) -> str | None:
        """Why an unmasked sum of ``count`` updates of total ``weight`` cannot be a sum of
        updates each within the bounds (None: it can be): a coordinate of its mean change past
        the grid's range, or its learned parameters' mean change past ``max_update_ratio``
        times their norm, plus ``noise_std``'s Gaussian noise's largest norm over ``count``
        (at 8 standard deviations: about 1e-15 to pass it by chance)."""
        exact = self.grid_
        units = weight if self.denominator is None else count  # under distributed DP each counts once
        if units <= 0:
            return None
        squared, size = 0.0, 0
        statistics = {k for k in self.reference_ if k.endswith(STATISTIC_LEAVES)}
        for key, ref in self.reference_.items():
            if ref.dtype.kind != "f":
                continue
            mean = np.asarray(integers[key], np.float64) / (exact.scale[key] * units)
            largest = float(np.max(np.abs(mean))) if mean.size else 0.0
            noise = 8.0 * noise_std / math.sqrt(max(count, 1))
            if largest > exact.limit[key] + noise + 1.0 / exact.scale[key]:
                return f"{key}'s mean change {largest:.3g} is past the range every update is clamped into " \
                       f"({exact.limit[key]:.3g})"
            if key not in statistics:
                squared += float(np.sum(mean * mean))
                size += mean.size
        if self.max_update_ratio is None:
            return None
        scale = max(1.0, _norm(v for k, v in self.reference_.items() if v.dtype.kind == "f" and k not in statistics))
        limit = self.max_update_ratio * scale + noise_std * (math.sqrt(size) + 8.0) / math.sqrt(max(count, 1))
        change = math.sqrt(squared)
        if change > limit:
            return f"its mean change {change:.4g} is past max_update_ratio's {limit:.4g}"
        return None

    def result(self) -> TensorDict:
        self._require_updates()
        if self.sum_ is None:  # nothing can be learnt from the masked sum: the round is aborted
            reason = "out_of_range" if self.set_aside_ else "secagg_failed"  # unmasked, and past the bounds
            raise AggregationRejected(reason, self.failure_ or "the masked sum was not unmasked")
        if self.denominator is None:
            return self.sum_.mean()
        return _unit_mean(self.sum_, self.reference_, self.denominator)

