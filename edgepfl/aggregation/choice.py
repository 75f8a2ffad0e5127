"""Which rule aggregates a training round: :func:`round_rule`, the one place that decides.

A run config names a rule (``aggregation.rule``, a row of :data:`~edgepfl.aggregation.rules.RULES`),
or ``auto`` (the default), which :meth:`~edgepfl.aggregation.AggregationSpec.resolved` turns
into a robust rule for an enrolled fleet's small rounds and the mean otherwise.
Two settings put another rule in a round's place:

* **secure aggregation**: :class:`~edgepfl.aggregation.SecureMean`, the only rule that can
  take masked vectors (the config allows it over ``mean`` alone); under distributed
  differential privacy it divides by the round's sample, since each device's clipped,
  noised change counts once;
* **central differential privacy**: :class:`~edgepfl.aggregation.GaussianMean` with the
  round's clip, noise and noise seed, keeping the configured BatchNorm clamps (relative to
  the reference, which is public) and leaving out the bounds that refuse an update or
  measure the fleet's changes: the clip is the bound.

Central DP is a replacement, not a wrapper around the configured rule in the way Flower's
``DifferentialPrivacyServerSideFixedClipping(strategy)`` wraps a strategy: its noise is
added to the *unweighted* sum of clipped changes, which is divided by the number of agents
sampled, not by the weight that answered, and no wrapper around the weighted
:class:`~edgepfl.aggregation.Mean` gives those bits. The config allows central DP over
``mean`` alone, so nothing a user chose is dropped.

What a round spends of the privacy budget is not decided here: the coordinator's privacy
ledger accounts for it.
"""

from __future__ import annotations

from collections.abc import Callable

from edgepfl.privacy import PrivacySpec

from .contract import Aggregator, UpdateBound
from .dp import AdaptiveClip, GaussianMean
from .secure import SecureMean
from .spec import AggregationSpec


def round_rule(aggregation: AggregationSpec, privacy: PrivacySpec, *, secure: bool, sampled: int, clip: float,
               noise_seed: int | list[int], on_next_clip: Callable[[float], None] | None = None,
               enrolled: bool = False, updates: int | None = None,
               denominator: float | None = None, sites: bool = False) -> Aggregator:
    """A fresh rule for a training round of ``sampled`` agents.

    ``secure``: the run's ``secure_aggregation.enabled``; ``enrolled``: whether only
    enrolled, signing devices are accepted (``security.enrolled_dir``), and ``updates`` how
    many updates the round aggregates (default ``sampled``; a buffered state's: its buffer),
    and ``sites`` (the run takes site aggregators' partial sums), which decide what
    ``aggregation.rule: auto`` is. Under central DP, ``clip`` is the
    round's clip norm (``privacy.clip_norm``, or the adaptive clip the last round chose),
    ``noise_seed`` seeds the round's noise and ``on_next_clip`` is told the clip an adaptive
    clip moves to, and ``denominator`` is what the noised sum is divided by (default
    ``sampled``; a Poisson round's expected count); otherwise they are not used."""
    if secure:  # masked updates: no bound can see one, only a sum of them (config validation)
        return SecureMean(denominator=None if privacy.mechanism == "none" else sampled,
                          max_update_ratio=aggregation.max_update_ratio)
    if privacy.mechanism == "none":
        return aggregation.build(enrolled=enrolled, updates=sampled if updates is None else updates, sites=sites)
    noise, adaptive = privacy.noise_multiplier, None
    if privacy.adaptive_clipping is not None:
        a = privacy.adaptive_clipping
        noise, count_noise = a.noise(privacy.noise_multiplier, add_or_remove=privacy.sampling == "poisson")
        adaptive = AdaptiveClip(a.target_quantile, a.learning_rate, count_noise)
    rule = GaussianMean(clip, noise, sampled if denominator is None else denominator, noise_seed, adaptive,
                        on_next_clip=on_next_clip)
    if aggregation.max_mean_shift is not None or aggregation.max_variance_growth is not None:
        # the BatchNorm clamps are relative to the reference (public); the bounds that
        # refuse an update or measure the fleet's changes are left out: the clip is the bound
        rule.bound = UpdateBound(None, "clip", aggregation.max_mean_shift, aggregation.max_variance_growth, None, None)
    return rule
