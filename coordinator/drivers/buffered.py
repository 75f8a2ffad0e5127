"""Buffered asynchronous rounds (FedBuff; ``asynchrony.mode: buffered``).

No device waits for another. Every online trainer holds one training task at a time,
built from the freshest state when it was sent; when its update arrives the device is
sent a task of the open state at once, unless it already answered one of that state (no
device, however fast, writes more than one update of a state). Each accepted update is folded into the open state's aggregate
as it arrives: its change from the state it was trained on, discounted by
``(1 + staleness) ** -stragglers.staleness_exponent`` and applied to the open state
(:func:`edgepfl.aggregation.rebase`), weighted by its sample count as in a synchronous
round. After ``asynchrony.buffer_size`` updates (or, with at least one, after
``round_timeout_s``) the aggregate becomes the next state: one ``metrics.jsonl`` row,
one checkpoint, the same guards (``admit_state``, rollback) as a synchronous round. By
default no update is too stale to count (the discount weighs it down, and a state is kept
while a task built from it is unanswered); with ``stragglers.max_staleness`` set, an update
trained on a state more than that many states old is rejected ``stale`` (a NACK tells the
device), and the device is sent a fresh task. A device that restarts (a new session) is
sent a fresh task at once. With ``asynchrony.min_task_interval_s`` a device is sent its next
task no sooner than that long after its last: on a metered link each device costs at most
a task and an update per interval, and the fast devices stop outvoting the slow ones by
their number of updates (docs/BENCHMARKS.md, "Buffered rounds on a budget").

Summary sites (``sites.mode: summary``) are held like devices: each online site holds one
task, and its sum of an earlier state is folded in late as its devices' updates would have
been (:meth:`~edgepfl.methods.RoundAggregate.add_site` with that state's parameters), so a
state's buffer counts sites' sums.

On the wire nothing is new: a task's ``round`` is the number of the state it was built
from, and a device answers it as any task. The gate checks an update against the round
its task was sent in (:class:`~.gate.LateWindow`), so signatures, bounds, weight caps and
NACKs work unchanged. Evaluation comes with the answers: a training answer carries the
device's held-out counts on the state it received, and the row's accuracy is over the
answers folded into it; the final evaluation round is synchronous, as in ``sync`` mode.

A state's checkpoint is written when it is adopted, so a restarted coordinator resumes
from the last adopted state bit for bit; the open buffer is work in flight, lost with the
process like a synchronous round's aggregate (tests/integration/rounds/test_buffered_hostile.py).
"""

from __future__ import annotations

import logging

from edgepfl.metrics import RoundMetrics

from ..result import RoundResult
from ..round_tasks import RoundTasks
from .base import RoundContext

log = logging.getLogger("edgepfl.coordinator")


class BufferedRounds:
    """The states of a buffered run, one :meth:`run_round` call each, over a coordinator's fleet."""

    #: agents are not waited for between states: tasks go out as devices free up
    waits_between_rounds = False

    def __init__(self, context: RoundContext):
        self.context = context
        #: agent -> the round (state) whose task it holds
        self.holding: dict[str, RoundTasks] = {}
        #: agent -> the session it announced when it was sent that task
        self._sessions: dict[str, str | None] = {}
        self._seen: tuple = ()
        #: agent -> when (the fleet's clock) it was last sent a task (min_task_interval_s)
        self._sent_at: dict[str, float] = {}
        #: the earliest time a device held back by the interval may be sent its next task
        self._next_due = float("inf")

    def run_round(self, v: int) -> RoundMetrics:
        """Collect updates into state ``v``'s aggregate until the buffer is full; adopt it."""
        co = self.context
        started = co.clock.now()
        # weights capped by what every eligible trainer announced; the tasks go out as devices free up
        tasks, result, _ = co.open_round(v, co.registry.eligible(), late=True)
        result.sampled = []
        co.observer.enter("training", v)
        buffer_size, timeout = co.config.asynchrony.buffer_size, co.config.round_timeout_s
        self._seen = ()
        self._hand_out(tasks, result)

        def full() -> bool:
            if co.clock.now() >= self._next_due:
                self._seen = ()  # a device's interval has passed: look at the fleet again
            self._hand_out(tasks, result)
            count = result.aggregate.count if result.aggregate is not None else 0
            return count >= buffer_size or (count > 0 and co.clock.now() - started > timeout)

        co.pump_until(full, started + 2 * timeout)
        return co.close_round(tasks, result, started, final=False, quorum=1)

    def _hand_out(self, tasks: RoundTasks, result: RoundResult) -> None:
        """Send a task of the open state to every eligible trainer that holds none of it and
        none of an earlier state still open to late updates (answered, or refused, or
        rejected for a reason that ends the wait, frees a device). Looks at the fleet only when an
        answer, a rejection or a presence change came in since the last look."""
        co = self.context
        aggregate = result.aggregate
        seen = (aggregate.count if aggregate is not None else 0, sum(result.rejected.values()),
                sum(result.refused.values()), co.registry.revision)
        if seen == self._seen:
            return
        self._seen = seen
        windows = co.late_rounds()
        wrote = {*result.participants, *result.late}
        interval, now = co.config.asynchrony.min_task_interval_s, co.clock.now()
        self._next_due = float("inf")
        for agent_id in co.registry.eligible():
            held = self.holding.get(agent_id)
            if held is not None and self._sessions.get(agent_id) != co.registry.agents[agent_id].session:
                # the agent restarted: the task it held is lost with the old process, and its
                # state need not be kept for it
                held.mark_answered(agent_id)
            # An agent works through its tasks one at a time: a second one now would only
            # queue. And one whose update (on time or late) is in this state waits for the
            # next: no device, however fast, writes more than one update of a state.
            if held is tasks or agent_id in wrote or (
                    held is not None and not held.answered(agent_id) and held.round in windows):
                continue
            due = self._sent_at.get(agent_id, float("-inf")) + interval
            if now < due:  # its budget: one task per interval
                self._next_due = min(self._next_due, due)
                continue
            self.holding[agent_id] = tasks
            self._sent_at[agent_id] = now
            self._sessions[agent_id] = co.registry.agents[agent_id].session
            if agent_id not in result.sampled:
                result.sampled.append(agent_id)
            co.send_task(tasks, result, agent_id, "train")
