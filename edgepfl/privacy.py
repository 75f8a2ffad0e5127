"""Client-level differential privacy of the shared part: the run's settings and the privacy
accountant (docs/SECURITY.md, "Differential privacy").

With ``privacy.mechanism: central`` the coordinator aggregates the shared parameters with
:class:`edgepfl.aggregation.GaussianMean`: each device's change clipped to ``clip_norm``,
summed, Gaussian noise of standard deviation ``noise_multiplier * clip_norm`` added, divided
by the round's sample size. The guarantee is for a device (all of its data), over the shared
parameters the coordinator releases in tasks and encoder releases; personal parameters and
heads never leave the device and are outside it — as is anything a method shares beside the
rule's shared parameters, which is why such methods are refused (config validation).

:class:`PrivacyAccountant` counts the ε spent at ``delta`` with Google's ``dp-accounting``
(Rényi DP): each trained round is a Gaussian mechanism on a sample of ``sampled`` devices
drawn without replacement from the ``population`` eligible, under replace-one adjacency
(the sensitivity of the sum is then twice the clip: the event's noise multiplier is half
the run's). With ``central`` the coordinator is trusted: it sees each update before the
noise. With ``distributed`` it is not: under secure aggregation each device clips its own
change and adds Gaussian noise of standard deviation ``noise_multiplier * clip_norm /
sqrt(q)`` drawn from its own entropy, ``q`` the round's quorum (the fewest updates a round
is adopted with, and the fewest whose sum is ever unmasked), so the one sum the coordinator
learns carries at least the noise the accountant counts — from honest devices: a device
that colludes with the coordinator takes its own share of the noise out.

With ``adaptive_clipping`` (central) each round also releases a noised count of the
changes the clip left whole, from which the next clip is set. Two Gaussian mechanisms on
the same sample compose into one: with normalized multipliers ``z_sum / 2`` (the sum,
sensitivity twice the clip) and ``σ_count`` (the count, sensitivity 1), ``(z_sum/2)^-2 +
σ_count^-2 = (z/2)^-2``, so the accountant's event is unchanged; ``budget_share`` of it
goes to the count. Under add-or-remove adjacency (``sampling: poisson``) the sum's
sensitivity is one clip: ``z_sum^-2 + σ_count^-2 = z^-2``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AdaptiveClipSpec", "PrivacyAccountant", "PrivacyEvent", "PrivacySpec", "noise_multiplier_for"]


class AdaptiveClipSpec(BaseModel):
    """``privacy.adaptive_clipping``: the clip follows a quantile of the devices' change norms
    (Andrew et al., NeurIPS 2021), estimated from a noised count, within the same ε."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    target_quantile: float = Field(0.5, gt=0, lt=1, description="the share of devices whose change the clip should "
                                                                "leave whole")
    learning_rate: float = Field(0.2, gt=0, le=5, description="each round the clip is multiplied by exp(-rate x "
                                                              "(share left whole - target_quantile))")
    budget_share: float = Field(0.1, gt=0, lt=1, description="the share of each round's privacy (in 1 / "
                                                             "noise_multiplier^2) spent on counting the changes left "
                                                             "whole; the rest noises the sum, a little more than "
                                                             "without adaptive clipping")

    def noise(self, noise_multiplier: float, add_or_remove: bool = False) -> tuple[float, float]:
        """(the sum's noise multiplier, the count's noise standard deviation) that together
        spend what one Gaussian event of ``noise_multiplier`` does (module docstring). The
        count's sensitivity is 1 either way; the sum's is two clips under replace-one
        adjacency (fixed-size rounds), one under ``add_or_remove`` (Poisson rounds), so the
        count may take twice the noise there for the same share."""
        if noise_multiplier == 0:
            return 0.0, 0.0
        count = noise_multiplier / math.sqrt(self.budget_share)
        return noise_multiplier / math.sqrt(1 - self.budget_share), count if add_or_remove else count / 2


class PrivacySpec(BaseModel):
    """A run's ``privacy:`` section."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    mechanism: Literal["none", "central", "distributed"] = Field(
        "none", description="client-level differential privacy of the shared parameters (docs/SECURITY.md) — central: "
                            "clipped and noised by the coordinator; distributed: clipped and noised on the devices, "
                            "under secure aggregation; none: no guarantee beyond data staying on devices")
    clip_norm: float = Field(1.0, gt=0, le=1e6, description="each device's change of the shared parameters is clipped "
                                                             "to this L2 norm (all float tensors together)")
    noise_multiplier: float = Field(1.0, ge=0, description="the Gaussian noise's standard deviation over clip_norm in "
                                                           "each round's sum (distributed: at least, shared among the "
                                                           "quorum of devices)")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta ε is reported at (below 1 / the number of devices)")
    adaptive_clipping: AdaptiveClipSpec | None = Field(
        None, description="central: the clip starts at clip_norm and follows a quantile of the devices' change norms, "
                          "counted with noise inside the same ε; null: the clip stays clip_norm")
    epsilon_budget: float | None = Field(
        None, gt=0, description="training stops before a round that would spend more than this ε (the final "
                                "evaluation still runs); null: no limit, ε is only reported")
    sampling: Literal["fixed", "poisson"] = Field(
        "fixed", description="how a round's devices are drawn, and so what ε counts — fixed: fraction of the "
                             "eligible devices, exactly, accounted under replace-one adjacency (a device's data "
                             "swapped for another's); poisson (central only): each eligible device independently "
                             "with probability fraction, the noised sum divided by the expected count, accounted "
                             "under add-or-remove adjacency (a device in the fleet or not): far less noise for the "
                             "same ε, a round's size varies")

    def poisson_rate(self, fraction: float) -> float | None:
        """A round's inclusion probability under Poisson sampling (None: fixed-size rounds)."""
        return min(1.0, fraction) if self.sampling == "poisson" else None


#: one trained round as the accountant counts it: (population, sampled) of a fixed-size
#: round, or (population, sampled, rate) of a Poisson one (``rate``: each device's inclusion
#: probability; then only it counts)
PrivacyEvent = tuple[int, int] | tuple[int, int, float]


class PrivacyAccountant:
    """The ε a run has spent at ``spec.delta``: one event per trained round
    (:data:`PrivacyEvent`). Fixed-size rounds are sampled without replacement under
    replace-one adjacency (the sum's sensitivity is twice the clip: the event's multiplier is
    half the run's); Poisson rounds under add-or-remove adjacency (sensitivity one clip)."""

    def __init__(self, spec: PrivacySpec, events: Iterable[PrivacyEvent] = ()):
        self.spec = spec
        self.events: list[PrivacyEvent] = list(events)

    def epsilon(self, extra: PrivacyEvent | None = None) -> float:
        """ε after the recorded rounds (and ``extra``, a round not yet run)."""
        import dp_accounting
        from dp_accounting import rdp

        events = [*self.events, *([extra] if extra is not None else [])]
        if not events:
            return 0.0
        if self.spec.noise_multiplier == 0:
            return float("inf")
        poisson = [e for e in events if len(e) == 3]
        if poisson and len(poisson) < len(events):
            raise ValueError("a run's rounds are all fixed-size or all Poisson-sampled (privacy.sampling): "
                             "one accountant cannot count both adjacencies")
        z = self.spec.noise_multiplier
        if poisson:
            accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
            with _quiet_absl():  # orders it cannot evaluate are left out: ε stays an upper bound
                for (_, _, rate), count in Counter((0, 0, e[2]) for e in poisson).items():
                    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)),
                                       count)
                return float(accountant.get_epsilon(self.spec.delta))
        accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        gaussian = dp_accounting.GaussianDpEvent(z / 2)  # replace-one: sensitivity 2 C
        # rounds of one size are one event composed many times: the accountant computes each kind once
        for (population, sampled), count in Counter((e[0], e[1]) for e in events).items():
            if sampled >= population:
                accountant.compose(gaussian, count)
            else:
                accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(population, sampled, gaussian), count)
        return float(accountant.get_epsilon(self.spec.delta))

    def spend(self, population: int, sampled: int, rate: float | None = None) -> float:
        """Record a trained round of ``sampled`` devices out of ``population`` (Poisson: each
        included with probability ``rate``); the ε after it."""
        self.events.append(_event(population, sampled, rate))
        return self.epsilon()

    def allows(self, population: int, sampled: int, rate: float | None = None) -> bool:
        """Whether a round of ``sampled`` out of ``population`` (Poisson: at ``rate``) stays within the budget."""
        budget = self.spec.epsilon_budget
        return budget is None or self.epsilon(_event(population, sampled, rate)) <= budget


def _event(population: int, sampled: int, rate: float | None) -> PrivacyEvent:
    population = max(population, sampled, 1)
    return (population, sampled) if rate is None else (population, sampled, rate)


def noise_multiplier_for(epsilon: float, rounds: int, population: int, sampled: int, delta: float = 1e-5,
                         sampling: Literal["fixed", "poisson"] = "fixed") -> float:
    """The smallest ``noise_multiplier`` (to 0.1 %) with which ``rounds`` rounds of ``sampled``
    out of ``population`` devices (``poisson``: each included with probability
    sampled / population) spend at most ``epsilon`` at ``delta``: what to put in
    ``privacy.noise_multiplier`` for a run of that size (``edgepfl privacy``)."""
    if epsilon <= 0 or rounds < 1 or not 1 <= sampled <= population or not 0 < delta < 1:
        raise ValueError("need epsilon > 0, rounds >= 1, 1 <= sampled <= population and 0 < delta < 1")
    rate = sampled / population if sampling == "poisson" else None

    def spent(multiplier: float) -> float:
        spec = PrivacySpec(mechanism="central", noise_multiplier=multiplier, delta=delta, sampling=sampling)
        return PrivacyAccountant(spec, [_event(population, sampled, rate)] * rounds).epsilon()

    low, high = 0.0, 1.0
    while spent(high) > epsilon:  # ε falls as the noise grows: find a multiplier that is enough
        low, high = high, high * 2
        if high > 1e6:
            raise ValueError(f"no noise multiplier up to 1e6 keeps {rounds} rounds within epsilon {epsilon}")
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > epsilon else (low, middle)
    return high


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting warns (through absl) for each Rényi order of a Poisson event it cannot
    evaluate and leaves out; the ε of the orders left is still an upper bound, so those
    warnings say nothing a user can act on."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)
