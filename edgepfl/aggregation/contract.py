"""The contract every aggregation rule follows (:class:`Aggregator`) and the bound on
one update that applies whatever the rule (:class:`UpdateBound`).

A rule is :meth:`~Aggregator.begin` with the round's reference (the global parameters
the tasks carried), :meth:`~Aggregator.add` one accepted update at a time,
:meth:`~Aggregator.result` once the round closes; an update the rule cannot take is
refused with :class:`AggregationRejected`, before anything of it counts.

**Bounded trust in every update.** Whatever the rule, :class:`UpdateBound` bounds how
far one update may move the shared state from the reference: the learned parameters by
the norm of their change (``max_update_ratio`` times the reference's norm, at least 1),
BatchNorm's running statistics per channel in their own geometry (a mean in reference
standard deviations, ``max_mean_shift``; a variance's growth, ``max_variance_growth``),
clamped onto them, never refused, so that a device whose data is unusual is not shut
out. An update over the parameters' bound is refused (``out_of_range``) or clipped onto it
(``on_large_update: clip``). Within it, a change is also clipped (never refused) to
``max_update_vs_median`` times the median change of the updates the reference was made
from, so that one device's change weighs no more than a few honest devices' whatever
the model's norm. Either way the decision and the clipped tensors depend on that update,
the reference and the reference's own record alone, never on what else arrived.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import ClassVar, Literal, NamedTuple

import numpy as np

from ..state import TensorDict

#: the most weight (sample count) one update may carry in a streaming rule
MAX_UPDATE_WEIGHT = 2**24
#: a device's count weighs at most this times the round's median count (``max_weight_ratio``)
DEFAULT_MAX_WEIGHT_RATIO = 1.0
#: an update's change is clipped to this times the median change behind the reference
#: (``max_update_vs_median``); honest non-IID fleets measured up to 3.9
DEFAULT_MAX_UPDATE_VS_MEDIAN = 5.0
#: before the fleet has a record: a change is clipped to this times the parameters' norm
#: (``max_first_update_ratio``); honest first updates measured up to 0.37
DEFAULT_MAX_FIRST_UPDATE_RATIO = 1.0
#: ``ServerState.extra`` key: the median change norm of the updates a state was made from
UPDATE_NORM_MEDIAN = "update_norm_median"
#: ``ServerState.extra`` key: per device, its last :data:`OWN_HISTORY` adopted updates
#: measured (:class:`OwnRecord`, newest last): what the device is judged against besides the fleet
UPDATE_HISTORY = "update_history"
#: how many of a device's own adopted updates its record keeps: its change is judged against
#: the largest of them (an honest device whose change alternates small and large round after
#: round keeps its large one in view), its statistics against their lower median
OWN_HISTORY = 3
#: a running mean may move this many reference standard deviations (``max_mean_shift``);
#: honest skewed devices measured up to 32 (benchmarks/results/honest_fleets.md)
DEFAULT_MAX_MEAN_SHIFT = 200.0
#: a running variance may grow to this times its reference (``max_variance_growth``);
#: honest skewed devices measured up to 1,800 (a channel the others' data barely lights)
DEFAULT_MAX_VARIANCE_GROWTH = 10_000.0
#: the bounds that clip an update's change of the learned parameters (what :meth:`UpdateBound.apply`
#: names in ``fired`` when it shortened the change; the statistics' clamps are the others)
CHANGE_BOUNDS = frozenset({"max_update_ratio", "max_update_vs_median", "max_first_update_ratio"})
#: how far (in units of the reference's largest magnitude, at least 1) a coordinate may move
CHANGE_RANGE = 2**6
#: how far a BatchNorm running variance may move, in the same units (protocol 1.17): room for
#: every variance the default ``max_variance_growth`` keeps, 10,000 x (a channel's variance + the
#: layer's median) <= 20,000 x the layer's largest. At 64 the range, not the bound, clamped an
#: honest skewed device (a channel at 65 x the layer's largest) and refused it with the bounds off
VARIANCE_RANGE = 2**15
_INSIDE = 1 - 2**-16  # a clamp this far inside change_range stays inside after rounding to float32


class AggregationRejected(ValueError):
    """An update the rule cannot take; ``reason`` tags the rejection counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def change_range(reference: np.ndarray, variance: bool = False) -> float:
    """How far any coordinate of a floating-point tensor may move from ``reference`` in one
    update for the streaming rules' exact sums: :data:`CHANGE_RANGE` (a BatchNorm running
    variance, ``variance``: :data:`VARIANCE_RANGE`) times the tensor's largest magnitude, at least 1."""
    units = VARIANCE_RANGE if variance else CHANGE_RANGE
    return units * max(1.0, float(np.max(np.abs(reference))) if reference.size else 0.0)


#: ``state_dict`` leaves that are BatchNorm running statistics: bounded in their own geometry
#: (:class:`UpdateBound`), since they follow the device's data, not the learning rate
STATISTIC_LEAVES = ("running_mean", "running_var")


def _statistic_layers(reference: Mapping[str, np.ndarray]) -> list[str]:
    """The prefixes of the BatchNorm layers in ``reference``: those with both a floating
    ``running_mean`` and a ``running_var`` of the same shape."""
    layers = []
    for key, value in reference.items():
        if key.endswith(".running_mean") or key == "running_mean":
            layer = key[: -len("running_mean")]
            var = reference.get(layer + "running_var")
            if var is not None and value.dtype.kind == "f" and var.dtype.kind == "f" and var.shape == value.shape:
                layers.append(layer)
    return layers


def variance_keys(reference: Mapping[str, np.ndarray]) -> frozenset[str]:
    """The BatchNorm running variances of ``reference`` (of :func:`_statistic_layers`): the
    tensors whose exact-sum range is :data:`VARIANCE_RANGE` (PROTOCOL.md §19.3)."""
    return frozenset(layer + "running_var" for layer in _statistic_layers(reference))


def lower_median(values: Iterable[float]) -> float | None:
    """The lower middle value (of an even number, the smaller of the two: always a value
    some sender had, and one that half of them or fewer cannot raise); None for none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


class OwnRecord(NamedTuple):
    """What one device's adopted updates measured (:meth:`UpdateBound.apply`): the learned
    parameters' change norm and, per BatchNorm layer, the largest move of a running mean
    from the reference's and the largest running variance, in the statistics' own units
    (not relative to the reference, which moves with the fleet: a device's own statistics
    follow its own data and stay comparable from round to round)."""

    change: float
    #: BatchNorm layer prefix -> (largest |mean - reference mean|, largest variance) over its channels
    statistics: Mapping[str, tuple[float, float]]

    def to_json(self) -> list:
        """The record as ``ServerState.extra`` keeps it: ``[change, {layer: [move, variance]}]``."""
        return [self.change, {layer: list(pair) for layer, pair in sorted(self.statistics.items())}]

    @classmethod
    def from_json(cls, entry: object) -> OwnRecord:
        """The record :meth:`to_json` wrote; ``AggregationRejected`` (``malformed``) for anything
        else, since one may come from a site aggregator over the network."""
        try:
            items = list(entry)  # type: ignore[call-overload]
            if len(items) != 2:
                raise ValueError(f"{len(items)} items, not [change, statistics]")
            pairs: dict = dict(items[1])
            record = cls(float(items[0]), {str(layer): (float(move), float(var)) for layer, (move, var) in pairs.items()})
        except (TypeError, ValueError) as exc:
            raise AggregationRejected("malformed", f"not a device record: {exc}") from None
        if not all(math.isfinite(x) and x >= 0 for x in (record.change, *(v for p in record.statistics.values() for v in p))):
            raise AggregationRejected("malformed", "a device record's measures must be finite and not negative")
        return record

    @classmethod
    def typical(cls, entries: Iterable) -> OwnRecord | None:
        """What a device is judged against, from ``entries`` (its kept records, as :meth:`to_json`
        writes them): the largest change, and each statistic's lower median; None for none.

        The largest change, not the lower median: an honest non-IID device's change can
        alternate round after round between about 0.8 and 6.7-11.2 while the fleet's median falls
        to 0.45 (FedAvg, digits, four devices, Dirichlet 0.5; research/RESULTS.md, "Honest clips in
        synchronous rounds"), and the lower median of three held it to its small changes, so
        every large one was clipped. What it costs: a device that stays just inside its bound
        widens it by ``vs_median`` every round instead of every two rounds, up to
        ``max_update_ratio``; a bound on size was never a defence against that (the rule is).
        A clipped update still records no more than the record before it (:meth:`at_most`), so
        noise sent at the largest change allowed gains nothing."""
        rows = [cls(float(change), {layer: (float(move), float(var)) for layer, (move, var) in dict(stats).items()})
                for change, stats in entries]
        if not rows:
            return None
        layers = sorted({layer for r in rows for layer in r.statistics})
        statistics = {layer: (lower_median(r.statistics[layer][0] for r in rows if layer in r.statistics) or 0.0,
                              lower_median(r.statistics[layer][1] for r in rows if layer in r.statistics) or 0.0)
                      for layer in layers}
        return cls(max(r.change for r in rows), statistics)

    def at_most(self, before: OwnRecord | None, fleet_change: float | None = None) -> OwnRecord:
        """This record, no measure above ``before``'s (the device's record before the update;
        None: it had none, and the change is held to ``fleet_change`` when given): what a
        clipped or clamped update records. A bound that widens with the device's own record
        would otherwise widen by ``vs_median`` with each clip, and an attacker sending the
        largest change allowed would reach ``max_update_ratio`` within a few rounds (measured:
        noise announcing 2^24 samples took FedAvg on digits to 7.6 %); an honest device is
        recorded as it is whenever it fits its bound, so its record follows it."""
        change = self.change
        if before is not None:
            change = min(change, before.change)
        elif fleet_change is not None:
            change = min(change, fleet_change)
        statistics = dict(self.statistics)
        if before is not None:
            for layer, (move, var) in before.statistics.items():
                if layer in statistics:
                    statistics[layer] = (min(statistics[layer][0], move), min(statistics[layer][1], var))
        return OwnRecord(change, statistics)

    @classmethod
    def largest(cls, records: Iterable[OwnRecord]) -> OwnRecord | None:
        """Each measure's largest over ``records``; None for none."""
        rows = list(records)
        if not rows:
            return None
        layers = sorted({layer for r in rows for layer in r.statistics})
        statistics = {layer: (max(r.statistics[layer][0] for r in rows if layer in r.statistics),
                              max(r.statistics[layer][1] for r in rows if layer in r.statistics)) for layer in layers}
        return cls(max(r.change for r in rows), statistics)


class UpdateBound:
    """Bounds how far one update may move the round's reference, whatever the rule; the
    decision and the clipped tensors depend on that update and the reference alone.

    **Learned parameters** (every floating-point tensor but the statistics): the L2 norm
    of the change may be at most ``ratio * max(1, ||reference||)`` over the group (at
    least 1, so that a model near zero may still learn). Over it, ``action`` ``"reject"``
    refuses the update (``out_of_range``); ``"clip"`` scales the change onto the bound.

    **BatchNorm running statistics**, per layer and per channel, in their own geometry,
    and **clamped, never refused**: they are estimates of the device's own data, so a
    device whose data is unusual (the reason it wants personalization) moves them far,
    and a device whose training diverges drags them along with its weights; refusing on
    them turned heterogeneity into exclusion. With ``s2`` the layer's median
    reference variance (a floor, so a channel nearly constant in the reference is
    measured on the layer's scale):

    * a running mean moves at most ``mean_shift`` reference standard deviations,
      ``|mean' - mean| <= mean_shift * sqrt(var + s2)``;
    * a running variance grows at most to ``variance_growth * (var + s2)``. It may shrink
      freely: a channel the device's data never lights has a variance near zero, and in a
      weighted mean a small variance lowers the fleet's by at most the device's weight
      share. A negative variance is no estimate at all: :meth:`Aggregator.add` refuses it
      whatever the bound.

    **Relative to the fleet and to the device's own history** (``vs_median``): with
    ``typical_change``, the median change norm of the updates the reference was made from
    (:attr:`Aggregator.change_norms_`, kept in the state's record as
    :data:`UPDATE_NORM_MEDIAN`), and ``own``, the device's own record (:class:`OwnRecord`:
    the largest change and each statistic's lower median over its last :data:`OWN_HISTORY`
    adopted updates, kept as :data:`UPDATE_HISTORY`; a device not yet recorded is given the
    fleet's largest), a
    change over ``vs_median * max(typical_change, own.change)`` is clipped onto it, never
    refused, and a layer's statistics' clamps widen to ``vs_median`` times the device's own
    largest mean move and largest variance in that layer (in their own units) where those
    are larger than the defaults above. A clipped or clamped update is recorded no higher
    than the device's record before it (:meth:`OwnRecord.at_most`), so that clipping
    never widens the next bound.
    The norm bound above is relative to the model, which an update rarely comes near; the
    fleet's median is what honest devices did one step before, so that a device that was
    typical and jumps (a sleeper, a one-shot model replacement) counts for at most
    ``vs_median`` honest devices' worth. The device's own history is there because
    *different is not hostile*: in a non-IID fleet the device whose data is least like the
    others' sends the largest change and moves the statistics furthest round after round,
    and the gap to the others' grows as they converge (measured: 12 to 26 times the
    fleet's median on digits, three devices, Dirichlet 0.5, 15 local epochs, with running
    variances 30 to 1,800 times the reference's; a fleet-only bound clipped it in every
    round and cost it 24 points of accuracy). Judged against its own record, a device is clipped only when
    it jumps past both what the fleet and what it itself did before, by ``vs_median``.
    What this cannot do, and no bound on size can: tell an attacker that grows its record
    patiently (by ``vs_median`` every round) or that is large from its first round
    from an honest device that is large; ``max_update_ratio`` stays the ceiling, and a
    rule (docs/SECURITY.md) is what limits one device's say. A reference without a fleet
    record (a run's first round) has changes clipped to ``first_ratio`` times max(1, its
    norm) instead, or the device's own bound if larger (honest first changes measured up
    to 0.69 of it).

    Neither statistic moves past :func:`change_range` (what the streaming rules can sum exactly;
    a variance's range holds every variance the default growth bound keeps, so that bound, not the
    range, is what clamps and what ``fired`` names).
    ``benchmarks/results/honest_update_geometry.md`` measures honest fleets against these
    bounds. A ``None`` bound is not checked. Integer tensors are neither measured nor
    scaled (a rule averages them as integers).
    """

    def __init__(self, ratio: float | None, action: Literal["reject", "clip"] = "reject",
                 mean_shift: float | None = DEFAULT_MAX_MEAN_SHIFT,
                 variance_growth: float | None = DEFAULT_MAX_VARIANCE_GROWTH,
                 vs_median: float | None = None, first_ratio: float | None = None):
        self.ratio = ratio
        self.action = action
        self.mean_shift = mean_shift
        self.variance_growth = variance_growth
        self.vs_median = vs_median
        self.first_ratio = first_ratio
        #: the clip relative to the fleet this round, and whether it is the first round's
        #: (measured by :meth:`begin`; a rule whose round has no shared parameters never begins one)
        self.fleet_limit_: float | None = None
        self.first_limit_ = False

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        """Measure the reference once per round; ``typical_change``: the median change norm
        of the updates it was made from (None: unknown, no bound relative to the fleet)."""
        self.reference_ = reference
        self.layers_ = _statistic_layers(reference)
        statistics = {layer + leaf for layer in self.layers_ for leaf in STATISTIC_LEAVES}
        self.parameters_ = [k for k, v in reference.items() if v.dtype.kind == "f" and k not in statistics]
        model_scale = max(1.0, _norm(reference[k] for k in self.parameters_))
        self.limit_ = None if self.ratio is None else self.ratio * model_scale
        # without the fleet's record, relative to the model (first_ratio); a zero median (every
        # change nothing) bounds nothing rather than freezing the model
        self.fleet_limit_ = None
        self.first_limit_ = False
        if self.vs_median is not None and typical_change is None:
            self.fleet_limit_ = None if self.first_ratio is None else self.first_ratio * model_scale
            self.first_limit_ = self.fleet_limit_ is not None
        elif self.vs_median is not None and typical_change is not None and typical_change > 0:
            self.fleet_limit_ = self.vs_median * typical_change
        #: per layer: (reference mean, its scale var + s2, its largest move, the largest variance)
        self.statistic_limits_: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]] = {}
        for layer in self.layers_:
            mean = reference[layer + "running_mean"].astype(np.float64)
            var = reference[layer + "running_var"].astype(np.float64)
            scale = var + max(float(np.median(var)), 1e-12) if var.size else var
            self.statistic_limits_[layer] = (mean, scale, *self._statistic_bounds(mean, var, scale, None))

    def _layer_limits(self, layer: str, own: OwnRecord | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """``layer``'s largest mean move and largest variance per channel for a device whose
        record is ``own`` (None: no record; the fleet's limits)."""
        mean_ref, scale, max_move, max_var = self.statistic_limits_[layer]
        if own is not None and layer in own.statistics:
            var_ref = self.reference_[layer + "running_var"].astype(np.float64)
            return self._statistic_bounds(mean_ref, var_ref, scale, own.statistics[layer])
        return max_move, max_var

    def statistic_limit(self, layer: str, own: OwnRecord | None) -> tuple[float | None, float | None]:
        """The largest move of a running mean, and the largest running variance, this round
        lets a device whose record is ``own`` keep in ``layer``, over all its channels (None:
        no bound): what a clipped update's statistics can be at most."""
        move, var = self._layer_limits(layer, own)
        return (None if move is None else float(np.max(move, initial=0.0)),
                None if var is None else float(np.max(var, initial=0.0)))

    def _statistic_bounds(self, mean: np.ndarray, var: np.ndarray, scale: np.ndarray,
                          own: tuple[float, float] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        """A layer's largest mean move and largest variance per channel; ``own``: the device's
        record for the layer (largest move, largest variance), which widens them to
        ``vs_median`` times it."""
        move = None if self.mean_shift is None else self.mean_shift * np.sqrt(scale)
        largest = None if self.variance_growth is None else self.variance_growth * scale
        if own is not None and self.vs_median is not None:
            move = None if move is None else np.maximum(move, self.vs_median * own[0])
            largest = None if largest is None else np.maximum(largest, self.vs_median * own[1])
        # just inside the range the streaming rules' exact sums take (change_range, less
        # float32's rounding): a statistic clamped here is never refused there
        return (None if move is None else np.minimum(move, _INSIDE * change_range(mean)),
                None if largest is None else np.minimum(largest, var + _INSIDE * change_range(var, variance=True)))

    def relative_limit(self, own: OwnRecord | None = None) -> tuple[float, str] | None:
        """The clip relative to the fleet for a device whose own record is ``own`` (None:
        none), with the bound's name; None when nothing relative applies."""
        if self.vs_median is None:
            return None
        mine = self.vs_median * own.change if own is not None and own.change > 0 else None
        if self.fleet_limit_ is None:
            return None if mine is None else (mine, "max_update_vs_median")
        fleet_name = "max_first_update_ratio" if self.first_limit_ else "max_update_vs_median"
        if mine is not None and mine > self.fleet_limit_:
            return mine, "max_update_vs_median"
        return self.fleet_limit_, fleet_name

    def apply(self, params: Mapping[str, np.ndarray], own: OwnRecord | None = None,
              discount: float = 1.0) -> Bounded:
        """``params`` within the bound (the same mapping when nothing is over it), the names
        of the bounds that clipped or clamped it, and what it measured as adopted; raises
        :class:`AggregationRejected` to refuse it. ``params`` must already have the
        reference's shapes and finite values; ``own``: the sending device's record (None: none).

        ``discount``: a late update's staleness discount, already applied to ``params`` (its
        change is ``discount`` times what the device trained). The bounds relative to the
        fleet and to the device judge the change as trained and record it so, undiscounted:
        in buffered rounds most updates are late, and records of discounted changes made the
        fleet's median a fraction of what any device trains, so that every fresh update of a
        fast device looked like a jump (the absolute ``max_update_ratio`` bounds what the
        update does to the model, discounted)."""
        clipped: dict[str, np.ndarray] = {}
        fired: list[str] = []
        change = adopted = 0.0
        as_trained = discount if 0.0 < discount <= 1.0 else 1.0  # applied change / trained change
        if self.parameters_:
            change = adopted = _norm(np.asarray(params[k], np.float64) - self.reference_[k] for k in self.parameters_)
        if self.limit_ is not None and change > self.limit_ and self.action == "reject":
            raise AggregationRejected(
                "out_of_range", f"the update changes the learned parameters by a norm of {change:.4g}, more "
                                f"than {self.ratio:g} x max(1, their norm) = {self.limit_:.4g}")
        limits = [] if self.limit_ is None else [(self.limit_, "max_update_ratio")]
        relative = self.relative_limit(own)
        if relative is not None:  # in the units of a change as trained: as applied, discounted
            limits.append((relative[0] * as_trained, relative[1]))
        if limits and change > min(limits)[0]:
            adopted, name = min(limits)
            fired.append(name)
            factor = adopted / change
            for key in self.parameters_:
                ref = self.reference_[key]
                ref64 = ref.astype(np.float64)
                clipped[key] = (ref64 + factor * (np.asarray(params[key], np.float64) - ref64)).astype(ref.dtype)
        statistics: dict[str, tuple[float, float]] = {}
        for layer in self.layers_:
            mean_ref, scale, _, _ = self.statistic_limits_[layer]
            max_move, max_var = self._layer_limits(layer, own)
            mean_key, var_key = layer + "running_mean", layer + "running_var"
            mean = np.asarray(params[mean_key], np.float64)
            var = np.asarray(params[var_key], np.float64)
            if max_move is not None:
                over = np.abs(mean - mean_ref) > max_move
                if over.any():
                    mean = np.clip(mean, mean_ref - max_move, mean_ref + max_move)
                    clipped[mean_key] = mean.astype(self.reference_[mean_key].dtype)
                    fired.append("max_mean_shift")
            if max_var is not None and (var > max_var).any():
                var = np.minimum(var, max_var)
                clipped[var_key] = var.astype(self.reference_[var_key].dtype)
                fired.append("max_variance_growth")
            if scale.size:  # what the device's record keeps: its largest move and variance, as adopted
                statistics[layer] = (float(np.max(np.abs(mean - mean_ref))), float(np.max(var)))
        record = OwnRecord(adopted / as_trained, statistics)
        if not clipped:
            return Bounded(params, (), record)
        return Bounded({**params, **clipped}, tuple(dict.fromkeys(fired)), record)


class Bounded(NamedTuple):
    """What :meth:`UpdateBound.apply` makes of one update."""

    #: the update within the bound (the mapping given when nothing was over it)
    params: Mapping[str, np.ndarray]
    #: the names of the bounds (``AggregationSpec`` fields) that clipped or clamped it, each
    #: once, in the order they were checked; empty when nothing was over any
    fired: tuple[str, ...]
    #: what it measured as adopted (after clipping): the device's record for the rounds to come
    record: OwnRecord


class Aggregator(ABC):
    """One aggregation rule. ``begin`` -> ``add`` per accepted update -> ``result``."""

    #: True when an update is folded in on arrival (memory O(model)); False when the
    #: rule needs every update of the round at once
    streaming: ClassVar[bool] = True
    #: True when what is added is a secure round's masked vector (:class:`SecureMean`)
    masked: ClassVar[bool] = False
    #: True when an update's weight (its sample count) weighs in the result; False when every
    #: update counts once, whatever weight it is added with
    weighted: ClassVar[bool] = True

    def __init__(self) -> None:
        self.reference_: TensorDict = {}
        self.count_ = 0
        #: the bound on one update's change, applied before the rule sees it (None: none)
        self.bound: UpdateBound | None = None
        #: updates of this round that the bound clipped
        self.bound_clipped_ = 0
        #: the change norm of each update added this round, as adopted (with a bound only)
        self.change_norms_: list[float] = []
        #: change norms that stand for several updates each, with that weight (summary sites' quantiles)
        self.weighted_norms_: list[tuple[float, float]] = []
        #: what the last update added measured, as adopted (None: no bound, or none yet)
        self.last_record_: OwnRecord | None = None

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        """Start a round whose tasks carried ``reference`` (the keys to aggregate);
        ``typical_change``: :meth:`median_change` of the round that made it, if known."""
        self.reference_ = {k: np.asarray(v) for k, v in reference.items()}
        self.count_ = 0
        self.bound_clipped_ = 0
        self.change_norms_ = []
        self.weighted_norms_ = []
        self.last_record_ = None
        if self.bound is not None:
            self.bound.begin(self.reference_, typical_change)

    def median_change(self) -> float | None:
        """The median change norm of this round's updates as adopted (the lower middle one
        of an even number, a value some update had): the next round's ``typical_change``.
        None without a bound (nothing measured) or updates. Norms that stand for several
        updates (a summary site's quantiles) weigh that many: the lower weighted median."""
        if not self.weighted_norms_:
            return lower_median(self.change_norms_)
        pairs = sorted([(n, 1.0) for n in self.change_norms_] + self.weighted_norms_)
        half, seen = sum(w for _, w in pairs) / 2, 0.0
        for norm, weight in pairs:
            seen += weight
            if seen >= half:
                return norm
        return pairs[-1][0]  # not reached: the weights add up to twice half

    def add(self, params: Mapping[str, np.ndarray], weight: int = 1,
            own: OwnRecord | None = None, discount: float = 1.0) -> tuple[str, ...]:
        """Fold in one accepted update (same keys, shapes and dtypes as the reference); the
        names of the bounds of :attr:`bound` that clipped or clamped it first (empty: none).
        ``own``: the sending device's record; ``discount``: a late update's staleness
        discount, already in ``params`` (:meth:`UpdateBound.apply`).

        Raises :class:`AggregationRejected` for an update the rule refuses; nothing of it is kept."""
        if not self.reference_:
            raise RuntimeError("begin() first")
        if set(params) != set(self.reference_):
            raise AggregationRejected("wrong_tensors", "update keys differ from the round's reference")
        if not isinstance(weight, (int, np.integer)) or weight < 1:
            raise AggregationRejected("malformed", f"weight must be a positive integer, got {weight!r}")
        for key, ref in self.reference_.items():
            x = np.asarray(params[key])
            if x.shape != ref.shape or x.dtype != ref.dtype:
                raise AggregationRejected("wrong_shape", f"{key}: {x.dtype}{list(x.shape)}")
            if x.dtype.kind == "f" and not np.isfinite(x).all():
                raise AggregationRejected("non_finite", f"{key} holds NaN or Inf")
            if key.endswith("running_var") and x.dtype.kind == "f" and (x < 0).any():
                raise AggregationRejected("out_of_range", f"{key} holds a negative variance")
        fired: tuple[str, ...] = ()
        record = None
        if self.bound is not None:
            params, fired, record = self.bound.apply(params, own, discount)
        self._add(params, int(weight))
        self.count_ += 1
        self.bound_clipped_ += bool(fired)
        self.last_record_ = record
        if record is not None:
            self.change_norms_.append(record.change)
        return fired

    @abstractmethod
    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None: ...

    @abstractmethod
    def result(self) -> TensorDict:
        """The aggregate of every update added since :meth:`begin` (at least one)."""

    def _require_updates(self) -> None:
        if self.count_ == 0:
            raise RuntimeError("no update was added this round")

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.endswith("_") and not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays))
