"""The aggregation rules a run config may name (``aggregation.rule``), as one table:
:data:`RULES` is the one source of the names. It types the config's field
(:data:`RuleName`), :meth:`~edgepfl.aggregation.AggregationSpec.build` builds from it, and
the rules' contract suite (``tests/contract/test_aggregators.py``) runs over every row.

Adding a rule is its module and one row here (and an :class:`~edgepfl.aggregation.AggregationSpec`
field for each option it takes). The rules of differential privacy and secure aggregation
are not named by a config: :func:`~edgepfl.aggregation.round_rule` puts them in a round's place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from .contract import Aggregator
from .means import Mean, NormClippedMean
from .robust import CenteredClip, CoordinateMedian, MultiKrum, TrimmedMean


@dataclass(frozen=True)
class Rule:
    """One row of :data:`RULES`."""

    #: makes a fresh rule (its class), from the options below as keywords
    build: Callable[..., Aggregator]
    #: the AggregationSpec fields the rule takes, each to the keyword it is passed as
    options: Mapping[str, str] = field(default_factory=dict)


#: every rule a run config may name, in the order the configuration reference lists them
RULES: Mapping[str, Rule] = {
    "mean": Rule(Mean),
    "clipped_mean": Rule(NormClippedMean, {"clip_ratio": "clip_ratio"}),
    "median": Rule(CoordinateMedian),
    "trimmed_mean": Rule(TrimmedMean, {"trim_fraction": "trim_fraction"}),
    "multi_krum": Rule(MultiKrum, {"krum_byzantine": "byzantine", "krum_select": "select"}),
    "centered_clip": Rule(CenteredClip, {"clip_radius": "radius"}),
}

#: what ``aggregation.rule`` may say besides a row: let the fleet decide
#: (:meth:`~edgepfl.aggregation.AggregationSpec.resolved`)
AUTO = "auto"

if TYPE_CHECKING:  # a Literal made from the table is not one a type checker can read
    RuleName = str
    RuleChoice = str
else:
    RuleName = Literal[tuple(RULES)]
    #: the values ``aggregation.rule`` accepts: a row's name, or :data:`AUTO`
    RuleChoice = Literal[tuple(RULES) + (AUTO,)]
