"""The site fields of the wire (since protocol 1.13; docs/PROTOCOL.md §20): what a site
aggregator and the central coordinator say to each other.

A site aggregator is a coordinator to its site's devices (on the site's broker, in the
protocol every agent speaks, unchanged) and one participant of the central coordinator's
federation (on the central broker, with its own enrolled key):

============  ===========================  ==================================================
field         direction                    what it carries
============  ===========================  ==================================================
status.site   aggregator -> central        the site's online devices (:class:`SiteStatus`)
task.site     central -> aggregator        a round for some of them (:class:`SiteOrders`)
update.site   aggregator -> central        the site's share of it (:class:`SiteAnswer`) and,
                                           as the body's tensors, the exact partial sum
============  ===========================  ==================================================

The central coordinator samples the whole fleet's devices as if they were its own, hands
each site the records its bounds judge its devices by, and folds each site's partial sum
into the round as if every device's update had come to it: with a rule that composes the
round is the flat fleet's bit for bit (:mod:`edgepfl.aggregation.partial`). Every list is
bounded by :data:`MAX_SITE_DEVICES`.

Since 1.16 a run may take its sites in **summary** (``sites.mode: summary``): a site
announces how many devices it has (:attr:`SiteStatus.count`), not which; the central
coordinator orders it to sample a share of them itself (:class:`SiteSample`), and it keeps
its devices' records and answers with its partial sum and totals (:class:`SiteTotals`),
naming no device, so that what the central coordinator handles per round does not grow
with the devices behind its sites.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .evolution import since
from .topics import NAME_PATTERN

#: the most devices one site aggregator may announce or answer for
MAX_SITE_DEVICES = 10_000
#: the body of a site's answer: per shared tensor ``<key>``, the partial sum's integers as
#: ``SUM + key`` (int64 of the tensor's shape) when every one fits in int64, else its low word as
#: ``SUM_LOW + key`` and its high word as ``SUM_HIGH + key``
SUM = "site/sum/"
SUM_LOW = "site/low/"
SUM_HIGH = "site/high/"
#: the most records kept per device that a site is handed (the coordinator keeps 3)
MAX_RECORDS = 16
#: the most change norms a summary site reports: all of its updates' up to this many, else
#: this many evenly spaced quantiles of them (the central round's median is measured on them)
MAX_SUMMARY_NORMS = 16
_REASON = r"^[a-z][a-z0-9_]{0,31}$"

AgentName = Annotated[str, Field(pattern=NAME_PATTERN)]


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("must be finite")
    return value


#: a measure of a device's update: finite and not negative
Measure = Annotated[float, Field(ge=0), AfterValidator(_finite)]
#: what one device's update measured (``OwnRecord.to_json``): its change norm and, per BatchNorm
#: layer, the largest move of a running mean and the largest running variance
DeviceRecord = tuple[Measure, dict[Annotated[str, Field(max_length=256)], tuple[Measure, Measure]]]


class _Wire(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)


class SiteDevice(_Wire):
    """One online device of a site, as its aggregator announces it."""

    agent: AgentName
    #: the training samples its own status announced (what the round's weight cap is made of)
    num_train: int = Field(0, ge=0)
    num_test: int = Field(0, ge=0)


class SiteStatus(_Wire):
    """``status.site`` (since 1.13): the sender is a site aggregator, and these are its site's
    online trainers, each able to run the federation's method and model."""

    devices: list[SiteDevice] = Field(default_factory=list, max_length=MAX_SITE_DEVICES)
    #: a summary site (since 1.16): how many online trainers it has, ``devices`` then empty
    count: int | None = Field(None, ge=0, le=2**24, json_schema_extra=since("1.16"))


class SiteSample(_Wire):
    """``task.site.sample`` (since 1.16): a round of a summary site. It draws its trainers and
    evaluators from its own online devices with the round's seed, judges them by the records
    it keeps, and answers with :class:`SiteTotals`."""

    #: the share of its online devices that train (at least one when it is above 0; 0: none, the final evaluation)
    train_fraction: float = Field(ge=0, le=1)
    #: the share of its online devices whose evaluation the round wants, the trainers included (0: none)
    evaluate_share: float = Field(0.0, ge=0, le=1)
    #: the run's seed: the draw is the site's own, from (seed, round, site id)
    seed: int = Field(ge=0, lt=2**63)
    #: the round of this site's last task whose sum went into a state the run adopted (None: none
    #: since the run started or resumed, or that state was rolled back): the site keeps its
    #: devices' records of that task's round and forgets those of any other
    kept: int | None = Field(None, ge=0)


class SiteOrders(_Wire):
    """``task.site`` (since 1.13): a round for some of the site's devices. The task's tensors
    are what each device's own task carries; a train task's ``site`` names who trains."""

    #: the site's devices sampled to train, and those only to evaluate
    train: list[AgentName] = Field(default_factory=list, max_length=MAX_SITE_DEVICES)
    evaluate: list[AgentName] = Field(default_factory=list, max_length=MAX_SITE_DEVICES)
    #: the most weight one update of the round may carry (None: no cap): the fleet's, not the site's
    weight_cap: int | None = Field(None, ge=1)
    #: the median change of the updates the round's state was made from (None: not recorded)
    typical_change: Measure | None = None
    #: the kept records of the devices sampled to train that have one, newest last
    records: dict[AgentName, list[DeviceRecord]] = Field(default_factory=dict, max_length=MAX_SITE_DEVICES)
    #: the record a device without one is judged against (the fleet's largest; None: none yet)
    newcomer: DeviceRecord | None = None
    #: the central run's ``aggregation`` settings (rule, options, update bounds) the site sums by,
    #: as its config states them: the site applies exactly the central round's bounds
    aggregation: dict[Annotated[str, Field(max_length=64)], str | int | float | bool | None] = Field(
        default_factory=dict, max_length=64)
    #: a summary round (since 1.16; ``train``, ``evaluate``, ``records`` and ``newcomer`` then empty)
    sample: SiteSample | None = Field(None, json_schema_extra=since("1.16"))


class SiteTotals(_Wire):
    """``update.site.totals`` (since 1.16): a summary site's answer, naming no device."""

    #: how many of its devices it drew to train, how many updates it summed, and how many
    #: answered nothing in time
    sampled: int = Field(0, ge=0, le=2**24)
    trained: int = Field(0, ge=0, le=2**24)
    dropped: int = Field(0, ge=0, le=2**24)
    #: the devices whose held-out counts are in ``eval_total``
    evaluated: int = Field(0, ge=0, le=2**24)
    #: their held-out samples, each device's cut to ``max_weight_ratio`` times the site's median,
    #: and the correct answers so weighted (rounded): the site's share of the round's accuracy
    eval_total: int = Field(0, ge=0, le=2**40)
    eval_correct: int = Field(0, ge=0, le=2**40)
    #: the mean training loss of the updates summed (None: none reported one)
    train_loss: Measure | None = None
    #: the largest change norm of an update in the sum, as adopted (None: no bound measured one)
    largest_change: Measure | None = None
    #: how many updates each bound clipped
    clipped_by: dict[Annotated[str, Field(pattern=_REASON)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=16)


class DeviceAnswer(_Wire):
    """One device's answer, as its site's aggregator admitted it."""

    agent: AgentName
    kind: Literal["train", "evaluate"]
    num_train: int = Field(ge=0)
    num_test: int = Field(ge=0)
    eval_correct: int = Field(ge=0)
    eval_loss: float | None = None
    train_loss: float | None = None
    train_seconds: float = Field(0.0, ge=0)
    #: a training update's weight in the sum (its count, cut to the round's cap)
    weight: int | None = Field(None, ge=1, le=2**24)
    #: its staleness discount (1: trained on the round's state)
    discount: float = Field(1.0, gt=0, le=1)
    #: what the update bound measured of it as adopted (None: no bound)
    record: DeviceRecord | None = None
    #: the bounds that clipped or clamped it
    fired: list[Annotated[str, Field(pattern=_REASON)]] = Field(default_factory=list, max_length=8)
    #: it had no record and a bound clipped it
    clipped_newcomer: bool = False


class SiteAnswer(_Wire):
    """``update.site`` (since 1.13): the site's share of one round. With training answers the
    body holds the exact partial sum of their updates (:data:`SUM_LOW`, :data:`SUM_HIGH`) and
    these its counts; an evaluation round's answer has no body."""

    devices: list[DeviceAnswer] = Field(max_length=MAX_SITE_DEVICES)
    #: the partial sum: its updates' summed weight, how many the bound clipped, how many the
    #: rule's own clip shortened, and each one's change norm as adopted
    total_weight: int = Field(0, ge=0)
    clipped: int = Field(0, ge=0)
    rule_clipped: int = Field(0, ge=0)
    change_norms: list[Measure] = Field(default_factory=list, max_length=MAX_SITE_DEVICES)
    #: what the site refused of its devices' frames and tasks, by reason, and who did not answer
    rejected: dict[Annotated[str, Field(pattern=_REASON)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=64)
    refused: dict[Annotated[str, Field(pattern=_REASON)], Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, max_length=64)
    dropped: list[AgentName] = Field(default_factory=list, max_length=MAX_SITE_DEVICES)
    #: a summary round's answer (since 1.16; ``devices`` and ``dropped`` then empty, and
    #: ``change_norms`` at most :data:`MAX_SUMMARY_NORMS` quantiles of its updates' changes)
    totals: SiteTotals | None = Field(None, json_schema_extra=since("1.16"))


__all__ = ["DeviceAnswer", "DeviceRecord", "MAX_SITE_DEVICES", "MAX_SUMMARY_NORMS", "SUM", "SUM_HIGH", "SUM_LOW",
           "SiteAnswer", "SiteDevice", "SiteOrders", "SiteSample", "SiteStatus", "SiteTotals"]
