"""Secure aggregation's side of the rules (:mod:`edgepfl.secagg`): the ring a masked
contribution lives in (``ring_*``), an agent's grid contribution, and :class:`SecureMean`,
which sums masked vectors modulo 2**64 and reads the unmasked sum on the clear rules' grid."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from .contract import _INSIDE, MAX_UPDATE_WEIGHT, AggregationRejected, Aggregator, OwnRecord, TensorDict
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
    as :class:`GaussianMean` does; integer tensors keep the reference's value."""

    #: what is added is a masked vector, not the shared tensors
    masked: ClassVar[bool] = True

    def __init__(self, denominator: int | None = None):
        super().__init__()
        self.denominator = denominator

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        if self.bound is not None:
            raise ValueError("a secure round's updates are masked: no per-update bound can apply")
        super().begin(reference, typical_change)
        self.size_ = ring_size(self.reference_)
        self.masked_sum_ = np.zeros(self.size_, dtype="<u8")
        self.weight_ = 0
        self.sum_: _ExactSum | None = None
        #: why the masks could not be removed (None: not tried, or removed)
        self.failure_: str | None = None

    def median_change(self) -> float | None:
        return None  # no update's change is seen

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

    def unmask(self, total: np.ndarray) -> None:
        """Take the unmasked sum (:func:`edgepfl.secagg.unmask` of :attr:`masked_sum_`)."""
        if self.weight_ >= MAX_SECURE_WEIGHT:
            raise AggregationRejected("out_of_range", f"a secure round's total weight {self.weight_} is not below "
                                                      f"{MAX_SECURE_WEIGHT}: its sum would wrap")
        self.sum_ = _ExactSum(self.reference_)
        self.sum_.add_total(from_ring(total, self.reference_), self.weight_)

    def result(self) -> TensorDict:
        self._require_updates()
        if self.sum_ is None:  # nothing can be learnt from the masked sum: the round is aborted
            raise AggregationRejected("secagg_failed", self.failure_ or "the masked sum was not unmasked")
        if self.denominator is None:
            return self.sum_.mean()
        return _unit_mean(self.sum_, self.reference_, self.denominator)

