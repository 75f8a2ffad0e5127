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

**Order independence.** Over MQTT updates arrive in any order; in-process they arrive
sorted. Both must give the same bits, so the streaming rules do not add floats (whose
rounding depends on order): each contribution ``w * (x - reference)`` is rounded once, on
its own, to a fixed-point grid chosen at :meth:`~Aggregator.begin` from the reference
alone, and the integers are summed exactly (in int64 with a carry word, so a round's
total weight is not bounded by the accumulator). The grid leaves room for one update of
up to :data:`MAX_UPDATE_WEIGHT` and changes of up to :data:`CHANGE_RANGE` times the
reference's largest magnitude; an update outside that range is refused by
:meth:`~Aggregator.add` (:class:`AggregationRejected`), a decision that depends on the
update alone, never on what arrived before it. The rounding error of the mean is at most
2**-39 of that range: about 1e-10 for parameters of order one, under float32's own precision.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar, Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

TensorDict = dict[str, np.ndarray]

#: the most weight (sample count) one update may carry in a streaming rule
MAX_UPDATE_WEIGHT = 2**24
#: a device's count weighs at most this times the round's median count (``max_weight_ratio``)
DEFAULT_MAX_WEIGHT_RATIO = 1.0
#: an update's change is clipped to this times the median change behind the reference
#: (``max_update_vs_median``); honest non-IID fleets measured up to 3.9 (issue #37)
DEFAULT_MAX_UPDATE_VS_MEDIAN = 5.0
#: before the fleet has a record: a change is clipped to this times the parameters' norm
#: (``max_first_update_ratio``); honest first updates measured up to 0.37 (issue #37)
DEFAULT_MAX_FIRST_UPDATE_RATIO = 1.0
#: ``ServerState.extra`` key: the median change norm of the updates a state was made from
UPDATE_NORM_MEDIAN = "update_norm_median"
#: a running mean may move this many reference standard deviations (``max_mean_shift``)
DEFAULT_MAX_MEAN_SHIFT = 20.0
#: a running variance may grow to this times its reference (``max_variance_growth``)
DEFAULT_MAX_VARIANCE_GROWTH = 50.0
#: how far (in units of the reference's largest magnitude, at least 1) a coordinate may move
CHANGE_RANGE = 2**6
_INT64_HEADROOM = 62  # bits one contribution may use in int64; one spare for the sign of the sum
_CARRY_BITS = 40  # the low word keeps this many bits; the rest is carried to the high word
_INSIDE = 1 - 2**-16  # a clamp this far inside change_range stays inside after rounding to float32


class AggregationRejected(ValueError):
    """An update the rule cannot take; ``reason`` tags the rejection counter."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


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

    rule: Literal["mean", "clipped_mean", "median", "trimmed_mean", "multi_krum"] = Field(
        "mean", description="mean (FedAvg; DualFed: unweighted), clipped_mean, or a robust rule: "
                            "median, trimmed_mean, multi_krum (these three unweighted, and they buffer the round)")
    clip_ratio: float = Field(1.0, gt=0, description="clipped_mean: largest change norm, relative to the reference's")
    trim_fraction: float = Field(0.2, gt=0, lt=0.5, description="trimmed_mean: share cut from each end per "
                                                                 "coordinate, at least one value each end of a round "
                                                                 "of 3 or more updates")
    krum_byzantine: int = Field(1, ge=1, description="multi_krum: how many attackers to tolerate (f)")
    krum_select: int | None = Field(None, ge=1, description="multi_krum: updates averaged (m); default n - f")
    max_change_ratio: float | None = Field(
        10.0, gt=0, description="abort a round (reason 'diverged', state kept) whose aggregate moves the shared "
                               "parameters by more than this times their norm (at least 1); null: no bound")
    max_update_ratio: float | None = Field(
        10.0, gt=0, description="any rule: one update may change the learned parameters by a norm of at most this "
                               "times the reference's (at least 1); null: no bound")
    max_update_vs_median: float | None = Field(
        DEFAULT_MAX_UPDATE_VS_MEDIAN, ge=1,
        description="any rule: one update's change of the learned parameters is clipped (never refused) to at most "
                    "this times the median change of the updates the round's state was made from (a state without "
                    "that record: max_first_update_ratio); null: no bound relative to the fleet")
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

    def build(self) -> Aggregator:
        """A new aggregator for this spec, with its update bound."""
        rule = self._build_rule()
        bounds = (self.max_update_ratio, self.max_update_vs_median, self.max_mean_shift, self.max_variance_growth)
        if bounds != (None, None, None, None):
            rule.bound = UpdateBound(self.max_update_ratio, self.on_large_update, self.max_mean_shift,
                                     self.max_variance_growth, self.max_update_vs_median, self.max_first_update_ratio)
        return rule

    def _build_rule(self) -> Aggregator:
        if self.rule == "mean":
            return Mean()
        if self.rule == "clipped_mean":
            return NormClippedMean(self.clip_ratio)
        if self.rule == "median":
            return CoordinateMedian()
        if self.rule == "trimmed_mean":
            return TrimmedMean(self.trim_fraction)
        return MultiKrum(self.krum_byzantine, self.krum_select)


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


def lower_median(values: Iterable[float]) -> float | None:
    """The lower middle value (of an even number, the smaller of the two: always a value
    some sender had, and one that half of them or fewer cannot raise); None for none."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else None


def capped_accuracy(results: Iterable[tuple[int, int]], ratio: float | None) -> float | None:
    """Held-out accuracy over ``(correct, total)`` pairs, each device weighted by its
    ``total`` cut to :func:`weight_cap` of the totals (None: no device evaluated anything)."""
    pairs = [(c, t) for c, t in results if t > 0]
    cap = weight_cap((t for _, t in pairs), ratio)
    weights = [t if cap is None else min(t, cap) for _, t in pairs]
    if not weights:
        return None
    return sum(w * c / t for w, (c, t) in zip(weights, pairs)) / sum(weights)


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


def change_range(reference: np.ndarray) -> float:
    """How far any coordinate of a floating-point tensor may move from ``reference`` in one
    update for the streaming rules' exact sums: :data:`CHANGE_RANGE` times the tensor's
    largest magnitude, at least 1."""
    return CHANGE_RANGE * max(1.0, float(np.max(np.abs(reference))) if reference.size else 0.0)


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
    them turned heterogeneity into exclusion (issue #31). With ``s2`` the layer's median
    reference variance (a floor, so a channel nearly constant in the reference is
    measured on the layer's scale):

    * a running mean moves at most ``mean_shift`` reference standard deviations,
      ``|mean' - mean| <= mean_shift * sqrt(var + s2)``;
    * a running variance grows at most to ``variance_growth * (var + s2)``. It may shrink
      freely: a channel the device's data never lights has a variance near zero, and in a
      weighted mean a small variance lowers the fleet's by at most the device's weight
      share. A negative variance is no estimate at all: :meth:`Aggregator.add` refuses it
      whatever the bound.

    **Relative to the fleet** (``vs_median``): with ``typical_change``, the median change
    norm of the updates the reference was made from (:attr:`Aggregator.change_norms_`,
    kept in the state's record as :data:`UPDATE_NORM_MEDIAN`), a change over
    ``vs_median * typical_change`` is clipped onto it, never refused. The norm bound above
    is relative to the model, which an update rarely comes near; this one is relative to
    what honest devices did one step before, so that an attacker's noise, scaled or
    reversed change counts for at most ``vs_median`` honest devices' worth. An attacker
    among mostly honest devices cannot raise the median; honest changes shrink as a run
    converges, and the median follows them (measured: an honest non-IID device up to
    3.9 times the previous median; one whose local training diverges, 4.6). A reference
    without a record (a run's first round) has its changes clipped to ``first_ratio``
    times max(1, its norm) instead (honest first changes measured up to 0.37 of it).

    Neither statistic moves past :func:`change_range` (what the streaming rules can sum exactly).
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

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        """Measure the reference once per round; ``typical_change``: the median change norm
        of the updates it was made from (None: unknown, no bound relative to the fleet)."""
        self.reference_ = reference
        self.layers_ = _statistic_layers(reference)
        statistics = {layer + leaf for layer in self.layers_ for leaf in STATISTIC_LEAVES}
        self.parameters_ = [k for k, v in reference.items() if v.dtype.kind == "f" and k not in statistics]
        model_scale = max(1.0, _norm(reference[k] for k in self.parameters_))
        self.limit_ = None if self.ratio is None else self.ratio * model_scale
        #: the clip relative to the fleet this round (None: none); without a record, relative to
        #: the model (``first_ratio``); a zero median (every change nothing) bounds nothing
        #: rather than freezing the model
        self.fleet_limit_: float | None = None
        if self.vs_median is not None and typical_change is None:
            self.fleet_limit_ = None if self.first_ratio is None else self.first_ratio * model_scale
        elif self.vs_median is not None and typical_change is not None and typical_change > 0:
            self.fleet_limit_ = self.vs_median * typical_change
        #: per layer: (reference mean, its largest move, the largest variance)
        self.statistic_limits_: dict[str, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = {}
        for layer in self.layers_:
            mean = reference[layer + "running_mean"].astype(np.float64)
            var = reference[layer + "running_var"].astype(np.float64)
            scale = var + max(float(np.median(var)), 1e-12) if var.size else var
            # just inside the range the streaming rules' exact sums take (change_range, less
            # float32's rounding): a statistic clamped here is never refused there
            self.statistic_limits_[layer] = (
                mean,
                None if self.mean_shift is None else np.minimum(self.mean_shift * np.sqrt(scale),
                                                                _INSIDE * change_range(mean)),
                None if self.variance_growth is None else np.minimum(self.variance_growth * scale,
                                                                     var + _INSIDE * change_range(var)))

    def apply(self, params: Mapping[str, np.ndarray]) -> Bounded:
        """``params`` within the bound (the same mapping when nothing is over it), whether it
        was clipped, and the norm of its learned parameters' change as adopted; raises
        :class:`AggregationRejected` to refuse it. ``params`` must already have the
        reference's shapes and finite values."""
        clipped: dict[str, np.ndarray] = {}
        change = adopted = 0.0
        if self.parameters_:
            change = adopted = _norm(np.asarray(params[k], np.float64) - self.reference_[k] for k in self.parameters_)
        if self.limit_ is not None and change > self.limit_ and self.action == "reject":
            raise AggregationRejected(
                "out_of_range", f"the update changes the learned parameters by a norm of {change:.4g}, more "
                                f"than {self.ratio:g} x max(1, their norm) = {self.limit_:.4g}")
        limits = [limit for limit in (self.limit_, self.fleet_limit_) if limit is not None]
        if limits and change > min(limits):
            adopted = min(limits)
            factor = adopted / change
            for key in self.parameters_:
                ref = self.reference_[key]
                ref64 = ref.astype(np.float64)
                clipped[key] = (ref64 + factor * (np.asarray(params[key], np.float64) - ref64)).astype(ref.dtype)
        for layer in self.layers_:
            mean_ref, max_move, max_var = self.statistic_limits_[layer]
            mean_key, var_key = layer + "running_mean", layer + "running_var"
            if max_move is not None:
                mean = np.asarray(params[mean_key], np.float64)
                over = np.abs(mean - mean_ref) > max_move
                if over.any():
                    dtype = self.reference_[mean_key].dtype
                    clipped[mean_key] = np.clip(mean, mean_ref - max_move, mean_ref + max_move).astype(dtype)
            if max_var is not None:
                var = np.asarray(params[var_key], np.float64)
                if (var > max_var).any():
                    clipped[var_key] = np.minimum(var, max_var).astype(self.reference_[var_key].dtype)
        if not clipped:
            return Bounded(params, False, adopted)
        return Bounded({**params, **clipped}, True, adopted)


class Bounded(NamedTuple):
    """What :meth:`UpdateBound.apply` makes of one update."""

    #: the update within the bound (the mapping given when nothing was over it)
    params: Mapping[str, np.ndarray]
    #: whether anything was clipped or clamped
    clipped: bool
    #: the norm of its learned parameters' change after clipping (0 without learned parameters)
    change: float


class Aggregator(ABC):
    """One aggregation rule. ``begin`` -> ``add`` per accepted update -> ``result``."""

    #: True when an update is folded in on arrival (memory O(model)); False when the
    #: rule needs every update of the round at once
    streaming: ClassVar[bool] = True
    #: True when what is added is a secure round's masked vector (:class:`SecureMean`)
    masked: ClassVar[bool] = False

    def __init__(self) -> None:
        self.reference_: TensorDict = {}
        self.count_ = 0
        #: the bound on one update's change, applied before the rule sees it (None: none)
        self.bound: UpdateBound | None = None
        #: updates of this round that the bound clipped
        self.bound_clipped_ = 0
        #: the change norm of each update added this round, as adopted (with a bound only)
        self.change_norms_: list[float] = []

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        """Start a round whose tasks carried ``reference`` (the keys to aggregate);
        ``typical_change``: :meth:`median_change` of the round that made it, if known."""
        self.reference_ = {k: np.asarray(v) for k, v in reference.items()}
        self.count_ = 0
        self.bound_clipped_ = 0
        self.change_norms_ = []
        if self.bound is not None:
            self.bound.begin(self.reference_, typical_change)

    def median_change(self) -> float | None:
        """The median change norm of this round's updates as adopted (the lower middle one
        of an even number, a value some update had): the next round's ``typical_change``.
        None without a bound (nothing measured) or updates."""
        return lower_median(self.change_norms_)

    def add(self, params: Mapping[str, np.ndarray], weight: int = 1) -> bool:
        """Fold in one accepted update (same keys, shapes and dtypes as the reference);
        True when :attr:`bound` clipped it first.

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
        clipped, change = False, None
        if self.bound is not None:
            params, clipped, change = self.bound.apply(params)
        self._add(params, int(weight))
        self.count_ += 1
        self.bound_clipped_ += clipped
        if change is not None:
            self.change_norms_.append(change)
        return clipped

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


# --------------------------------------------------------------------------- exact streaming sums
class _ExactSum:
    """Sum of ``w * (x - reference)`` per coordinate, independent of the order of ``add``.

    Each contribution is rounded to a grid of ``2**-bits`` times the reference's scale
    and accumulated exactly as an integer ``high * 2**40 + low`` held in two int64
    arrays: a contribution fits in 62 bits, ``low`` is kept in ``[0, 2**40)`` by carrying
    into ``high``, so neither word overflows however many updates arrive. Integer
    addition is associative, so any order gives the same sum. Floating-point tensors
    only; integer tensors are averaged exactly as integers.
    """

    def __init__(self, reference: Mapping[str, np.ndarray]):
        self.reference = reference
        self.scale: dict[str, float] = {}
        self.limit: dict[str, float] = {}
        self.low: dict[str, np.ndarray] = {}
        self.high: dict[str, np.ndarray] = {}
        for key, ref in reference.items():
            if ref.dtype.kind == "f":
                span = change_range(ref)  # the largest |x - reference| accepted
                exponent = math.ceil(math.log2(span * MAX_UPDATE_WEIGHT))
                self.scale[key] = 2.0 ** (_INT64_HEADROOM - exponent)
                self.limit[key] = span
            self.low[key] = np.zeros(ref.shape, dtype=np.int64)
            self.high[key] = np.zeros(ref.shape, dtype=np.int64)
        self.total_weight = 0

    def check(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        """Raise :class:`AggregationRejected` if this update cannot be summed (it alone decides)."""
        if weight > MAX_UPDATE_WEIGHT:
            raise AggregationRejected("malformed", f"one update's weight may be at most {MAX_UPDATE_WEIGHT}")
        for key, ref in self.reference.items():
            x = np.asarray(params[key])  # shapes, dtypes and finiteness: checked by Aggregator.add
            if ref.dtype.kind == "f":
                change = float(np.max(np.abs(x.astype(np.float64) - ref))) if x.size else 0.0
                if change > self.limit[key]:
                    raise AggregationRejected(
                        "out_of_range", f"{key} moves by {change:.3g}, more than {self.limit[key]:.3g}")

    def contribution(self, params: Mapping[str, np.ndarray], weight: int, factor: float = 1.0,
                     noise: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """``weight * factor * (params - reference)`` (plus ``noise``, per float tensor) on the
        grid: one int64 array per key. What :meth:`add` folds in, and what an agent masks for
        secure aggregation (:func:`ring_vector`): both sides compute it from the reference alone."""
        out = {}
        for key, ref in self.reference.items():
            x = np.asarray(params[key])
            if ref.dtype.kind == "f":
                change = (x.astype(np.float64) - ref.astype(np.float64)) * (weight * factor)
                if noise is not None:
                    change = change + noise[key]
                out[key] = np.rint(change * self.scale[key]).astype(np.int64)
            else:
                out[key] = weight * (x.astype(np.int64) - ref.astype(np.int64))
        return out

    def add(self, params: Mapping[str, np.ndarray], weight: int, factor: float = 1.0) -> None:
        """Fold ``weight * factor * (params - reference)`` in; call :meth:`check` first."""
        self.add_total(self.contribution(params, weight, factor), weight)

    def add_total(self, contributions: Mapping[str, np.ndarray], weight: int) -> None:
        """Fold in grid integers (one int64 array per key) standing for ``weight`` of updates:
        one update's :meth:`contribution`, or the unmasked sum of a secure round's."""
        for key in self.reference:
            low = self.low[key]
            low += contributions[key]
            carry = low >> _CARRY_BITS  # floor division by 2**40, also for a negative low
            self.high[key] += carry
            low -= carry << _CARRY_BITS
        self.total_weight += weight

    def _total(self, key: str) -> np.ndarray:
        """The exact integer sum of ``key``, rounded once to float64 (both words are exact floats)."""
        return self.high[key].astype(np.float64) * float(2**_CARRY_BITS) + self.low[key].astype(np.float64)

    def mean(self) -> TensorDict:
        out: TensorDict = {}
        variances = {layer + "running_var" for layer in _statistic_layers(self.reference)}
        for key, ref in self.reference.items():
            if ref.dtype.kind == "f":
                change = self._total(key) / (self.scale[key] * self.total_weight)
                mean = ref.astype(np.float64) + change
                if key in variances:  # a mean of variances is one; the grid's rounding may not make it negative
                    mean = np.maximum(mean, 0.0)
                out[key] = mean.astype(ref.dtype)
            else:
                out[key] = (ref.astype(np.int64) + np.rint(self._total(key) / self.total_weight)).astype(ref.dtype)
        return out


class Mean(Aggregator):
    """Sample-weighted mean of the updates (FedAvg), folded in as they arrive."""

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        self.sum_.check(params, weight)
        self.sum_.add(params, weight)

    def result(self) -> TensorDict:
        self._require_updates()
        return self.sum_.mean()


class NormClippedMean(Aggregator):
    """Weighted mean of the updates' changes, each clipped to ``clip_ratio`` times the
    reference's norm (over all floating-point tensors together), added to the reference.

    One update can then move the model by at most ``clip_ratio * ||reference||`` times its
    share of the round's weight — a bound an attacker cannot talk its way past.
    """

    def __init__(self, clip_ratio: float = 1.0):
        super().__init__()
        self.clip_ratio = clip_ratio

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)
        self.clipped_ = 0
        self.bound_ = self.clip_ratio * _norm(self.reference_.values())

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        self.sum_.check(params, weight)
        floats = [k for k, v in self.reference_.items() if v.dtype.kind == "f"]
        change = _norm(np.asarray(params[k], np.float64) - self.reference_[k] for k in floats)
        factor = 1.0 if change <= self.bound_ else self.bound_ / change
        self.clipped_ += factor < 1.0
        self.sum_.add(params, weight, factor)

    def result(self) -> TensorDict:
        self._require_updates()
        return self.sum_.mean()


class GaussianMean(Aggregator):
    """Client-level differential privacy of the shared parameters, central (DP-FedAvg:
    McMahan et al., 2018): each update's change, over every floating-point tensor together,
    is clipped to ``clip_norm`` (L2); the clipped changes are summed unweighted, exactly and
    in any arrival order; Gaussian noise of standard deviation ``noise_multiplier *
    clip_norm`` is added to each coordinate of the sum; and the sum is divided by
    ``denominator``, the number of agents sampled for the round, fixed before any answer so
    that it says nothing of who answered. Integer tensors keep the reference's value (a mean
    of counts would be an unprotected statistic). The noise is drawn once, at :meth:`result`,
    from ``noise_seed``: the result is the same in any arrival order, and a rerun draws the
    same noise.

    One device changes the sum by at most ``clip_norm``, whatever it sends: the sensitivity
    :mod:`edgepfl.privacy` accounts with. So the rule refuses nothing for its values (a
    refusal would say something about them); only a malformed update (wrong tensors, not
    finite) is refused, before anything of it counts.

    With ``adaptive`` (Andrew et al., NeurIPS 2021) the rule also counts the updates its
    clip left whole, adds Gaussian noise of ``adaptive.count_noise`` to that count, and
    moves the clip geometrically towards the norm that ``adaptive.target_quantile`` of the
    devices' changes stay under: ``next_clip_``, handed to ``on_next_clip`` for the next
    round to clip with (whether or not this round's aggregate is adopted: the count is
    released either way)."""

    def __init__(self, clip_norm: float, noise_multiplier: float, denominator: int, noise_seed: int | list[int],
                 adaptive: AdaptiveClip | None = None, on_next_clip: Callable[[float], None] | None = None):
        super().__init__()
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.denominator = denominator
        self.noise_seed = noise_seed
        self.adaptive = adaptive
        self.on_next_clip = on_next_clip

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.sum_ = _ExactSum(self.reference_)
        self.clipped_ = 0
        self.next_clip_: float | None = None

    def median_change(self) -> float | None:
        return None  # a statistic of the devices' raw updates: not for the next round to use

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        floats = [k for k, v in self.reference_.items() if v.dtype.kind == "f"]
        factor = clip_factor(params, self.reference_, self.clip_norm)
        self.clipped_ += factor < 1.0
        # one device, one unit: its sample count does not weigh (it would scale its influence)
        self.sum_.add({k: params[k] for k in floats} | {k: self.reference_[k] for k in self.reference_
                                                          if k not in floats}, 1, factor)

    def result(self) -> TensorDict:
        self._require_updates()
        rng = np.random.default_rng(self.noise_seed)
        std = self.noise_multiplier * self.clip_norm
        out = _unit_mean(self.sum_, self.reference_, self.denominator, lambda shape: rng.normal(0.0, std, shape))
        if self.adaptive is not None:  # drawn after the sum's noise: the same draws in any order of arrival
            a = self.adaptive
            within = (self.count_ - self.clipped_ + rng.normal(0.0, a.count_noise)) / self.denominator
            self.next_clip_ = float(self.clip_norm * math.exp(-a.learning_rate * (within - a.target_quantile)))
            if self.on_next_clip is not None:
                self.on_next_clip(self.next_clip_)
        return out


def _unit_mean(sum_: _ExactSum, reference: Mapping[str, np.ndarray], denominator: int,
               noise: Callable[[tuple[int, ...]], np.ndarray] | None = None) -> TensorDict:
    """Client-level DP's mean of clipped changes that each counted once: per float tensor the
    reference plus (the exact sum, plus ``noise`` of its shape drawn in the reference's key
    order) over ``denominator``; integer tensors keep the reference's value (a mean of counts
    would be an unprotected statistic); a variance the noise made negative is 0."""
    variances = {layer + "running_var" for layer in _statistic_layers(reference)}
    out: TensorDict = {}
    for key, ref in reference.items():
        if ref.dtype.kind != "f":
            out[key] = ref.copy()
            continue
        total = sum_._total(key) / sum_.scale[key]
        if noise is not None:
            total = total + noise(ref.shape)
        value = ref.astype(np.float64) + total / denominator
        if key in variances:  # noise may not make a variance negative (post-processing: free)
            value = np.maximum(value, 0.0)
        out[key] = value.astype(ref.dtype)
    return out


class AdaptiveClip(NamedTuple):
    """How :class:`GaussianMean` moves its clip each round (adaptive clipping)."""

    #: the share of devices whose change the clip should leave whole
    target_quantile: float
    #: the geometric step: the clip is multiplied by exp(-learning_rate * (share within - target))
    learning_rate: float
    #: the standard deviation of the Gaussian noise on the count of changes within the clip
    count_noise: float


#: a secure round's sums are taken modulo 2**64 (:mod:`edgepfl.secagg`): one unit of weight adds
#: at most 2**62 / MAX_UPDATE_WEIGHT to a coordinate, so the sum stays below 2**63 in magnitude,
#: and reads back exactly, while the round's total weight is below this
MAX_SECURE_WEIGHT = 2 * MAX_UPDATE_WEIGHT


def ring_keys(reference: Mapping[str, np.ndarray]) -> list[str]:
    """The order a secure round lays a contribution out in: the reference's keys, sorted."""
    return sorted(reference)


def ring_vector(contributions: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """Grid integers (:meth:`_ExactSum.contribution`) as one flat vector of the ring of
    integers modulo 2**64 (``<u8``; a negative integer as its two's complement)."""
    parts = [np.asarray(contributions[k], np.int64).reshape(-1) for k in ring_keys(reference)]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return flat.view(np.uint64).astype("<u8", copy=False)


def ring_size(reference: Mapping[str, np.ndarray]) -> int:
    """How many integers a secure round's vector holds for ``reference``."""
    return int(sum(np.asarray(v).size for v in reference.values()))


def from_ring(vector: np.ndarray, reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of :func:`ring_vector`: per-key int64 arrays (a sum below 2**63 in magnitude reads exactly)."""
    signed = np.asarray(vector, dtype="<u8").view(np.int64)
    out, at = {}, 0
    for key in ring_keys(reference):
        ref = np.asarray(reference[key])
        out[key] = signed[at:at + ref.size].reshape(ref.shape)
        at += ref.size
    return out


def clip_factor(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], clip_norm: float) -> float:
    """What scales an update's change of the float tensors (L2 over all of them, in sorted
    key order) to at most ``clip_norm``: 1 when it is within. The one clip of client-level DP,
    at the coordinator (:class:`GaussianMean`) or on the device (distributed)."""
    floats = [k for k in sorted(reference) if np.asarray(reference[k]).dtype.kind == "f"]
    change = _norm(np.asarray(params[k], np.float64) - np.asarray(reference[k], np.float64) for k in floats)
    return 1.0 if change <= clip_norm else clip_norm / change


def grid_contribution(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], weight: int,
                      clip_norm: float | None = None, noise_std: float = 0.0,
                      rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """An agent's contribution to a secure round: ``weight * (params - reference)`` on the
    round's exact grid, each change first clamped into the grid's range (a change the
    coordinator would refuse as ``out_of_range`` in the clear; an honest device's never is).

    With ``clip_norm`` (distributed DP, weight 1): the float tensors' change clipped as
    :class:`GaussianMean` clips it, plus Gaussian noise of ``noise_std`` per coordinate from
    ``rng``; integer tensors contribute nothing (the state keeps their value)."""
    exact = _ExactSum(reference)
    if clip_norm is not None:
        floats = {k for k, v in exact.reference.items() if v.dtype.kind == "f"}
        kept = {k: (params[k] if k in floats else exact.reference[k]) for k in exact.reference}
        noise = {k: rng.normal(0.0, noise_std, exact.reference[k].shape) if rng is not None and noise_std > 0
                 else np.zeros(exact.reference[k].shape) for k in floats}
        return exact.contribution(kept, 1, clip_factor(kept, exact.reference, clip_norm), noise)
    clamped = {}
    for key, ref in exact.reference.items():
        x = np.asarray(params[key])
        if ref.dtype.kind == "f":
            limit = exact.limit[key] * _INSIDE
            x = np.clip(x.astype(np.float64), ref.astype(np.float64) - limit, ref.astype(np.float64) + limit)
        clamped[key] = x
    return exact.contribution(clamped, weight)


class SecureMean(Aggregator):
    """The sample-weighted mean of a secure round (:mod:`edgepfl.secagg`): what is added is
    each agent's *masked* vector (:data:`edgepfl.protocol.secagg.MASKED_TENSOR`), summed
    modulo 2**64; the coordinator never holds one unmasked update. Once the round's masks
    are removed from the sum (:meth:`unmask`), :meth:`result` is the mean of the same grid
    integers :class:`Mean` would have summed in the clear: the same bits, in any order.

    Per-update bounds cannot apply (no update is seen): the rule takes none.

    With ``denominator`` (distributed differential privacy) each device's clipped, noised
    change counts once and the sum is divided by ``denominator``, the devices sampled,
    as :class:`GaussianMean` does; integer tensors keep the reference's value."""

    #: what is added is a masked vector, not the shared tensors
    masked: ClassVar[bool] = True

    def __init__(self, denominator: int | None = None):
        super().__init__()
        self.denominator = denominator

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        if self.bound is not None:
            raise ValueError("a secure round's updates are masked: no per-update bound can apply")
        super().begin(reference, typical_change)
        self.size_ = ring_size(self.reference_)
        self.masked_sum_ = np.zeros(self.size_, dtype="<u8")
        self.weight_ = 0
        self.sum_: _ExactSum | None = None
        #: why the masks could not be removed (None: not tried, or removed)
        self.failure_: str | None = None

    def median_change(self) -> float | None:
        return None  # no update's change is seen

    def add(self, params: Mapping[str, np.ndarray], weight: int = 1) -> bool:
        from edgepfl.protocol.secagg import MASKED_TENSOR

        if set(params) != {MASKED_TENSOR}:
            raise AggregationRejected("wrong_tensors", f"a masked update carries {MASKED_TENSOR} alone")
        if not isinstance(weight, (int, np.integer)) or not 1 <= weight <= MAX_UPDATE_WEIGHT:
            raise AggregationRejected("malformed", f"weight must be a positive integer up to {MAX_UPDATE_WEIGHT}")
        vector = np.asarray(params[MASKED_TENSOR])
        if vector.dtype != np.dtype("<i8") or vector.shape != (self.size_,):
            raise AggregationRejected("wrong_shape", f"{MASKED_TENSOR}: {vector.dtype}{list(vector.shape)}, "
                                                     f"want int64[{self.size_}]")
        self.masked_sum_ += vector.view("<u8")  # modulo 2**64: numpy's unsigned arithmetic wraps
        self.weight_ += int(weight)
        self.count_ += 1
        return False

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:  # add is whole here
        raise NotImplementedError

    def unmask(self, total: np.ndarray) -> None:
        """Take the unmasked sum (:func:`edgepfl.secagg.unmask` of :attr:`masked_sum_`)."""
        if self.weight_ >= MAX_SECURE_WEIGHT:
            raise AggregationRejected("out_of_range", f"a secure round's total weight {self.weight_} is not below "
                                                      f"{MAX_SECURE_WEIGHT}: its sum would wrap")
        self.sum_ = _ExactSum(self.reference_)
        self.sum_.add_total(from_ring(total, self.reference_), self.weight_)

    def result(self) -> TensorDict:
        self._require_updates()
        if self.sum_ is None:  # nothing can be learnt from the masked sum: the round is aborted
            raise AggregationRejected("secagg_failed", self.failure_ or "the masked sum was not unmasked")
        if self.denominator is None:
            return self.sum_.mean()
        return _unit_mean(self.sum_, self.reference_, self.denominator)


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays))


# --------------------------------------------------------------------------- robust, buffered
class _Buffered(Aggregator):
    """A rule that needs every update at once: keeps them until :meth:`result`.

    Updates are ordered by their content (a hash of the bytes) before the rule runs,
    so the result does not depend on arrival order either.
    """

    streaming = False

    def begin(self, reference: Mapping[str, np.ndarray], typical_change: float | None = None) -> None:
        super().begin(reference, typical_change)
        self.updates_: list[tuple[bytes, TensorDict]] = []

    def _add(self, params: Mapping[str, np.ndarray], weight: int) -> None:
        import hashlib

        checked = {key: np.asarray(params[key]) for key in self.reference_}  # checked by Aggregator.add
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(checked[k]).tobytes() for k in sorted(checked)))
        self.updates_.append((digest.digest(), checked))

    def _stacked(self, key: str) -> np.ndarray:
        ordered = sorted(self.updates_, key=lambda item: item[0])
        return np.stack([u[key].astype(np.float64) for _, u in ordered])

    def _cast(self, key: str, value: np.ndarray) -> np.ndarray:
        ref = self.reference_[key]
        return (np.rint(value) if ref.dtype.kind in "iu" else value).astype(ref.dtype)


class CoordinateMedian(_Buffered):
    """The median of each coordinate over the round's updates (unweighted)."""

    def result(self) -> TensorDict:
        self._require_updates()
        return {k: self._cast(k, np.median(self._stacked(k), axis=0)) for k in self.reference_}


class TrimmedMean(_Buffered):
    """Per coordinate, drop the ``trim_fraction`` largest and smallest values, average the rest.

    At least one value is dropped from each end whenever there are 3 or more: at 0.2 a
    round of 4 updates would otherwise trim nothing and be the plain mean, the one
    outcome a user of this rule chose against.
    """

    def __init__(self, trim_fraction: float = 0.2):
        super().__init__()
        self.trim_fraction = trim_fraction

    def result(self) -> TensorDict:
        self._require_updates()
        n = self.count_
        cut = min(max(int(math.floor(self.trim_fraction * n)), 1), (n - 1) // 2)
        out = {}
        for key in self.reference_:
            values = np.sort(self._stacked(key), axis=0)
            out[key] = self._cast(key, values[cut:n - cut].mean(axis=0))
        return out


class MultiKrum(_Buffered):
    """Multi-Krum (Blanchard et al., 2017): average the ``select`` updates whose summed
    squared distance to their ``n - f - 2`` nearest neighbours is smallest."""

    def __init__(self, byzantine: int = 1, select: int | None = None):
        super().__init__()
        self.byzantine = byzantine
        self.select = select

    def result(self) -> TensorDict:
        self._require_updates()
        keys = list(self.reference_)
        flat = np.concatenate([self._stacked(k).reshape(self.count_, -1) for k in keys], axis=1)
        n = self.count_
        neighbours = max(1, n - self.byzantine - 2)
        sq = np.einsum("ij,ij->i", flat, flat)
        d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (flat @ flat.T), 0.0)  # n x n, never n x n x P
        scores = np.array([np.sort(np.delete(d2[i], i))[:neighbours].sum() if n > 1 else 0.0 for i in range(n)])
        m = self.select or max(1, n - self.byzantine)
        chosen = np.argsort(scores, kind="stable")[: min(m, n)]
        return {k: self._cast(k, self._stacked(k)[chosen].mean(axis=0)) for k in keys}


__all__ = [
    "AdaptiveClip", "AggregationRejected", "AggregationSpec", "Aggregator", "capped_accuracy", "CHANGE_RANGE",
    "clip_factor", "CoordinateMedian", "DEFAULT_MAX_WEIGHT_RATIO", "from_ring", "grid_contribution",
    "MAX_SECURE_WEIGHT", "MAX_UPDATE_WEIGHT", "Mean", "MultiKrum", "NormClippedMean", "PER_UPDATE_BOUNDS", "rebase",
    "ring_size", "ring_vector", "SecureMean", "staleness_weight", "STATISTIC_LEAVES", "TrimmedMean", "UpdateBound",
    "weight_cap",
]
