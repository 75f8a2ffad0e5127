"""Robust rules that need every update of the round at once (``streaming = False``):
:class:`CoordinateMedian`, :class:`TrimmedMean`, :class:`MultiKrum`, :class:`CenteredClip`. Unweighted, since a
self-reported sample count is exactly what an attacker would inflate."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .contract import STATISTIC_LEAVES, Aggregator, TensorDict, lower_median


class _Buffered(Aggregator):
    """A rule that needs every update at once: keeps them until :meth:`result`.

    Updates are ordered by their content (a hash of the bytes) before the rule runs,
    so the result does not depend on arrival order either.
    """

    streaming = False
    weighted = False

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.updates_: list[tuple[bytes, TensorDict]] = []

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        import hashlib

        checked = {key: np.asarray(params[key]) for key in self.reference_}  # checked by Aggregator.add
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(checked[k]).tobytes() for k in sorted(checked)))
        self.updates_.append((digest.digest(), checked))

    def _stacked(self, key: str) -> np.ndarray:
        ordered = sorted(self.updates_, key=lambda item: item[0])
        return np.stack([u[key].astype(np.float64) for _, u in ordered])

    def _cast(self, key: str, value: np.ndarray) -> np.ndarray:
        ref = self.reference_[key]
        return (np.rint(value) if ref.dtype.kind in "iu" else value).astype(ref.dtype)


class CoordinateMedian(_Buffered):
    """The median of each coordinate over the round's updates (unweighted)."""

    def result(self) -> TensorDict:
        self._require_updates()
        return {k: self._cast(k, np.median(self._stacked(k), axis=0)) for k in self.reference_}


class TrimmedMean(_Buffered):
    """Per coordinate, drop the ``trim_fraction`` largest and smallest values, average the rest.

    At least one value is dropped from each end whenever there are 3 or more: at 0.2 a
    round of 4 updates would otherwise trim nothing and be the plain mean, the one
    outcome a user of this rule chose against.
    """

    def __init__(self, trim_fraction: float = 0.2):
        super().__init__()
        self.trim_fraction = trim_fraction

    def result(self) -> TensorDict:
        self._require_updates()
        n = self.count_
        cut = min(max(int(math.floor(self.trim_fraction * n)), 1), (n - 1) // 2)
        out = {}
        for key in self.reference_:
            values = np.sort(self._stacked(key), axis=0)
            out[key] = self._cast(key, values[cut:n - cut].mean(axis=0))
        return out


class MultiKrum(_Buffered):
    """Multi-Krum (Blanchard et al., 2017): average the ``select`` updates whose summed
    squared distance to their ``n - f - 2`` nearest neighbours is smallest."""

    def __init__(self, byzantine: int = 1, select: int | None = None):
        super().__init__()
        self.byzantine = byzantine
        self.select = select

    def result(self) -> TensorDict:
        self._require_updates()
        keys = list(self.reference_)
        flat = np.concatenate([self._stacked(k).reshape(self.count_, -1) for k in keys], axis=1)
        n = self.count_
        neighbours = max(1, n - self.byzantine - 2)
        sq = np.einsum("ij,ij->i", flat, flat)
        d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (flat @ flat.T), 0.0)  # n x n, never n x n x P
        scores = np.array([np.sort(np.delete(d2[i], i))[:neighbours].sum() if n > 1 else 0.0 for i in range(n)])
        m = self.select or max(1, n - self.byzantine)
        chosen = np.argsort(scores, kind="stable")[: min(m, n)]
        return {k: self._cast(k, self._stacked(k)[chosen].mean(axis=0)) for k in keys}



class CenteredClip(_Buffered):
    """The mean of the updates, each clipped around the coordinate-wise median of the round:
    an update's distance from the median (over the learned parameters) is cut to ``radius``
    times the median of those distances, then the clipped updates are averaged. BatchNorm
    running statistics take the coordinate-wise median.

    One update moves the result from the median by at most ``radius`` times a typical
    honest distance over the number of updates, whatever direction it takes; an honest
    update that is no further from the median than the others counts whole, as in the mean
    (the trimmed mean drops two of four). A single-round, stateless form of centered
    clipping (Karimireddy, He and Jaggi, 2021), centred on the median rather than on a
    momentum the coordinator would have to keep."""

    def __init__(self, radius: float = 1.0):
        super().__init__()
        self.radius = radius

    def result(self) -> TensorDict:
        self._require_updates()
        statistics = {k for k in self.reference_ if k.endswith(STATISTIC_LEAVES)}
        learned = [k for k, v in self.reference_.items() if v.dtype.kind == "f" and k not in statistics]
        out = {k: self._cast(k, np.median(self._stacked(k), axis=0)) for k in self.reference_ if k not in learned}
        if not learned:
            return out
        stacks = {k: self._stacked(k) for k in learned}
        centre = {k: np.median(v, axis=0) for k, v in stacks.items()}
        n = self.count_
        distances = np.sqrt(sum(np.sum((v - centre[k]).reshape(n, -1) ** 2, axis=1) for k, v in stacks.items()))
        typical = lower_median(float(d) for d in distances) or 0.0
        limit = self.radius * typical
        factors = np.where(distances > limit, limit / np.maximum(distances, 1e-300), 1.0)
        for k, v in stacks.items():
            shape = (n,) + (1,) * (v.ndim - 1)
            out[k] = self._cast(k, centre[k] + np.mean(factors.reshape(shape) * (v - centre[k]), axis=0))
        return {k: out[k] for k in self.reference_}
