"""Synchronous rounds (``asynchrony.mode: sync``): sample, send every task, collect until
every sampled agent answered (or a quorum and the timeout), close. The final evaluation of
every run is one of these."""

from __future__ import annotations

from edgepfl.metrics import RoundMetrics

from .base import RoundContext


class SyncRounds:
    """The default round driver; ``run_round(r, final=True)`` is a run's final evaluation."""

    waits_between_rounds = True

    def __init__(self, context: RoundContext):
        self.context = context
        context.resend_lost_tasks()

    def run_round(self, r: int, final: bool = False) -> RoundMetrics:
        """One round: sample, send tasks, collect, close the aggregate, metrics row, checkpoint."""
        co = self.context
        started = co.clock.now()
        sampled, evaluators = co.sample(r, final)
        tasks, result, _ = co.open_round(r, sampled, late=bool(sampled), final=final)
        for agent_id, kind in [(a, "train") for a in sampled] + [(a, "evaluate") for a in evaluators]:
            co.send_task(tasks, result, agent_id, kind)
        co.observer.enter("evaluating" if final else "training", r)
        co.collect(tasks, result, started)
        for agent_id in result.dropped:
            co.registry.missed(agent_id, r, silent_since=started)
        return co.close_round(tasks, result, started, final, quorum=co.config.quorum_of(len(sampled)))
