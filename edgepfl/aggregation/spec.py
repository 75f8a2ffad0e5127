"""A run config's ``aggregation:`` section (:class:`AggregationSpec`): the rule (a row of
:data:`~edgepfl.aggregation.rules.RULES`), its options, the bound on one update and the
coordinator's guard on a round's result."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .contract import (
    DEFAULT_MAX_FIRST_UPDATE_RATIO,
    DEFAULT_MAX_MEAN_SHIFT,
    DEFAULT_MAX_UPDATE_VS_MEDIAN,
    DEFAULT_MAX_VARIANCE_GROWTH,
    DEFAULT_MAX_WEIGHT_RATIO,
    Aggregator,
    UpdateBound,
)
from .rules import AUTO, RULES, RuleChoice

#: ``aggregation.rule: auto`` chooses the robust rule for an enrolled fleet's rounds of at most
#: this many updates (a larger round keeps every update in memory under it: O(updates x model);
#: and one bounded update is a small share of a large round's mean)
AUTO_ROBUST_MAX_UPDATES = 64
#: ``aggregation.rule: auto``'s robust rule: the mean of the updates each clipped to one median
#: distance from their coordinate-wise median. Of the rules measured with one attacker of
#: four (research/RESULTS.md), the one that costs an honest fleet nothing against the mean and
#: bounds both flipped labels and a reversed update best; the trimmed mean drops two honest
#: updates of four
AUTO_ROBUST_RULE = "centered_clip"

#: the AggregationSpec fields that bound one update at a time (the coordinator must see it)
PER_UPDATE_BOUNDS = ("max_update_ratio", "max_update_vs_median", "max_first_update_ratio", "max_mean_shift",
                     "max_variance_growth")


class AggregationSpec(BaseModel):
    """How a round's updates become the next state (a run config's ``aggregation:``).

    ``rule`` and its options choose the rule that aggregates the shared parameters
    (:meth:`build`); ``max_change_ratio`` and ``rollback_after`` are the coordinator's
    guard on the result: a round whose aggregate is not finite or moves the shared
    parameters too far is aborted, and a run whose rounds keep aborting goes back to its
    last good state.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid")

    rule: RuleChoice = Field(
        AUTO, description="mean (FedAvg; DualFed: unweighted), clipped_mean, or a robust rule: "
                            "median, trimmed_mean, multi_krum, centered_clip (these four unweighted, and they buffer "
                            "the round); "
                            f"auto: {AUTO_ROBUST_RULE} for the rounds of an enrolled fleet (security.enrolled_dir) of "
                            f"at most {AUTO_ROBUST_MAX_UPDATES} updates, where one enrolled device is one vote; "
                            "mean otherwise (an unsigned fleet, where anyone can send as any device; secure "
                            "aggregation; differential privacy) - docs/SECURITY.md, \"The default rule\"")
    clip_ratio: float = Field(1.0, gt=0, description="clipped_mean: largest change norm, relative to the reference's")
    trim_fraction: float = Field(0.2, gt=0, lt=0.5, description="trimmed_mean: share cut from each end per "
                                                                 "coordinate, at least one value each end of a round "
                                                                 "of 3 or more updates")
    clip_radius: float = Field(1.0, gt=0, description="centered_clip: how far from the round's coordinate-wise "
                                                       "median an update may pull, in median distances of the "
                                                       "round's updates from it")
    krum_byzantine: int = Field(1, ge=1, description="multi_krum: how many attackers to tolerate (f)")
    krum_select: int | None = Field(None, ge=1, description="multi_krum: updates averaged (m); default n - f")
    max_change_ratio: float | None = Field(
        10.0, gt=0, description="abort a round (reason 'diverged', state kept) whose aggregate moves the shared "
                               "parameters by more than this times their norm (at least 1); null: no bound")
    max_update_ratio: float | None = Field(
        10.0, gt=0, description="any rule: one update may change the learned parameters by a norm of at most this "
                               "times the reference's (at least 1); under secure aggregation each unmasked sum's "
                               "mean change is held to it (and a sum past it set aside); null: no bound")
    max_update_vs_median: float | None = Field(
        DEFAULT_MAX_UPDATE_VS_MEDIAN, ge=1,
        description="any rule: one update's change of the learned parameters is clipped (never refused) to at most "
                    "this times the larger of the median change of the updates the round's state was made from and "
                    "the device's own record (its last three changes, a clipped one recorded no higher than the "
                    "record before it; a state without the median: max_first_update_ratio); the statistics' clamps "
                    "widen to this times the device's own; null: no bound relative to the fleet or the device")
    max_first_update_ratio: float | None = Field(
        DEFAULT_MAX_FIRST_UPDATE_RATIO, gt=0,
        description="with max_update_vs_median, for a state without the fleet's record (a run's first round, a state "
                    "made by hand): one update's change of the learned parameters is clipped to at most this times "
                    "max(1, their norm); null: max_update_ratio alone")
    max_mean_shift: float | None = Field(
        DEFAULT_MAX_MEAN_SHIFT, gt=0,
        description="any rule: a BatchNorm running mean an update sends is clamped to move at most this many "
                    "reference standard deviations per channel (the layer's median variance added as a floor); never "
                    "a reason to refuse the update; null: no bound")
    max_variance_growth: float | None = Field(
        DEFAULT_MAX_VARIANCE_GROWTH, gt=1,
        description="any rule: a BatchNorm running variance an update sends is clamped to at most this times its "
                    "reference per channel (the layer's median variance added); shrinking is free; never a reason to "
                    "refuse the update; null: no bound")
    on_large_update: Literal["reject", "clip"] = Field(
        "reject", description="an update over max_update_ratio: reject it (reason 'out_of_range') or clip its "
                              "change onto the bound")
    max_weight_ratio: float | None = Field(
        DEFAULT_MAX_WEIGHT_RATIO, ge=1,
        description="one device's sample count weighs at most this times the median count of the round (training: "
                    "the counts its sampled agents announced; accuracy: the counts evaluated); a larger count is "
                    "cut to it, never rejected; null: every count as the device says")
    server_lr: float = Field(
        1.0, gt=0, le=1, description="each new state moves this share of the way from the state the round's tasks "
                                     "carried to the rule's aggregate of the shared parameters (a server learning "
                                     "rate, FedBuff's eta_g); below 1 smooths a run whose rounds each hear from a "
                                     "different part of a non-IID fleet")
    rollback_after: int | None = Field(
        3, ge=1, description="after this many aborted rounds in a row (any reason, below quorum included), go "
                             "back to the last good state: the last one a round was adopted from; null: never")

    def resolved(self, *, enrolled: bool = False, updates: int = 0, sites: bool = False) -> str:
        """The rule a round uses: :attr:`rule`, or for ``auto`` the rule for a round of
        ``updates`` updates of a fleet that is ``enrolled`` (signed by enrolled keys):
        :data:`AUTO_ROBUST_RULE` from 3 to :data:`AUTO_ROBUST_MAX_UPDATES` updates, ``mean``
        otherwise, and ``mean`` for a run that takes ``sites`` (a robust rule needs every
        single update, which a site's partial sum does not show: the bounds on each update
        still apply, at its site). Without enrolment anyone on the broker may send as any device, so a
        robust rule's "one device is one vote" holds for no one, while its cost to honest
        skewed devices stays; with one or two updates there is nothing to vote."""
        if self.rule != AUTO:
            return self.rule
        if sites:
            return "mean"
        return AUTO_ROBUST_RULE if enrolled and 3 <= updates <= AUTO_ROBUST_MAX_UPDATES else "mean"

    def build(self, *, enrolled: bool = False, updates: int = 0, sites: bool = False) -> Aggregator:
        """A new aggregator for this spec, with its update bound; ``enrolled``, ``updates`` and
        ``sites`` decide what ``auto`` is (:meth:`resolved`; by default: the mean)."""
        row = RULES[self.resolved(enrolled=enrolled, updates=updates, sites=sites)]
        rule = row.build(**{keyword: getattr(self, name) for name, keyword in row.options.items()})
        bounds = (self.max_update_ratio, self.max_update_vs_median, self.max_mean_shift, self.max_variance_growth)
        if bounds != (None, None, None, None):
            rule.bound = UpdateBound(self.max_update_ratio, self.on_large_update, self.max_mean_shift,
                                     self.max_variance_growth, self.max_update_vs_median, self.max_first_update_ratio)
        return rule
