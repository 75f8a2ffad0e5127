"""How much one device weighs in a round: the cap on a self-reported sample count, the
accuracy weighed with it, and the discount and rebasing of a late or asynchronous update."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from .contract import STATISTIC_LEAVES, TensorDict, _statistic_layers, lower_median


def weight_cap(counts: Iterable[int], ratio: float | None) -> int | None:
    """The most weight one device's count may carry: ``ratio`` times the median of ``counts``
    (the lower middle one of an even number; at least 1), or None (no cap) without a ratio
    or counts.

    A count is what a device says about itself, and as an aggregation weight it decides
    how much of the model that device writes: announced as 2**24 it outweighs any fleet.
    The lower median cannot be raised by half of the devices or fewer, so one attacker
    among honest devices (one of two included) is held to ``ratio`` honest devices' worth;
    an honest device with more data than most keeps all its weight up to the same bound.
    """
    middle = lower_median(counts)
    if ratio is None or middle is None:
        return None
    return max(1, math.floor(ratio * middle))


def capped_counts(counts: list[int], ratio: float | None) -> list[int]:
    """Each of ``counts`` cut to :func:`weight_cap` of them: what each device's count weighs."""
    cap = weight_cap(counts, ratio)
    return [t if cap is None else min(t, cap) for t in counts]


def capped_accuracy(results: Iterable[tuple[int, int]], ratio: float | None,
                    pooled: Iterable[tuple[int, int]] = ()) -> float | None:
    """Held-out accuracy over ``(correct, total)`` pairs, each device weighted by its
    ``total`` cut to :func:`weight_cap` of the totals, together with ``pooled`` pairs taken
    as they are (a summary site's, whose devices' counts were cut at the site); None: nothing
    was evaluated."""
    pairs = [(c, t) for c, t in results if t > 0]
    weights = capped_counts([t for _, t in pairs], ratio)
    whole = [(c, t) for c, t in pooled if t > 0]
    if not weights and not whole:
        return None
    return (sum(w * c / t for w, (c, t) in zip(weights, pairs)) + sum(c for c, _ in whole)) \
        / (sum(weights) + sum(t for _, t in whole))


def staleness_weight(staleness: int, exponent: float = 0.5) -> float:
    """How much of a stale update's change is applied: ``(1 + staleness) ** -exponent``
    (FedBuff's polynomial discount; 1 for a fresh update, 0.71 one version late)."""
    return float((1 + staleness) ** -exponent)


def rebase(update: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
           factor: float) -> TensorDict:
    """An update trained from ``base``, moved onto ``reference``: what a late or asynchronous
    update contributes to a newer state.

    Learned parameters carry the update's own change, discounted: ``reference + factor *
    (update - base)``. BatchNorm running statistics are estimates of the device's data, not
    steps: they are mixed in, ``reference + factor * (update - reference)``, so a variance
    stays between the two estimates. (Added as a change, a device whose variance fell
    below a base the fleet has since moved under drove the state's variance to zero, and
    the update bound, measuring in units of it, then clamped every honest update.)
    Integer tensors go as sent."""
    statistics = {layer + leaf for layer in _statistic_layers(reference) for leaf in STATISTIC_LEAVES}
    out: TensorDict = {}
    for key, ref in reference.items():
        x = np.asarray(update[key])
        if ref.dtype.kind != "f":
            out[key] = x
            continue
        ref64 = ref.astype(np.float64)
        origin = ref64 if key in statistics else np.asarray(base[key], np.float64)
        out[key] = (ref64 + factor * (x.astype(np.float64) - origin)).astype(ref.dtype)
    return out

