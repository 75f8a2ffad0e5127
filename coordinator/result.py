"""What a round collected, and what the run has counted: the records the round loop keeps.

:class:`RoundResult` is one round's: its open aggregate, its answers' evaluations (typed,
:class:`Evaluation`), its rejections and refusals, its traffic; :meth:`RoundResult.to_metrics`
makes the ``metrics.jsonl`` row of it. :class:`RunCounters` is the run's: rejections and
refused tasks by reason over every round, checkpointed, shown by the fleet view and
Prometheus. The inbox counts into both at the moment it decides, so the two agree at
every instant.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from edgepfl.aggregation import capped_accuracy
from edgepfl.methods import RoundAggregate
from edgepfl.metrics import PrivacyRecord, RoundMetrics, SecureRecord, SiteRoundRecord
from edgepfl.protocol import UpdateMeta
from edgepfl.state import CheckpointMeta

from .gate import Accepted

log = logging.getLogger("edgepfl.coordinator")


@dataclass(frozen=True)
class Evaluation:
    """One agent's answer, as the metrics see it: its held-out counts, losses and time."""

    correct: int
    total: int
    loss: float | None
    train_loss: float | None
    kind: str
    train_seconds: float

    @classmethod
    def of(cls, meta: UpdateMeta) -> Evaluation:
        return cls(correct=meta.eval_correct, total=meta.num_test, loss=meta.eval_loss, train_loss=meta.train_loss,
                   kind=meta.kind, train_seconds=meta.train_seconds)

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.total if self.total else None


@dataclass
class RunCounters:
    """The run's rejected messages and refused tasks by reason, every round of it (a resumed
    run's start from its checkpoint)."""

    rejected: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)

    def restore(self, meta: CheckpointMeta) -> None:
        self.rejected.update(meta.rejected_total)
        self.refused.update(meta.refused_total)


@dataclass
class RoundResult:
    """What one round collected: its open aggregate, evaluations, rejections, traffic.

    Accepted training updates go straight into ``aggregate`` (None in a round where
    nobody trains); the result itself keeps no update's tensors.
    """

    round: int
    aggregate: RoundAggregate | None = None
    participants: list[str] = field(default_factory=list)
    #: participants whose update the rule's bound clipped or clamped
    clipped: list[str] = field(default_factory=list)
    #: those participants -> the bounds (aggregation settings) that fired
    clipped_by: dict[str, list[str]] = field(default_factory=dict)
    #: each update's share of the adopted change (:meth:`.RoundAggregate.shares`; empty until adopted)
    update_share: dict[str, float] = field(default_factory=dict)
    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    #: tasks refused by their agents, by reason
    refused: Counter = field(default_factory=Counter)
    bytes_up: int = 0
    #: the training updates' bytes, by codec ("uncompressed": none asked or sent)
    update_bytes: Counter = field(default_factory=Counter)
    bytes_down: int = 0
    #: the tasks' bytes, by how their tensors travelled ("whole", or a task delta's codec)
    task_bytes: Counter = field(default_factory=Counter)
    dropped: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)
    #: agents the previous round dropped whose update arrived in this one and was folded in
    late: list[str] = field(default_factory=list)
    #: updates folded in, by how many rounds (states) old the state they were trained on was
    staleness: Counter = field(default_factory=Counter)
    #: late agents -> the round their update was trained on
    trained_on: dict[str, int] = field(default_factory=dict)
    #: a round trained under differential privacy: its sample and the run's ε after it
    privacy: PrivacyRecord | None = None
    #: a secure round's steps
    secure: SecureRecord | None = None
    #: summary sites' shares of the round (``sites.mode: summary``), by site
    sites: dict[str, SiteRoundRecord] = field(default_factory=dict)

    def sent(self, wire_bytes: int, downlink: str = "whole") -> None:
        """Count a task put on the wire: whole, or as a task delta of codec ``downlink``."""
        self.bytes_down += wire_bytes
        self.task_bytes[downlink] += wire_bytes

    def record(self, accepted: Accepted, wire_bytes: int) -> None:
        """Count an answer the gate accepted; a training update is added to the round's
        aggregate first, and one the rule refuses (``AggregationRejected``) counts for nothing."""
        if accepted.meta.site is not None:
            return self._record_site(accepted, wire_bytes)
        late = accepted.late
        if accepted.update is not None:
            # a train task, hence a training round with its aggregate (a late one: last round's task)
            assert self.aggregate is not None
            base = late.state.shared_params() if late is not None else None
            staleness = self.round - late.tasks.round if late is not None else 0
            fired = self.aggregate.add(accepted.update, base, late.discount if late is not None else 1.0)
            if fired:
                log.warning("round %d: the update from %s went past aggregation.%s; clipped onto it",
                            self.round, accepted.agent_id, ", ".join(fired))
                self.clipped.append(accepted.agent_id)
                self.clipped_by[accepted.agent_id] = list(fired)
            (self.late if late is not None else self.participants).append(accepted.agent_id)
            self.staleness[staleness] += 1
            if late is not None:
                self.trained_on[accepted.agent_id] = late.tasks.round
            codec = accepted.meta.codec
            self.update_bytes[codec.codec if codec is not None else "uncompressed"] += wire_bytes
        self.bytes_up += wire_bytes
        # a late answer's held-out counts are of the state it was sent: the row says how stale (staleness)
        self.evaluations[accepted.agent_id] = Evaluation.of(accepted.meta)

    def _record_site(self, accepted: Accepted, wire_bytes: int) -> None:
        """A site aggregator's answer: its partial sum folded into the round's aggregate (which
        checks it first), then each device counted as if its answer had come here."""
        site = accepted.meta.site
        assert site is not None  # the caller's condition
        if site.totals is not None:
            return self._record_summary(accepted, wire_bytes)
        if accepted.site is not None:
            assert self.aggregate is not None  # a site's training answer: a training round
            self.aggregate.add_site(accepted.site)
            for d in accepted.site.devices:
                if d.fired:
                    log.warning("round %d: the update from %s (site %s) went past aggregation.%s; clipped onto it",
                                self.round, d.agent_id, accepted.agent_id, ", ".join(d.fired))
                    self.clipped.append(d.agent_id)
                    self.clipped_by[d.agent_id] = list(d.fired)
                self.participants.append(d.agent_id)
                self.staleness[0] += 1
            self.update_bytes["site"] += wire_bytes
        for e in site.devices:
            self.evaluations[e.agent] = Evaluation(correct=e.eval_correct, total=e.num_test, loss=e.eval_loss,
                                                   train_loss=e.train_loss, kind=e.kind, train_seconds=e.train_seconds)
        self.dropped.extend(site.dropped)
        self.bytes_up += wire_bytes

    def _record_summary(self, accepted: Accepted, wire_bytes: int) -> None:
        """A summary site's answer: its sum folded in (checked first) as one participant, its
        evaluation as one pooled entry (each of its devices' counts already cut at the site)."""
        site, agent_id = accepted.meta.site, accepted.agent_id
        assert site is not None and site.totals is not None  # the caller's condition
        totals = site.totals
        late = accepted.late
        if accepted.site is not None:
            assert self.aggregate is not None  # a site's training answer: a training round
            if late is not None:  # a buffered run's earlier state: over its parameters, discounted
                self.aggregate.add_site(accepted.site, late.state.shared_params(), late.discount)
            else:
                self.aggregate.add_site(accepted.site)
            if totals.clipped_by:
                log.warning("round %d: site %s clipped %d of its %d updates (aggregation.%s)", self.round, agent_id,
                            site.clipped, totals.trained, ", ".join(sorted(totals.clipped_by)))
                self.clipped.append(agent_id)
                self.clipped_by[agent_id] = sorted(totals.clipped_by)
            (self.late if late is not None else self.participants).append(agent_id)
            self.staleness[self.round - late.tasks.round if late is not None else 0] += totals.trained
            if late is not None:
                self.trained_on[agent_id] = late.tasks.round
            self.update_bytes["site"] += wire_bytes
        self.sites[agent_id] = SiteRoundRecord(sampled=totals.sampled, trained=totals.trained,
                                               evaluated=totals.evaluated, dropped=totals.dropped, clipped=site.clipped)
        if totals.evaluated:
            self.evaluations[agent_id] = Evaluation(correct=totals.eval_correct, total=totals.eval_total, loss=None,
                                                    train_loss=totals.train_loss, kind="site", train_seconds=0.0)
        self.bytes_up += wire_bytes

    def to_metrics(self, *, seconds: float, final: bool, abort: str | None, rolled_back: int | None,
                   shared_bytes: int, max_weight_ratio: float | None) -> RoundMetrics:
        """The ``metrics.jsonl`` row of this round; accuracy weighs each agent's held-out count
        up to ``max_weight_ratio`` times the round's median (:func:`~edgepfl.aggregation.capped_accuracy`)."""
        evals = self.evaluations
        losses = [e.train_loss for e in evals.values() if e.train_loss is not None]
        return RoundMetrics(
            round=self.round,
            final=final,
            accuracy=capped_accuracy(((e.correct, e.total) for e in evals.values() if e.kind != "site"),
                                     max_weight_ratio, pooled=[(e.correct, e.total) for e in evals.values()
                                                               if e.kind == "site"]),
            per_client={a: e.accuracy for a, e in sorted(evals.items())},
            participants=sorted(self.participants),
            late=sorted(self.late),
            staleness={str(k): v for k, v in sorted(self.staleness.items())},
            trained_on=dict(sorted(self.trained_on.items())),
            clipped=sorted(self.clipped),
            clipped_by=dict(sorted(self.clipped_by.items())),
            update_share={a: round(v, 6) for a, v in self.update_share.items()},
            sampled=self.sampled,
            evaluated=len(evals),
            dropped=sorted(self.dropped),
            rejected=dict(self.rejected),
            refused=dict(self.refused),
            aborted=abort is not None,
            abort_reason=abort,
            rolled_back_to=rolled_back,
            train_loss=float(np.mean(losses)) if losses else None,
            bytes_up=self.bytes_up,
            update_bytes=dict(sorted(self.update_bytes.items())),
            task_bytes=dict(sorted(self.task_bytes.items())),
            privacy=self.privacy,
            secure=self.secure,
            sites=dict(sorted(self.sites.items())),
            bytes_down=self.bytes_down,
            shared_bytes=shared_bytes,
            seconds=round(seconds, 4),
        )


__all__ = ["Evaluation", "RoundResult", "RunCounters"]
