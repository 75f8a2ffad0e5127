"""The method interface: everything a federated method is, declared in one class.

A method states, once:

* its **config** (``config_class``, a pydantic model of typed options);
* its **model parts** (:meth:`Method.build_model`) and which ``state_dict`` entries
  are **shared** (averaged on the server) or **personal** (never leave the device),
  BatchNorm policy included (``shared_parts``, ``bn_policy``, ``upload_personal``);
* the **local update** run on a trainer agent (:meth:`Method.local_update`);
* the **server step** run on the coordinator — a round's aggregation opened with
  :meth:`Method.open_round`, fed one accepted update at a time, closed into the next
  state (:class:`RoundAggregate`; :meth:`Method.server_step` does all three at once)
  and :meth:`Method.payload_for` — pure numpy functions, no I/O;
* the **inference rule** (:meth:`Method.logits`) and personalized evaluation;
* the **export plan**: which module is the frozen encoder, which head runs on a
  device (:meth:`Method.encoder_module`, :meth:`Method.device_head`);
* the **heads a device fits** on that frozen encoder (``head_kinds``,
  :meth:`Method.make_head`, :meth:`Method.train_device_head`).

Coordinator, agent, simulator and exporter look a method up by name
(:func:`edgepfl.methods.get_method`) and call only this interface.

Naming on the wire: a parameter travels under its ``state_dict`` key; method
statistics travel as ``stat/<name>`` (agent -> coordinator) and server-computed
extras as ``server/<name>`` (coordinator -> agent). ``/`` never occurs in a
``state_dict`` key, so the namespaces cannot collide.

Torch is imported lazily inside methods so that the coordinator's protocol code and
the head tier can import this module without it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..aggregation import (
    CHANGE_BOUNDS,
    UPDATE_HISTORY,
    UPDATE_NORM_MEDIAN,
    AggregationRejected,
    Aggregator,
    Mean,
    OwnRecord,
    SecureMean,
    rebase,
)
from ..aggregation.contract import OWN_HISTORY
from ..aggregation.means import SummingRule
from ..aggregation.partial import PartialSum
from ..heads import GENERIC_HEAD_KINDS
from ..state import ServerState, TensorDict
from .training import EvalResult, LocalContext, evaluate_logits, fit, make_optimizer, recalibrate_batchnorm

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from ..data import ClientTensors
    from ..heads import HeadRelease
    from ..heads.estimators import HeadEstimator
    from ..specs import ModelSpec

STAT = "stat/"
SERVER = "server/"


class MethodConfig(BaseModel):
    """Base of every method's options. Unknown keys are an error, so typos are caught."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


#: the fields of the run's ``train`` section that a method's options may override, under
#: the same name, by the rule of :func:`train_override`
TRAIN_OVERRIDES = ("optimizer", "lr", "momentum", "weight_decay", "batch_size")
_OVERRIDE_BOUNDS: dict[str, dict[str, float]] = {
    "lr": {"gt": 0}, "momentum": {"ge": 0}, "weight_decay": {"ge": 0}, "batch_size": {"ge": 1}}


def train_override(field: str, default: Any = None, note: str = "", **bounds: Any) -> Any:
    """The pydantic ``Field`` of a method option named after ``train.<field>``, one of
    :data:`TRAIN_OVERRIDES`.

    One rule for every such option: a value replaces the run's ``train.<field>`` in the
    method's own training phases; ``None`` is the run's ``train.<field>``; an option the
    method does not declare is the run's too. ``default``: the method's value (its
    paper's), or None to follow the run. ``note`` opens the description; ``bounds``
    replace the field's usual constraints (a SupCon batch needs ``ge=2``). The optimizer
    is built by :func:`method_optimizer`, the batches by :meth:`LocalContext.batches`.
    """
    if field not in TRAIN_OVERRIDES:
        raise ValueError(f"{field!r} is not a train field a method may override ({', '.join(TRAIN_OVERRIDES)})")
    rule = f"None: the run's train.{field}"
    return Field(default, description=f"{note}; {rule}" if note else rule, **{**_OVERRIDE_BOUNDS.get(field, {}), **bounds})


def method_optimizer(config: MethodConfig, params: Iterable[torch.nn.Parameter], ctx: LocalContext,
                     **fixed: Any) -> torch.optim.Optimizer:
    """A fresh optimizer for one of a method's training phases, by :func:`train_override`'s
    rule: the run's ``train`` section, where ``config`` overrides a field with a value, that
    value. ``fixed``: what the phase sets whatever the options (FedPAC: SGD and the
    phase's own learning rate)."""
    overrides = {name: getattr(config, name, None) for name in ("optimizer", "lr", "momentum", "weight_decay")}
    overrides.update(fixed)
    return make_optimizer(params, ctx, **overrides)


class PersonalBatchNormConfig(MethodConfig):
    """Options of a method whose BatchNorm running statistics stay on the device while the
    layers they normalize are aggregated (``bn_policy`` "local" or "local_stats").

    The agent evaluates right after loading the aggregate, and the stored statistics were
    estimated under the client's previous model (an EMA over its last local training), so
    they do not describe the received model's features (measured: DualFed's collapse below
    the majority floor, research/RESULTS.md). Training normalizes with batch statistics and never reads the
    running ones, so re-estimating them changes what is evaluated, never what is trained.
    """

    bn_recalibrate: bool = Field(
        False, description="re-estimate the personal BatchNorm statistics on the client's training images for each "
                           "received model, before evaluating (False: the stored ones, as the published method)")


class UpdateRejected(ValueError):
    """An update that does not fit the server state; ``reason`` tags the counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class ClientUpdate:
    """One agent's contribution to a round, as the server step sees it."""

    agent_id: str
    num_samples: int
    tensors: TensorDict

    def stats(self) -> TensorDict:
        return {k[len(STAT) :]: v for k, v in self.tensors.items() if k.startswith(STAT)}

    def params(self) -> TensorDict:
        return {k: v for k, v in self.tensors.items() if "/" not in k}


@dataclass(frozen=True)
class DevicePart:
    """One device's update inside a site's partial sum: what the central round records of it
    as if the update had come to it (:meth:`RoundAggregate.add_site`)."""

    agent_id: str
    #: the update's weight (:meth:`Method.update_weight`)
    weight: int
    #: its staleness discount (1: trained on the round's state)
    discount: float = 1.0
    #: what the update bound measured of it as adopted (:meth:`OwnRecord.to_json`), before the
    #: round's close caps a first round's records; None: the rule has no bound
    record: list | None = None
    #: the bounds that clipped or clamped it (empty: none)
    fired: tuple[str, ...] = ()
    #: whether it had no record and a bound clipped it (its record is then held to the round's median)
    clipped_newcomer: bool = False


@dataclass(frozen=True)
class SitePart:
    """A site's share of one round: the exact partial sum of its devices' accepted updates
    and each device's part (:meth:`RoundAggregate.site_part`)."""

    sum: PartialSum
    devices: tuple[DevicePart, ...]
    #: a summary site's part (``sites.mode: summary``): the site, which names no device, and the
    #: largest change of an update in its sum, as adopted (None: no bound measured one)
    site: str | None = None
    largest_change: float | None = None


class RoundAggregate:
    """One round's aggregation for one method: :meth:`Method.open_round` opens it,
    :meth:`add` folds in each accepted update as it arrives, :meth:`close` makes the next
    :class:`ServerState`.

    The shared parameters go through the round's rule (:mod:`edgepfl.aggregation`),
    weighted by :meth:`Method.update_weight`, whatever the method: a robust rule applies
    to every method whose server step averages. For a streaming method
    (``Method.streaming``) nothing of an update is kept after :meth:`add` beyond what the
    rule keeps (a streaming rule: running sums, O(model)); a method whose server step
    needs every update (FedPAC) gets them all, sorted by agent id, in
    :meth:`Method.finish_round`.
    """

    def __init__(self, method: Method, state: ServerState, rule: Aggregator, server_lr: float = 1.0,
                 newcomer: OwnRecord | None = None):
        self.method = method
        self.state = state
        self.rule = rule
        #: the share of the way the shared parameters move from ``state`` to the rule's aggregate
        self.server_lr = server_lr
        self.reference = state.shared_params()
        #: agents whose update was added, in arrival order
        self.participants: list[str] = []
        #: every added update, only when the method is not streaming
        self.updates: list[ClientUpdate] = []
        #: per device, its last adopted updates' measures (the state's record, newest last)
        history = state.extra.get(UPDATE_HISTORY)
        self.history: dict[str, list] = {agent: list(entries) for agent, entries in (history or {}).items()}
        #: per device, its update's weight times its staleness discount (:meth:`shares`)
        self.weights: dict[str, float] = {}
        self._weight_total = 0.0
        #: what each device that sent an update this round measured, as adopted
        self.records: dict[str, OwnRecord] = {}
        #: devices without a record whose update a bound clipped this round
        self._clipped_newcomers: set[str] = set()
        #: per device that sent an update: its weight, discount and what the bounds did (site_part)
        self._parts: dict[str, DevicePart] = {}
        #: the record a device without one is judged against, when not the fleet's in ``state`` (a site's)
        self._newcomer = newcomer
        typical = state.extra.get(UPDATE_NORM_MEDIAN)
        #: the median change of the updates ``state`` was made from (None: not recorded)
        self.typical_change = float(typical) if isinstance(typical, (int, float)) else None
        if self.reference:
            rule.begin(self.reference, self.typical_change)

    @property
    def count(self) -> int:
        """Updates added so far."""
        return len(self.participants)

    def add(self, update: ClientUpdate, base: Mapping[str, np.ndarray] | None = None,
            discount: float = 1.0) -> tuple[str, ...]:
        """Fold in one update that passed :meth:`Method.check_update`; the names of the rule's
        update bounds that clipped or clamped its shared parameters first (empty: none). The
        device is judged against the fleet and its own record (:class:`~edgepfl.aggregation.UpdateBound`).

        ``base``: the shared parameters the update was trained from when they are not this
        round's (a late update): its change from them, times ``discount``, is applied to
        this round's (:func:`~edgepfl.aggregation.rebase`). Only a streaming method takes one.

        Raises :class:`~edgepfl.aggregation.AggregationRejected` (with a reason for the
        rejection counters) for an update the rule cannot take; the round then goes on
        as if it had not arrived.
        """
        fired: tuple[str, ...] = ()
        if base is not None and not self.method.streaming:
            raise ValueError(f"{self.method.name} aggregates a round's updates together: no late update")
        if self.reference and isinstance(self.rule, SecureMean):  # a secure round: the update is one masked vector
            fired = self.rule.add_masked(update.agent_id, update.tensors, self.method.update_weight(update))
        elif self.reference:
            shared = {k: v for k, v in update.tensors.items() if k in self.reference}
            applied = 1.0  # the share of its trained change the update carries (a late one: discounted)
            if base is not None and set(shared) == set(self.reference):
                shared = rebase(shared, base, self.reference, discount)
                applied = discount
            fired = self.rule.add(shared, self.method.update_weight(update), self.own_record(update.agent_id),
                                  applied)
            record = self.rule.last_record_
            if record is not None and fired:
                # a clipped update does not raise its sender's record (OwnRecord.at_most); in the
                # first round (no fleet median yet) close() holds it to the round's median
                before = OwnRecord.typical(self.history.get(update.agent_id, ()))
                record = record.at_most(before, self.typical_change)
                if before is None:
                    self._clipped_newcomers.add(update.agent_id)
            if record is not None:
                self.records[update.agent_id] = record
        weight = self.method.update_weight(update)
        # its record is written into the part only if a site's part is asked for (site_part)
        self._count(DevicePart(update.agent_id, int(weight), discount, fired=fired,
                               clipped_newcomer=update.agent_id in self._clipped_newcomers))
        if not self.method.streaming:
            self.updates.append(update)
        return fired

    def leave_out(self, agents: Iterable[str]) -> None:
        """Take back ``agents``' updates, counted as added, that did not make the sum after all (a
        secure round's group set aside or not unmasked): they are not participants, and do not
        count towards the round's quorum."""
        for agent in set(agents).intersection(self.participants):
            self.participants.remove(agent)
            part = self._parts.pop(agent)
            self.weights.pop(agent, None)
            self._weight_total -= float(part.weight)

    def _count(self, part: DevicePart) -> None:
        """Count one device's update as added: its weight, share and place among the participants."""
        self.weights[part.agent_id] = float(part.weight) * part.discount
        self._weight_total += float(part.weight)
        self.participants.append(part.agent_id)
        self._parts[part.agent_id] = part

    # ------------------------------------------------------------------ sites
    def for_site(self, agents: Iterable[str]) -> tuple[dict[str, list], OwnRecord | None]:
        """What a site aggregator judges ``agents`` by, so that its bounds decide as this round
        would: their kept records (as :data:`UPDATE_HISTORY` holds them) and the record a device
        without one is given (the fleet's largest, :meth:`own_record`)."""
        records = {a: list(self.history[a]) for a in sorted(set(agents)) if a in self.history}
        return records, self._newcomer_record()

    def _newcomer_record(self) -> OwnRecord | None:
        """What a device without a record is judged against: the one handed in (a site's), or the
        fleet's largest, measured once a round (the records change only when the round closes)."""
        if self._newcomer is None and self.history:
            self._newcomer = OwnRecord.largest(r for r in map(OwnRecord.typical, self.history.values())
                                               if r is not None)
        return self._newcomer

    def site_part(self) -> SitePart:
        """The round so far as one site's share (:meth:`add_site` folds it in elsewhere): a
        streaming method's under a rule that composes (``TypeError`` otherwise)."""
        rule = self._summing_rule()
        records = self.records
        return SitePart(rule.partial(), tuple(
            replace(self._parts[a], record=records[a].to_json() if a in records else None) for a in self.participants))

    def add_site(self, part: SitePart, base: Mapping[str, np.ndarray] | None = None, discount: float = 1.0) -> None:
        """Fold in a site's :meth:`site_part` of this round, as if each of its devices' updates had
        been added here. Raises :class:`AggregationRejected` for a part that cannot be the sum of
        its devices' updates (its counts disagree, a device twice), before anything of it counts.
        ``base``, ``discount``: a summary site's part of an earlier state of a buffered run, whose
        sum is over that state's shared parameters (:meth:`SummingRule.add_stale_partial`)."""
        rule = self._summing_rule()
        if part.site is not None:
            return self._add_summary(rule, part, base, discount)
        if base is not None:
            raise ValueError("a site's part naming its devices is this round's: no earlier state")
        agents = [d.agent_id for d in part.devices]
        if len(agents) != part.sum.count or len(set(agents)) != len(agents):
            raise AggregationRejected("malformed", "a site's devices and its sum's count disagree")
        if any(a in self._parts for a in agents):
            raise AggregationRejected("duplicate", "a device of the site already has an update in the round")
        weights = [d.weight for d in part.devices]
        if any(w < 1 for w in weights) or any(not 0.0 < d.discount <= 1.0 for d in part.devices):
            raise AggregationRejected("malformed", "a site's device weighs nothing, or more than its whole update")
        if self.rule.weighted and sum(weights) != part.sum.total_weight:
            raise AggregationRejected("malformed", "a site's devices' weights do not add up to its sum's")
        records = {d.agent_id: OwnRecord.from_json(d.record) for d in part.devices if d.record is not None}
        part.sum.check(self.reference)  # what a sum can be, before what its devices' claims allow
        self._check_site_claims(part, records)
        rule.add_partial(part.sum)
        for d in part.devices:
            self._count(d)
            if d.agent_id in records:
                self.records[d.agent_id] = records[d.agent_id]
            if d.clipped_newcomer:
                self._clipped_newcomers.add(d.agent_id)

    def _add_summary(self, rule: SummingRule, part: SitePart, base: Mapping[str, np.ndarray] | None,
                     discount: float) -> None:
        """Fold in a summary site's part as one participant weighing its sum's weight. Its
        devices' records are the site's; what is checked here is what its sum shows: the
        largest change it claims within every bound that does not need a device's record (the
        model's, ``max_update_ratio``; the first round's), each change it reports no larger,
        and the sum no further from the reference than its weight times that change."""
        site = part.site
        assert site is not None  # the caller's condition
        if site in self._parts:
            raise AggregationRejected("duplicate", f"site {site} already has a sum in the round")
        part.sum.check(self.reference if base is None else base)
        bound = self.rule.bound
        if bound is not None and bound.parameters_:
            largest = part.largest_change
            if largest is None:
                raise AggregationRejected("malformed", "a summary site's sum without its largest change")
            limits = [limit for limit in (bound.limit_, bound.fleet_limit_ if bound.first_limit_ else None)
                      if limit is not None]
            if limits and largest > min(limits) * (1 + 1e-6):
                raise AggregationRejected("out_of_range", f"site {site} says an update changed the parameters by "
                                                          f"{largest:.4g}, past the bound {min(limits):.4g}")
            if any(n > largest * (1 + 1e-6) for n in part.sum.change_norms):
                raise AggregationRejected("malformed", f"site {site} reports a change above its largest")
            summed, slack = rule.partial_change(part.sum, bound.parameters_, base)
            if summed > part.sum.total_weight * largest * (1 + 1e-6) + slack:
                raise AggregationRejected("out_of_range", f"site {site}'s sum moves the parameters by {summed:.4g}, "
                                                          f"more than its weight times its largest change allows")
        if base is None:
            rule.add_partial(part.sum)
        else:
            rule.add_stale_partial(part.sum, base, discount)
        self._count(DevicePart(site, part.sum.total_weight, discount))

    def _check_site_claims(self, part: SitePart, records: dict[str, OwnRecord]) -> None:
        """What a site says its devices' updates measured, held to what the round's bound lets a
        device do: each device's change at most its bound here (the fleet's median, its own
        record, the model's norm: the numbers the site was handed), and the site's sum no
        further from the reference than those changes, weighted, can add up to. A site that
        passed an update past its bound, or claims smaller changes than it summed (to keep its
        devices' records low, or to widen them next round with a sum that does not show it),
        is refused whole (``out_of_range``, ``malformed``)."""
        bound = self.rule.bound
        if bound is None or not bound.parameters_:
            return
        applied = 0.0
        for d in part.devices:
            record = records.get(d.agent_id)
            if record is None:
                raise AggregationRejected("malformed", f"a site's part has no record of {d.agent_id}'s update")
            limits = [] if bound.limit_ is None else [bound.limit_ / d.discount]
            if (relative := bound.relative_limit(self.own_record(d.agent_id))) is not None:
                limits.append(relative[0])
            if limits and record.change > min(limits) * (1 + 1e-6):
                raise AggregationRejected("out_of_range", f"a site says {d.agent_id}'s update changed the parameters "
                                                          f"by {record.change:.4g}, past its bound {min(limits):.4g}")
            # a clipped update moved the parameters by its bound, and is recorded lower (OwnRecord.at_most)
            moved = min(limits) if limits and CHANGE_BOUNDS.intersection(d.fired) else record.change
            applied += d.weight * d.discount * moved
        summed, slack = self._summing_rule().partial_change(part.sum, bound.parameters_)
        if summed > applied * (1 + 1e-6) + slack:
            raise AggregationRejected("out_of_range", f"a site's sum moves the parameters by {summed:.4g}, more than "
                                                      f"the changes it reports of its devices add up to ({applied:.4g})")
        self._check_site_statistics(part, records)

    def _check_site_statistics(self, part: SitePart, records: dict[str, OwnRecord]) -> None:
        """What a site says of its devices' BatchNorm statistics, held to its sum: in each
        channel the summed move of a running mean at most the devices' reported largest moves,
        weighted, and the summed running variance at most their reported largest variances,
        weighted (a device a bound clipped counts at its bound: its record is kept lower). A
        site that keeps its devices' statistics records low while summing more refuses whole."""
        bound, rule = self.rule.bound, self._summing_rule()
        assert bound is not None  # the caller's condition
        weights = {d.agent_id: d.weight if self.rule.weighted else 1 for d in part.devices}
        for layer in bound.layers_:
            moves: float | None = 0.0
            variances: float | None = 0.0
            for d in part.devices:
                weight = weights[d.agent_id]
                if d.fired:
                    move, var = bound.statistic_limit(layer, self.own_record(d.agent_id))
                elif layer in records[d.agent_id].statistics:
                    move, var = records[d.agent_id].statistics[layer]
                elif bound.statistic_limits_[layer][1].size:  # a layer with channels is always measured
                    raise AggregationRejected("malformed", f"a site's record of {d.agent_id} leaves out {layer}")
                else:
                    continue
                moves = None if moves is None or move is None else moves + weight * move
                variances = None if variances is None or var is None else variances + weight * var
            mean_sum, slack = rule.partial_totals(part.sum, layer + "running_mean")
            if moves is not None and mean_sum.size and float(np.max(np.abs(mean_sum))) > moves * (1 + 1e-6) + slack:
                raise AggregationRejected("out_of_range", f"a site's sum moves {layer}running_mean by more than the "
                                                          "largest moves it reports of its devices add up to")
            var_sum, slack = rule.partial_totals(part.sum, layer + "running_var")
            reference = self.reference[layer + "running_var"].astype(np.float64)
            if variances is not None and var_sum.size and \
                    float(np.max(var_sum + sum(weights.values()) * reference)) > variances * (1 + 1e-6) + slack:
                raise AggregationRejected("out_of_range", f"a site's sum holds larger {layer}running_var than the "
                                                          "largest variances it reports of its devices add up to")

    def shares(self) -> dict[str, float]:
        """Each device's share of the round's change of the shared parameters under a weighted
        rule: its weight times its staleness discount over the sum of the updates' weights (a
        late update's change is scaled by its discount, the sum is not). What the slow devices
        of a buffered fleet carry is their shares' sum; a robust rule weighs by its own rules."""
        total = self._weight_total
        return {a: w / total for a, w in sorted(self.weights.items())} if total > 0 else {}

    def _summing_rule(self) -> SummingRule:
        """The round's rule, when a site's sum of updates adds to another's (``TypeError``: it does not)."""
        if not self.method.streaming:
            raise TypeError(f"{self.method.name} needs every update of a round together: no site sums")
        if not isinstance(self.rule, SummingRule):
            raise TypeError(f"{type(self.rule).__name__} needs every single update: no site sums")
        return self.rule

    def own_record(self, agent_id: str) -> OwnRecord | None:
        """What ``agent_id`` is judged against besides the fleet: each measure's lower median
        over its kept records; a device without one (first sampled now) the fleet's largest,
        so that it may be as different as the fleet's devices have shown they are; None
        before any record."""
        own = OwnRecord.typical(self.history.get(agent_id, ()))
        if own is not None:
            return own
        return self._newcomer_record()

    def close(self, round: int) -> ServerState:
        """The next server state from every update added (at least one)."""
        if not self.participants:
            raise RuntimeError("no update was added this round")
        shared = self.rule.result() if self.reference else {}
        if shared and self.server_lr != 1.0:
            shared = rebase(shared, self.reference, self.reference, self.server_lr)
        updates = sorted(self.updates, key=lambda u: u.agent_id)
        state = self.method.finish_round(self.state, shared, updates, round)
        # the next round's bound relative to the fleet is measured on this one's updates
        typical = self.rule.median_change() if self.reference else None
        extra = {k: v for k, v in state.extra.items() if k not in (UPDATE_NORM_MEDIAN, UPDATE_HISTORY)}
        if typical is not None:
            extra[UPDATE_NORM_MEDIAN] = typical
        # each device that sent an update this round keeps its last few records; the others theirs.
        # A round judged without the fleet's record (the first) clipped relative to the model
        # alone, far above any honest change: what it records is at most vs_median times its
        # median, so that a first update cannot open a wide bound for the rounds after it
        history = dict(self.history)
        bound = self.rule.bound
        first_cap = None
        if bound is not None and bound.first_limit_ and bound.vs_median is not None and typical is not None:
            first_cap = bound.vs_median * typical
        for agent, record in self.records.items():
            if first_cap is not None:
                cap = typical if agent in self._clipped_newcomers and typical is not None else first_cap
                record = record._replace(change=min(record.change, cap))
            history[agent] = (history.get(agent, []) + [record.to_json()])[-OWN_HISTORY:]
        if history:
            extra[UPDATE_HISTORY] = {agent: history[agent] for agent in sorted(history)}
        return replace(state, extra=extra)


@dataclass
class LocalResult:
    """What :meth:`Method.local_update` returns: tensors to upload and training metrics."""

    upload: TensorDict
    train_loss: float = math.nan
    metrics: dict[str, float] = field(default_factory=dict)


class Method:
    """Base class; subclasses override what makes them different.

    Subclasses set ``name`` and are registered with :func:`edgepfl.methods.register`.
    ``__init__`` stores the config and does no other work.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    #: module-name prefixes whose parameters are shared; () shares nothing (Local)
    shared_parts: ClassVar[tuple[str, ...]] = ("encoder", "head")
    #: BatchNorm: "shared" (like any layer), "local" (all BN parameters and
    #: statistics personal: FedBN, FedPick) or "local_stats" (affine shared,
    #: running mean/var personal: DualFed)
    bn_policy: ClassVar[Literal["shared", "local", "local_stats"]] = "shared"
    #: personal prefixes that are nevertheless uploaded for a server computation
    #: (FedPAC's heads); listed so the contract tests can tell them from leaks
    upload_personal: ClassVar[tuple[str, ...]] = ()
    #: module-name prefixes whose uploaded tensors a compressed update must send exactly
    #: (docs/COMPRESSION.md): what the server computes with beyond averaging (FedPAC's heads)
    exact_uploads: ClassVar[tuple[str, ...]] = ()
    #: False when the server step needs every update of the round at once (FedPAC's
    #: weights over clients' statistics): :meth:`finish_round` then gets them all. True:
    #: an update is folded in when it arrives and then dropped (memory O(model)).
    streaming: ClassVar[bool] = True
    #: heads a device can fit on this method's frozen encoder, built by :meth:`make_head`:
    #: the generic kinds of :mod:`edgepfl.heads` and, for a method with a head of its own
    #: (DualFed, FedPick), the method's name. The one vocabulary of head kinds.
    head_kinds: ClassVar[tuple[str, ...]] = GENERIC_HEAD_KINDS

    def __init__(self, config: MethodConfig | None = None):
        self.config = config if config is not None else self.config_class()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # ------------------------------------------------------------------ model parts
    def build_model(self, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """Build the full model (shared and personal parts). Default: encoder + linear head."""
        from ..models import SplitModel

        return SplitModel.build(spec, input_shape, num_classes)

    def shared_keys(self, model: nn.Module) -> list[str]:
        """``state_dict`` keys aggregated on the server, derived from the class attributes."""
        from torch.nn.modules.batchnorm import _BatchNorm

        bn_modules = {name for name, mod in model.named_modules() if isinstance(mod, _BatchNorm)}
        keys = []
        for key in model.state_dict():
            module, _, leaf = key.rpartition(".")
            if leaf == "num_batches_tracked":
                continue
            if not any(key == p or key.startswith(p + ".") for p in self.shared_parts):
                continue
            if module in bn_modules:
                if self.bn_policy == "local":
                    continue
                if self.bn_policy == "local_stats" and leaf in ("running_mean", "running_var"):
                    continue
            keys.append(key)
        return keys

    def personal_state(self, model: nn.Module) -> TensorDict:
        """Everything that stays on the device (saved by the agent between rounds)."""
        shared = set(self.shared_keys(model))
        return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items() if k not in shared}

    def shared_params(self, model: nn.Module) -> TensorDict:
        sd = model.state_dict()
        return {k: sd[k].detach().cpu().numpy().copy() for k in self.shared_keys(model)}

    # ------------------------------------------------------------------ agent side
    def receive(self, model: nn.Module, payload: TensorDict, ctx: LocalContext) -> None:
        """Load the coordinator's payload into the model; ``server/`` extras are the method's."""
        load_tensors(model, {k: v for k, v in payload.items() if "/" not in k})

    def local_update(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> LocalResult:
        """Train locally; return what to upload. Default: supervised epochs on everything."""
        loss = fit(model, data, ctx, lambda m, x, y: _ce(self.logits(m, x), y), model.parameters(), ctx.train.epochs)
        return LocalResult(upload=self.shared_params(model), train_loss=loss)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The inference rule: class scores for a batch."""
        return model(x)

    def evaluate(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> EvalResult:
        """Personalized evaluation on the client's own held-out split; with
        ``bn_recalibrate`` (:class:`PersonalBatchNormConfig`) on personal BatchNorm
        statistics re-estimated for the received model first (:meth:`recalibrate`)."""
        if isinstance(self.config, PersonalBatchNormConfig) and self.config.bn_recalibrate:
            self.recalibrate(model, data)
        return evaluate_logits(lambda x: self.logits(model, x), model, data.x_test, data.y_test, ctx)

    def recalibrate(self, model: nn.Module, data: ClientTensors) -> int:
        """Re-estimate the BatchNorm running statistics of the encoder (:meth:`encoder_module`)
        on the client's training images, without gradient and moving no parameter; returns
        the number of images used. A method with personal statistics outside its encoder
        (DualFed's projector) widens it."""
        encoder = self.encoder_module(model)
        return recalibrate_batchnorm(model, encoder, data.x_train, layers=list(encoder.modules()))

    # ------------------------------------------------------------------ server side
    def init_server(self, model: nn.Module) -> ServerState:
        """Initial server state from a freshly built model."""
        return ServerState(global_tensors=self.shared_params(model))

    def stat_shapes(self, state: ServerState) -> dict[str, tuple[int | None, ...]]:
        """``stat/`` tensors an update must carry (None: any size on that axis)."""
        return {}

    def check_update(self, state: ServerState, update: ClientUpdate) -> None:
        """Reject an update that does not fit; called before :meth:`RoundAggregate.add`."""
        expected = state.shared_params()
        got = update.params()
        personal_ok = [k for k in got if any(k.startswith(p + ".") for p in self.upload_personal)]
        missing = set(expected) - set(got)
        unexpected = set(got) - set(expected) - set(personal_ok)
        if missing or unexpected:
            raise UpdateRejected(
                "wrong_tensors", f"missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        for key, ref in expected.items():
            arr = got[key]
            if arr.shape != ref.shape or arr.dtype != ref.dtype:
                raise UpdateRejected("wrong_shape", f"{key}: got {arr.dtype}{list(arr.shape)}, want {ref.dtype}{list(ref.shape)}")
        stats = update.stats()
        want = self.stat_shapes(state)
        if set(stats) != set(want):
            raise UpdateRejected("wrong_tensors", f"stats {sorted(stats)} != expected {sorted(want)}")
        for key, shape in want.items():
            s = stats[key].shape
            if len(s) != len(shape) or any(a is not None and a != b for a, b in zip(shape, s)):
                raise UpdateRejected("wrong_shape", f"stat/{key}: got {list(s)}, want {list(shape)}")

    def update_weight(self, update: ClientUpdate) -> int:
        """An update's weight in the rule's mean. Default: its sample count (which the
        coordinator bounds by the count the agent announced)."""
        return update.num_samples

    def open_round(self, state: ServerState, rule: Aggregator, server_lr: float = 1.0) -> RoundAggregate:
        """Start aggregating a round whose tasks carried ``state``, its shared parameters with
        ``rule``; the next state's move ``server_lr`` of the way from ``state`` to the aggregate."""
        return RoundAggregate(self, state, rule, server_lr)

    def finish_round(self, state: ServerState, shared: TensorDict, updates: list[ClientUpdate],
                     round: int) -> ServerState:
        """The next state from ``shared``, the rule's aggregate of the shared parameters.

        ``updates``: every update of the round sorted by agent id when the method is not
        :attr:`streaming`, else empty. Default: ``shared`` replaces the global parameters.
        """
        merged = dict(state.global_tensors)
        merged.update(shared)
        return ServerState(global_tensors=merged, client_tensors=state.client_tensors, extra=state.extra)

    def server_step(self, state: ServerState, updates: list[ClientUpdate], round: int,
                    rule: Aggregator | None = None) -> ServerState:
        """Aggregate one round's updates at once (``rule`` default: the weighted mean):
        :meth:`open_round`, :meth:`RoundAggregate.add` in agent-id order, :meth:`RoundAggregate.close`."""
        aggregate = self.open_round(state, rule if rule is not None else Mean())
        for update in sorted(updates, key=lambda u: u.agent_id):
            aggregate.add(update)
        return aggregate.close(round)

    def payload_for(self, state: ServerState, agent_id: str) -> TensorDict:
        """What one agent receives with its task. Default: the global tensors."""
        return dict(state.global_tensors)

    # ------------------------------------------------------------------ export plan
    def encoder_module(self, model: nn.Module) -> nn.Module:
        """The frozen part exported to ONNX: input image -> feature vector."""
        return model.get_submodule("encoder")

    def device_head(self, model: nn.Module) -> nn.Module | None:
        """The personalized head as a torch module (features -> logits) for ONNX, if any."""
        return getattr(model, "head", None)

    # ------------------------------------------------------------------ heads on the frozen encoder
    def make_head(self, kind: str, release: HeadRelease | None = None, **params: Any) -> HeadEstimator:
        """A new, unfitted head of ``kind`` for this method's encoder: a scikit-learn estimator.

        What a device fitting a head on an encoder this method trained gets (the head
        tier, ``edgepfl fit-head``). Base: the generic kinds of :mod:`edgepfl.heads`
        with their defaults; a method whose options set head parameters maps them here
        (RepPer), and a method with a head of its own builds it for ``kind == name``
        (DualFed, FedPick). ``release``: the encoder release, where a head needs more
        of it than its features (the federation's global heads). ``params`` override.
        Raises ``ValueError`` for a kind not in :attr:`head_kinds`.
        """
        if kind not in self.head_kinds:
            raise ValueError(f"head {kind!r} does not fit a {self.name} encoder; choose from {', '.join(self.head_kinds)}")
        if kind not in GENERIC_HEAD_KINDS:
            raise NotImplementedError(f"{type(self).__name__} lists head kind {kind!r} but its make_head does not build it")
        from ..heads.estimators import generic_head

        return generic_head(kind, **params)

    def train_device_head(self, model: nn.Module, data: ClientTensors, ctx: LocalContext) -> float:
        """Train the personal parts of this method's own head on frozen features; returns the loss.

        ``model`` is this method's model on an identity encoder, the federation's parts
        loaded and frozen (:class:`~edgepfl.methods.device_head.TorchDeviceHead`).
        Default: the method's own local update.
        """
        return self.local_update(model, data, ctx).train_loss


def load_tensors(model: nn.Module, tensors: TensorDict) -> None:
    """Copy numpy tensors into matching ``state_dict`` entries (in place, no realloc).

    Every tensor must name an entry and have exactly its shape: ``copy_`` would broadcast
    a (1, 1) tensor into a (10, 8) weight without complaint, training a model nobody sent.
    """
    import torch

    if not tensors:
        return
    sd = model.state_dict()
    unknown = [k for k in tensors if k not in sd]
    if unknown:
        raise KeyError(f"tensors not in model: {unknown[:5]}")
    wrong = [f"{k} {list(np.shape(v))} (model {list(sd[k].shape)})" for k, v in tensors.items()
             if tuple(np.shape(v)) != tuple(sd[k].shape)]
    if wrong:
        raise ValueError(f"tensors of another shape than the model's: {', '.join(wrong[:3])}")
    with torch.no_grad():
        for key, value in tensors.items():
            sd[key].copy_(torch.from_numpy(np.asarray(value)))


def _ce(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits, y)


def model_size(method: Method, spec: ModelSpec, input_shape: tuple[int, ...], num_classes: int) -> int | None:
    """How many parameters ``method`` builds ``spec`` with, counted on torch's meta device (shapes,
    no storage, no random numbers drawn); None when it cannot be built there (nor, perhaps, at all:
    a plugin computing with its tensors while it is built, an input the arch cannot take)."""
    import torch

    try:
        with torch.device("meta"):
            model = method.build_model(spec, tuple(input_shape), num_classes)
    except Exception:  # its real build says what is wrong with it  # noqa: BLE001
        return None
    return sum(p.numel() for p in model.parameters())
