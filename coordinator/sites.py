"""A round across sites, as both ends of a site's uplink handle it (docs/PROTOCOL.md §20).

The central coordinator opens its round's aggregate as for a flat fleet and hands each site
:func:`orders_for` its sampled devices; the site aggregator opens :func:`site_aggregate`
from the task's state and those orders, so that its bounds judge each device exactly as the
central round would; it answers with :func:`answer_of` its round's :meth:`~RoundAggregate.site_part`
and the devices' evaluations; the central coordinator reads the answer back with
:func:`part_of`, checking everything it can, and folds it in with :meth:`~RoundAggregate.add_site`.

A summary round (``sites.mode: summary``) names no device on the uplink: the site draws its
own devices (:func:`draw_site`), answers with :func:`summary_answer_of` (its sum and totals),
and the central coordinator reads it with :func:`summary_part_of`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np

from edgepfl.aggregation import (
    UPDATE_HISTORY,
    UPDATE_NORM_MEDIAN,
    AggregationRejected,
    AggregationSpec,
    Aggregator,
    PartialSum,
    capped_counts,
)
from edgepfl.aggregation.partial import LOW_BITS
from edgepfl.methods import DevicePart, Method, RoundAggregate, ServerState, SitePart
from edgepfl.protocol import VARIANCE_GRID, supports
from edgepfl.protocol.site import (
    MAX_SUMMARY_NORMS,
    SUM,
    SUM_HIGH,
    SUM_LOW,
    DeviceAnswer,
    SiteAnswer,
    SiteOrders,
    SiteSample,
    SiteTotals,
)

from .sampling import EVALUATION_STREAM, draw, round_half_up, sample_size

#: keeps a summary site's draw apart from the central coordinator's streams of the seed and round
SITE_STREAM = 3


class DeviceEvaluation(Protocol):
    """One device's answer as a round records it (:class:`.result.Evaluation` is one)."""

    @property
    def correct(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def loss(self) -> float | None: ...
    @property
    def train_loss(self) -> float | None: ...
    @property
    def kind(self) -> str: ...
    @property
    def train_seconds(self) -> float: ...


def orders_for(aggregate: RoundAggregate, aggregation: AggregationSpec, train: Iterable[str],
               evaluate: Iterable[str] = (), weight_cap: int | None = None) -> SiteOrders:
    """The central round's orders to one site: who of its devices trains and who evaluates,
    the round's weight cap, its ``aggregation`` settings and what its bounds judge those devices by."""
    train = list(train)
    records, newcomer = aggregate.for_site(train)
    return SiteOrders(train=train, evaluate=list(evaluate), weight_cap=weight_cap,
                      aggregation=aggregation.model_dump(mode="json"),
                      typical_change=aggregate.typical_change,
                      records={a: [tuple(r) for r in rows] for a, rows in records.items()},
                      newcomer=None if newcomer is None else tuple(newcomer.to_json()))


def site_aggregate(method: Method, state: ServerState, rule: Aggregator, orders: SiteOrders) -> RoundAggregate:
    """The site's aggregate of a round whose task carried ``state``: judged by the records the
    central round handed it (``orders``), summing into ``rule`` (one that composes)."""
    from edgepfl.aggregation import OwnRecord

    extra = {UPDATE_NORM_MEDIAN: orders.typical_change,
             UPDATE_HISTORY: {a: [[change, dict(stats)] for change, stats in rows] for a, rows in orders.records.items()}}
    site_state = ServerState(global_tensors=state.shared_params(), extra=extra)
    newcomer = None if orders.newcomer is None else OwnRecord.from_json(orders.newcomer)
    return RoundAggregate(method, site_state, rule, newcomer=newcomer)


def answer_of(part: SitePart | None, answers: Mapping[str, DeviceEvaluation], *, rejected: Mapping[str, int] | None = None,
              refused: Mapping[str, int] | None = None,
              dropped: Iterable[str] = ()) -> tuple[SiteAnswer, dict[str, np.ndarray]]:
    """A site's answer to one round: every device answer it admitted (``answers``, as the round
    recorded them; the training ones are ``part``'s devices) and the partial sum as the body's tensors."""
    parts = {d.agent_id: d for d in part.devices} if part is not None else {}
    devices = []
    for agent, e in answers.items():
        d = parts.get(agent)
        devices.append(DeviceAnswer(
            agent=agent, kind=e.kind, num_train=d.weight if d else 0, num_test=e.total,
            eval_correct=e.correct, eval_loss=e.loss, train_loss=e.train_loss,
            train_seconds=e.train_seconds, weight=d.weight if d else None, discount=d.discount if d else 1.0,
            record=tuple(d.record) if d and d.record is not None else None,
            fired=list(d.fired) if d else [], clipped_newcomer=d.clipped_newcomer if d else False))
    tensors: dict[str, np.ndarray] = {}
    counts = {}
    if part is not None:
        s = part.sum
        tensors = sum_tensors(s)
        counts = dict(total_weight=s.total_weight, clipped=s.clipped, rule_clipped=s.rule_clipped,
                      change_norms=list(s.change_norms))
    return SiteAnswer(devices=devices, rejected=dict(rejected or {}), refused=dict(refused or {}),
                      dropped=list(dropped), **counts), tensors


def part_of(answer: SiteAnswer, tensors: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
            train: Iterable[str]) -> SitePart | None:
    """The site part a site's answer stands for (None: no training answer in it), for a round
    whose reference is ``reference`` and which sampled ``train`` of the site's devices.
    ``AggregationRejected`` for an answer that cannot be: tensors other than the sum's words,
    a device answering twice or training unsampled; :meth:`RoundAggregate.add_site` checks the rest."""
    agents = [d.agent for d in answer.devices]
    if len(set(agents)) != len(agents):
        raise AggregationRejected("malformed", "a device answers twice in a site's answer")
    trained = [d for d in answer.devices if d.kind == "train"]
    if any(d.eval_correct > d.num_test for d in answer.devices):
        raise AggregationRejected("malformed", "a device's eval_correct exceeds its num_test")
    outside = {d.agent for d in trained} - set(train)
    if outside:
        raise AggregationRejected("unexpected", f"{sorted(outside)[0]} was not sampled to train at this site")
    if not trained:
        if tensors:
            raise AggregationRejected("malformed", "a site's answer without training updates carries tensors")
        return None
    low, high = sum_words(tensors, reference)
    if any(d.weight is None for d in trained):
        raise AggregationRejected("malformed", "a site's training answer without its weight")
    total = PartialSum(low=low, high=high,
                       total_weight=answer.total_weight, count=len(trained), clipped=answer.clipped,
                       rule_clipped=answer.rule_clipped, change_norms=tuple(answer.change_norms))
    devices = tuple(DevicePart(d.agent, int(d.weight or 0), d.discount,
                               record=None if d.record is None else [d.record[0], dict(d.record[1])],
                               fired=tuple(d.fired), clipped_newcomer=d.clipped_newcomer) for d in trained)
    return SitePart(total, devices)


def central_too_old(version: str | None) -> str | None:
    """Why a site cannot sum for a central coordinator that announced ``version`` (None: no
    presence heard yet, taken as 1.0), or None when it can: before 1.17 the central side decodes a
    BatchNorm running variance on a grid 512 times finer than the site's sums (PROTOCOL.md §19.3)."""
    if supports(version, VARIANCE_GRID):
        return None
    return (f"the central coordinator speaks protocol {version or 'unknown'}; a site's sums need "
            f"{VARIANCE_GRID[0]}.{VARIANCE_GRID[1]}")


def draw_site(site_id: str, online: list[str], sample: SiteSample, r: int) -> tuple[list[str], list[str]]:
    """A summary site's round ``r``: who of its ``online`` devices trains and who only
    evaluates, drawn as the central coordinator draws its own (:func:`.sampling.choose_participants`)
    from the run's seed, the round and the site's id, so that a restarted site draws the same."""
    site = [*site_id.encode()]
    trainers = draw(online, sample_size(sample.train_fraction, len(online)), [sample.seed, r, SITE_STREAM, *site]) \
        if sample.train_fraction > 0 and online else []
    if sample.evaluate_share <= 0 or not online:
        return trainers, []
    training = set(trainers)
    wanted = max(1, round_half_up(sample.evaluate_share * len(online))) - len(trainers)
    return trainers, draw([a for a in online if a not in training], wanted,
                          [sample.seed, r, SITE_STREAM, EVALUATION_STREAM, *site])


def summary_answer_of(part: SitePart | None, answers: Mapping[str, DeviceEvaluation], *, sampled: int,
                      max_weight_ratio: float | None, rejected: Mapping[str, int] | None = None,
                      refused: Mapping[str, int] | None = None,
                      dropped: int = 0) -> tuple[SiteAnswer, dict[str, np.ndarray]]:
    """A summary site's answer to one round: its partial sum as the body and its totals, naming
    no device. Each device's held-out count is cut to ``max_weight_ratio`` times the site's
    median, as the central round cuts its own devices' (:func:`~edgepfl.aggregation.capped_accuracy`)."""
    pairs = [(e.correct, e.total) for e in answers.values() if e.total > 0]
    weights = capped_counts([t for _, t in pairs], max_weight_ratio)
    losses = [e.train_loss for e in answers.values() if e.kind == "train" and e.train_loss is not None]
    totals = dict(sampled=sampled, dropped=dropped, evaluated=len(pairs), eval_total=sum(weights),
                  eval_correct=round(sum(w * c / t for w, (c, t) in zip(weights, pairs))),
                  train_loss=float(np.mean(losses)) if losses and all(np.isfinite(losses)) else None)
    if part is None:
        return SiteAnswer(devices=[], rejected=dict(rejected or {}), refused=dict(refused or {}),
                          totals=SiteTotals(**totals)), {}
    s = part.sum
    norms = sorted(s.change_norms)
    fired = Counter(reason for d in part.devices for reason in d.fired)
    reported = norms if len(norms) <= MAX_SUMMARY_NORMS else \
        [float(q) for q in np.quantile(norms, np.linspace(0.0, 1.0, MAX_SUMMARY_NORMS))]
    answer = SiteAnswer(devices=[], total_weight=s.total_weight, clipped=s.clipped, rule_clipped=s.rule_clipped,
                        change_norms=reported, rejected=dict(rejected or {}), refused=dict(refused or {}),
                        totals=SiteTotals(**totals, trained=s.count, largest_change=norms[-1] if norms else None,
                                          clipped_by=dict(fired)))
    return answer, sum_tensors(s)


def summary_part_of(site_id: str, answer: SiteAnswer, tensors: Mapping[str, np.ndarray],
                    reference: Mapping[str, np.ndarray]) -> SitePart | None:
    """The site part a summary site's answer stands for (None: nothing trained), for a round
    whose reference is ``reference``; ``AggregationRejected`` for an answer that cannot be
    (devices named, counts that disagree, tensors other than the sum's words);
    :meth:`RoundAggregate.add_site` checks its sum against its largest change."""
    totals = answer.totals
    if totals is None or answer.devices or answer.dropped:
        raise AggregationRejected("malformed", "a summary site's answer names devices, or has no totals")
    if totals.trained > totals.sampled:
        raise AggregationRejected("malformed", "a summary site summed more updates than it sampled devices")
    if not totals.trained:
        if tensors or answer.total_weight:
            raise AggregationRejected("malformed", "a summary site's answer without updates carries a sum")
        return None
    if len(answer.change_norms) > min(totals.trained, MAX_SUMMARY_NORMS):
        raise AggregationRejected("malformed", "a summary site reports more change norms than it may")
    if any(n > totals.trained for n in totals.clipped_by.values()) or answer.clipped > totals.trained:
        raise AggregationRejected("malformed", "a summary site says more updates were clipped than it summed")
    low, high = sum_words(tensors, reference)
    # a site of more updates than norms reported sent quantiles: each stands for its share of them
    norms = tuple(answer.change_norms)
    total = PartialSum(low=low, high=high, total_weight=answer.total_weight, count=totals.trained,
                       clipped=answer.clipped, rule_clipped=answer.rule_clipped, change_norms=norms,
                       norm_weight=totals.trained / len(norms) if norms else 1.0)
    return SitePart(total, (), site=site_id, largest_change=totals.largest_change)


#: a high word in [-FITS, FITS) makes an integer ``high * 2**LOW_BITS + low`` that fits in int64
_FITS = 2 ** (63 - LOW_BITS)


def sum_tensors(total: PartialSum) -> dict[str, np.ndarray]:
    """A partial sum as the body of a site's answer: per tensor its integers in one int64
    (``SUM``) where they all fit, as they do unless a round's changes are near the grid's
    range; else its two words (``SUM_LOW``, ``SUM_HIGH``). Twice the bytes of a float32 model,
    where two words would be four times."""
    out: dict[str, np.ndarray] = {}
    for key, high in total.high.items():
        low = total.low[key]
        if high.size == 0 or (int(high.min()) >= -_FITS and int(high.max()) < _FITS):
            out[SUM + key] = (high << LOW_BITS) + low
        else:
            out[SUM_LOW + key], out[SUM_HIGH + key] = low, high
    return out


def sum_words(tensors: Mapping[str, np.ndarray],
              reference: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The two words per tensor of a site's body (:func:`sum_tensors`); ``AggregationRejected``
    unless it holds exactly one form of every tensor of ``reference`` and nothing else."""
    low: dict[str, np.ndarray] = {}
    high: dict[str, np.ndarray] = {}
    for key in reference:
        whole, low_word, high_word = (tensors.get(prefix + key) for prefix in (SUM, SUM_LOW, SUM_HIGH))
        if whole is not None and low_word is None and high_word is None and whole.dtype == np.int64:
            low[key], high[key] = whole & (2**LOW_BITS - 1), whole >> LOW_BITS
        elif whole is None and low_word is not None and high_word is not None:
            low[key], high[key] = low_word, high_word
        else:
            raise AggregationRejected("wrong_tensors", f"{key}: a site's body holds its sum in neither form, or in both")
    if len(tensors) != sum(1 + (SUM + k not in tensors) for k in reference):
        raise AggregationRejected("wrong_tensors", "a site's body holds tensors besides its partial sum")
    return low, high


__all__ = ["answer_of", "central_too_old", "draw_site", "orders_for", "part_of", "site_aggregate", "sum_tensors", "sum_words",
           "summary_answer_of", "summary_part_of"]
