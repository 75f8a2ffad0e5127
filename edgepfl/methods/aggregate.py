"""Server-side building blocks shared by methods: pure numpy, no I/O."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np


def weighted_mean(
    tensor_dicts: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float] | np.ndarray | None = None,
    keys: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
    """Weighted mean of aligned tensor dicts; ``weights=None`` is the plain mean.

    Accumulates in float64 and casts back to each tensor's dtype, so the result does
    not depend on summation order beyond float64 rounding. Integer tensors are rounded.
    """
    if not tensor_dicts:
        raise ValueError("weighted_mean needs at least one input")
    w = np.ones(len(tensor_dicts)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(tensor_dicts),) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"bad weights {w}")
    w = w / w.sum()
    out = {}
    for key in keys if keys is not None else tensor_dicts[0].keys():
        ref = tensor_dicts[0][key]
        acc = np.zeros(ref.shape, dtype=np.float64)
        for wi, td in zip(w, tensor_dicts):
            acc += wi * td[key]
        out[key] = np.rint(acc).astype(ref.dtype) if ref.dtype.kind in "iu" else acc.astype(ref.dtype)
    return out


def count_weighted_centroids(
    centroids: Sequence[np.ndarray], counts: Sequence[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Global class centroids c_k = sum_i n_ik c_ik / sum_i n_ik.

    ``centroids[i]`` is (K, d), ``counts[i]`` is (K,). Returns (centroids (K, d), total
    counts (K,)); a class nobody has gets a zero row and count 0.
    """
    c = np.stack([np.asarray(x, dtype=np.float64) for x in centroids])  # (m, K, d)
    n = np.stack([np.asarray(x, dtype=np.float64) for x in counts])  # (m, K)
    total = n.sum(axis=0)
    summed = (n[:, :, None] * c).sum(axis=0)
    safe = np.where(total > 0, total, 1.0)
    return (summed / safe[:, None]).astype(np.float32), total
