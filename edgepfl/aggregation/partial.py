"""Partial sums: what a site aggregator returns for its devices, and what the central
coordinator folds in as if each of those devices' updates had come to it.

The streaming sums are integers on a grid that the round's reference alone fixes
(:mod:`.exact`), and integer addition is associative: a site that begins the same rule
with the same reference sums its devices' updates into the same integers that the
central coordinator would have, and the central sum of the sites' integers is the flat
fleet's sum bit for bit, whatever the grouping and the order. What crosses the site's
uplink is then one model-sized sum per round, not one update per device.

A rule composes when its state after its updates is such a sum and the numbers beside it
(how many updates, their weight, how many the bound clipped, each one's change norm) are
counts or lists that concatenate: a :class:`~.means.SummingRule`. The robust rules do not
(a median of medians is not the fleet's median); they run where the single updates are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .contract import MAX_UPDATE_WEIGHT, AggregationRejected

#: the low word of a sum's integer holds this many bits (:class:`.exact._ExactSum`)
LOW_BITS = 40
#: the bits one update's grid contribution may use in int64 (one spare for the sum's sign)
CONTRIBUTION_BITS = 62


def words_total(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """The exact integer ``high * 2**LOW_BITS + low`` of a sum's two words, rounded once to
    float64 (both words are exact floats)."""
    return high.astype(np.float64) * float(2**LOW_BITS) + low.astype(np.float64)


@dataclass(frozen=True)
class PartialSum:
    """A rule's running sum over some updates of one round, exactly: per tensor the integer
    ``high * 2**LOW_BITS + low`` (two int64 arrays, ``low`` in ``[0, 2**LOW_BITS)``) of the
    grid contributions added, and the counts the rule keeps beside them.

    Made by :meth:`~.means.SummingRule.partial`, folded in by
    :meth:`~.means.SummingRule.add_partial`; :meth:`check` is what the receiving side runs
    on one that came over the network before any of it counts."""

    low: Mapping[str, np.ndarray]
    high: Mapping[str, np.ndarray]
    #: the updates' summed weight (a unit-weight rule: their number)
    total_weight: int
    #: how many updates are in it
    count: int
    #: how many of them the update bound clipped or clamped
    clipped: int = 0
    #: how many of them the rule's own clip shortened (:class:`~.means.NormClippedMean`)
    rule_clipped: int = 0
    #: each update's change norm as adopted (the rule's bound measures it; empty without one)
    change_norms: tuple[float, ...] = ()
    #: how many updates each of ``change_norms`` stands for: 1, or a summary site's quantiles' share
    #: of its updates (its count over the number of quantiles it reported)
    norm_weight: float = 1.0

    def check(self, reference: Mapping[str, np.ndarray]) -> None:
        """Raise :class:`AggregationRejected` unless this sum can be folded into a round whose
        reference is ``reference``: the same tensors, int64 words of their shapes, the low
        word in range, counts that can be true (at least one update, each of a weight from 1 to
        :data:`MAX_UPDATE_WEIGHT`, at most one change norm per update, finite and not negative)."""
        if set(self.low) != set(reference) or set(self.high) != set(reference):
            raise AggregationRejected("wrong_tensors", "a partial sum's tensors differ from the round's reference")
        for key, ref in reference.items():
            for word in (self.low[key], self.high[key]):
                if not isinstance(word, np.ndarray) or word.dtype != np.int64 or word.shape != np.shape(ref):
                    raise AggregationRejected("wrong_shape", f"{key}: a partial sum's words must be int64"
                                                             f"{list(np.shape(ref))}")
        if not 1 <= self.count or not self.count <= self.total_weight <= self.count * MAX_UPDATE_WEIGHT:
            raise AggregationRejected("malformed", f"a partial sum of {self.count} updates cannot weigh "
                                                   f"{self.total_weight}")
        # |one contribution| < 2**62, so |the sum of count of them| < count * 2**62: a high word
        # past that is no sum of updates, and could wrap the receiver's int64 words
        most_high = self.count << (CONTRIBUTION_BITS - LOW_BITS)
        for key in reference:
            low, high = self.low[key], self.high[key]
            if low.size and (int(low.min()) < 0 or int(low.max()) >= 2**LOW_BITS):
                raise AggregationRejected("malformed", f"{key}: a partial sum's low word out of range")
            if high.size and max(-int(high.min()), int(high.max())) > most_high:
                raise AggregationRejected("out_of_range", f"{key}: more than {self.count} updates can add up to")
        if not (0 <= self.clipped <= self.count and 0 <= self.rule_clipped <= self.count) \
                or len(self.change_norms) > self.count:
            raise AggregationRejected("malformed", "a partial sum counts more clipped updates or norms than updates")
        if not all(np.isfinite(n) and n >= 0 for n in self.change_norms):
            raise AggregationRejected("malformed", "a partial sum's change norms must be finite and not negative")


__all__ = ["CONTRIBUTION_BITS", "LOW_BITS", "PartialSum"]
