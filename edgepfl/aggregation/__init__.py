"""Aggregation rules for the shared parameters of a round, one class per rule.

Every rule follows one small interface (:class:`Aggregator`): :meth:`~Aggregator.begin`
with the round's reference (the global parameters the tasks carried), :meth:`~Aggregator.add`
one accepted update at a time, :meth:`~Aggregator.result` once the round closes. A rule
is written once and serves every method whose server step averages.

* :class:`Mean` — the sample-weighted mean (FedAvg). **Streaming**: an update is folded
  in when it arrives, so memory is O(model) whatever the number of agents.
* :class:`NormClippedMean` — each update's change from the reference is clipped to a
  norm before the weighted mean. Streaming.
* :class:`CoordinateMedian`, :class:`TrimmedMean`, :class:`MultiKrum` — robust rules
  that need every update of the round at once (``streaming = False``); unweighted, since
  a self-reported sample count is exactly what an attacker would inflate.
* :class:`GaussianMean` (central differential privacy) and :class:`SecureMean` (secure
  aggregation) — put in a round's place by :func:`round_rule`, never named by a config.

The modules:

=================  ==========================================================================
``contract``       :class:`Aggregator`, :class:`AggregationRejected`, :class:`UpdateBound`
                   (bounded trust in every update, whatever the rule) and their constants
``weights``        how much one device weighs: :func:`weight_cap`, :func:`capped_accuracy`,
                   :func:`staleness_weight`, :func:`rebase`
``exact``          the exact, order-free sums the streaming rules add into
``partial``        :class:`PartialSum`: such a sum over some updates, which adds to another
                   (a site aggregator's share of a round)
``means``          :class:`Mean`, :class:`NormClippedMean`
``robust``         :class:`CoordinateMedian`, :class:`TrimmedMean`, :class:`MultiKrum`
``dp``             :class:`GaussianMean`, :class:`AdaptiveClip`, :func:`clip_factor`
``secure``         :class:`SecureMean` and the ring a masked contribution lives in
``rules``          :data:`RULES`: the rules a config may name, the one source of their names
``spec``           :class:`AggregationSpec`, a run config's ``aggregation:`` section
``choice``         :func:`round_rule`: which rule aggregates a training round
=================  ==========================================================================
"""

from __future__ import annotations

from .choice import round_rule
from .contract import (
    CHANGE_BOUNDS,
    CHANGE_RANGE,
    DEFAULT_MAX_FIRST_UPDATE_RATIO,
    DEFAULT_MAX_MEAN_SHIFT,
    DEFAULT_MAX_UPDATE_VS_MEDIAN,
    DEFAULT_MAX_VARIANCE_GROWTH,
    DEFAULT_MAX_WEIGHT_RATIO,
    MAX_UPDATE_WEIGHT,
    STATISTIC_LEAVES,
    UPDATE_HISTORY,
    UPDATE_NORM_MEDIAN,
    VARIANCE_RANGE,
    AggregationRejected,
    Aggregator,
    Bounded,
    OwnRecord,
    TensorDict,
    UpdateBound,
    change_range,
    lower_median,
    variance_keys,
)
from .dp import AdaptiveClip, GaussianMean, clip_factor
from .means import Mean, NormClippedMean, SummingRule
from .partial import PartialSum
from .robust import CenteredClip, CoordinateMedian, MultiKrum, TrimmedMean
from .rules import AUTO, RULES, Rule, RuleName
from .secure import MAX_SECURE_WEIGHT, SecureMean, from_ring, grid_contribution, ring_keys, ring_size, ring_vector
from .spec import PER_UPDATE_BOUNDS, AggregationSpec
from .weights import capped_accuracy, capped_counts, rebase, staleness_weight, weight_cap

__all__ = [
    "CHANGE_BOUNDS",
    "AdaptiveClip", "AggregationRejected", "AUTO", "CenteredClip", "AggregationSpec", "Aggregator", "Bounded", "capped_accuracy",
    "capped_counts",
    "change_range", "CHANGE_RANGE", "clip_factor", "CoordinateMedian", "DEFAULT_MAX_FIRST_UPDATE_RATIO",
    "DEFAULT_MAX_MEAN_SHIFT", "DEFAULT_MAX_UPDATE_VS_MEDIAN", "DEFAULT_MAX_VARIANCE_GROWTH",
    "DEFAULT_MAX_WEIGHT_RATIO", "from_ring", "GaussianMean", "grid_contribution", "lower_median",
    "MAX_SECURE_WEIGHT", "MAX_UPDATE_WEIGHT", "Mean", "MultiKrum", "NormClippedMean", "OwnRecord", "PartialSum",
    "PER_UPDATE_BOUNDS", "rebase", "ring_keys", "ring_size", "ring_vector",
    "round_rule", "Rule", "RuleName", "RULES", "SecureMean", "staleness_weight", "STATISTIC_LEAVES", "SummingRule", "TensorDict",
    "TrimmedMean", "UPDATE_HISTORY", "UPDATE_NORM_MEDIAN", "UpdateBound", "VARIANCE_RANGE", "variance_keys",
    "weight_cap",
]
