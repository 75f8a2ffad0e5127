"""The round loop's side of differential privacy (``privacy.mechanism``; :mod:`edgepfl.privacy`):
what each trained round spends, and whether the budget allows the next one (which rule
aggregates a round is :func:`edgepfl.aggregation.round_rule`'s to decide).

Every training round that is opened under DP counts as spent, whether its aggregate is
then adopted, aborted or short of its quorum: once answers came in, a noised mean may have
been computed and judged, and counting it is the conservative side. The spend is read back
from the run's ``metrics.jsonl`` when a coordinator resumes (rows a crash left after the
last checkpoint included, though their rounds run again), so a restart never forgets ε.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from edgepfl.aggregation import AUTO, Aggregator, round_rule
from edgepfl.config import RunConfig
from edgepfl.errors import require_installed
from edgepfl.metrics import MetricsError, PrivacyRecord, RoundMetrics, read_metrics
from edgepfl.privacy import PrivacyAccountant
from edgepfl.protocol import seed_for
from edgepfl.state import ServerState

from .sampling import sample_size

log = logging.getLogger("edgepfl.coordinator")


class PrivacyLedger:
    """Keeps the accountant (``config.privacy``) and each round's record; hands out the round's rule."""

    def __init__(self, config: RunConfig, run_dir: Path):
        self.config = config
        self.spec = config.privacy
        if self.spec.mechanism != "none":  # before any round: the accountant is not optional then
            require_installed("dp_accounting", f"privacy.mechanism {self.spec.mechanism}")
        rows: list[RoundMetrics] = []
        if self.spec.mechanism != "none" and (Path(run_dir) / "metrics.jsonl").is_file():
            try:
                rows = read_metrics(run_dir, drop_torn_tail=True)
            except MetricsError as exc:  # nothing to resume from then: the coordinator will say so
                log.warning("privacy: the run's earlier rounds are unreadable (%s); counting from zero", exc)
                rows = []
        events = [r.privacy.event() for r in rows if r.privacy is not None]
        self.accountant = PrivacyAccountant(self.spec, events)
        #: the clip of the next round: clip_norm, or with adaptive clipping the last round's choice (its row's)
        self.clip = self.spec.clip_norm
        if self.spec.adaptive_clipping is not None:
            recorded = [r.privacy for r in rows if r.privacy is not None]
            if recorded:
                self.clip = recorded[-1].next_clip_norm or recorded[-1].clip_norm
        self._record: PrivacyRecord | None = None
        #: the rule class ``aggregation.rule: auto`` chose last (logged when it changes)
        self._auto_chose: type | None = None
        if events:
            log.info("privacy: %d earlier rounds spent ε = %.3f at δ = %g", len(events), self.accountant.epsilon(),
                     self.spec.delta)

    def open(self, round: int, sampled: list[str], population: int) -> tuple[Aggregator, PrivacyRecord | None]:
        """The rule of a training round of ``sampled`` out of ``population`` eligible
        trainers (:func:`~edgepfl.aggregation.round_rule` decides it), and (under DP) the
        round's record, its spend already counted."""
        spec, secure = self.spec, self.config.secure_aggregation.enabled
        c = self.config
        updates = len(sampled) if c.asynchrony.mode == "sync" else min(len(sampled), c.asynchrony.buffer_size)
        enrolled = c.security.enrolled_dir is not None
        rate = spec.poisson_rate(c.fraction)
        # the noised mean divides by a count fixed before anyone answers: a Poisson round's expected size
        denominator = len(sampled) if rate is None else max(1.0, rate * population)
        rule = round_rule(c.aggregation, spec, secure=secure, sampled=len(sampled), clip=self.clip,
                          denominator=denominator,
                          noise_seed=[seed_for(c.seed, round, "dp-noise")], on_next_clip=self._next_clip,
                          enrolled=enrolled, updates=updates, sites=c.sites.enabled)
        if c.aggregation.rule == AUTO and type(rule) is not self._auto_chose:
            self._auto_chose = type(rule)
            log.info("round %d: aggregation.rule auto aggregates with %s (%s fleet, %d updates a round)", round,
                     type(rule).__name__, "an enrolled" if enrolled else "an unsigned", updates)
        if spec.mechanism == "none":
            return rule, None
        # an adaptive clip the round's rule moves (_next_clip) goes into this record
        self._record = self.spend(population, len(sampled))
        return rule, self._record

    def spend(self, population: int, sampled: int) -> PrivacyRecord:
        """Count a training round of ``sampled`` out of ``population`` (also a Poisson round that
        drew nobody: its draw is part of what the accountant counts); its record."""
        spec, secure = self.spec, self.config.secure_aggregation.enabled
        rate = spec.poisson_rate(self.config.fraction)
        epsilon = _finite(self.accountant.spend(population, sampled, rate))
        return PrivacyRecord(
            mechanism="distributed" if secure else "central", epsilon=epsilon, delta=spec.delta,
            population=max(population, sampled, 1), sampled=sampled, noise_multiplier=spec.noise_multiplier,
            clip_norm=spec.clip_norm if secure else self.clip, sampling_rate=rate)

    def _next_clip(self, clip: float) -> None:
        """Adaptive clipping: the clip the round's noised count set, for the next round and the row."""
        self.clip = clip
        if self._record is not None:
            self._record.next_clip_norm = clip

    def device_noise(self, sampled: int) -> tuple[float | None, float | None]:
        """Distributed DP: the (clip norm, noise standard deviation) each of ``sampled``
        devices applies to its own change, so that a sum of the round's quorum of them holds
        noise of ``noise_multiplier * clip_norm``; (None, None) otherwise."""
        if self.spec.mechanism != "distributed":
            return None, None
        quorum = max(1, self.config.quorum_of(sampled))
        return self.spec.clip_norm, self.spec.noise_multiplier * self.spec.clip_norm / math.sqrt(quorum)

    def noise_on_mean(self, sampled: int, coordinates: int) -> float | None:
        """About the norm of the noise DP adds to a round's mean of ``sampled`` devices' changes
        over ``coordinates`` shared values, all of them answering (None without DP): the sum's
        noise per value (central: ``noise_multiplier`` × the clip; distributed: each device's
        share, :meth:`device_noise`, over the ``sampled``) / ``sampled`` × √coordinates. What to
        compare a round's move with when it looks diverged."""
        if self.spec.mechanism == "none" or sampled <= 0:
            return None
        if self.spec.mechanism == "distributed":
            per_device = self.device_noise(sampled)[1] or 0.0
            per_value = per_device * math.sqrt(sampled)
        else:
            per_value = self.spec.noise_multiplier * self.clip
        return per_value / sampled * math.sqrt(coordinates)

    def noise_note(self, state: ServerState, sampled: int) -> str:
        """What a diverged round's warning adds under DP: how far the devices' noise alone moves
        the mean of ``state``'s shared values (a fleet too small for its ε); "" without DP."""
        coordinates = sum(v.size for v in state.shared_params().values() if v.dtype.kind == "f")
        noise = self.noise_on_mean(sampled, coordinates)
        if noise is None:
            return ""
        return (f"; differential privacy's noise alone moves the mean by about {noise:.4g} ({sampled} devices, "
                f"{coordinates:,} values): too few devices a round for this budget (edgepfl privacy)")

    def allows_round(self, population: int) -> bool:
        """Whether a training round drawn from ``population`` stays within ``epsilon_budget``
        (the sample size is the sampler's: ``fraction`` of them, at least one)."""
        if self.spec.mechanism == "none" or population == 0:
            return True
        sampled = sample_size(self.config.fraction, population)
        if self.accountant.allows(population, sampled, self.spec.poisson_rate(self.config.fraction)):
            return True
        log.warning("privacy: the next round would take ε past the budget %g (now %.3f at δ = %g); training stops",
                    self.spec.epsilon_budget, self.accountant.epsilon(), self.spec.delta)
        return False


def _finite(epsilon: float) -> float | None:
    """ε as a row holds it: None for the unbounded ε of a run without noise (JSON has no infinity)."""
    return epsilon if math.isfinite(epsilon) else None
