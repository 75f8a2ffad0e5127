"""The coordinator's one way of waiting: pump the fleet's traffic until a condition holds.

:class:`Inbox` routes every inbound event — statuses to the :class:`~.registry.Registry`
(telling the fleet who came online), updates through the :class:`~.gate.UpdateGate`
into the open round (whose aggregate folds each one in at once, or refuses it with an
:class:`~edgepfl.aggregation.AggregationRejected`), head-tier metrics to the head
reports, and every rejection, by reason, to the round's and the run's counters and the log.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Protocol

from edgepfl.aggregation import AggregationRejected
from edgepfl.methods import ServerState
from edgepfl.protocol import AgentChannel

from .fleet import Fleet, Incoming
from .gate import Accepted, Rejection, RoundTasks, UpdateGate, admit_metrics, admit_status
from .presence import PresenceWatch
from .registry import Registry

log = logging.getLogger("edgepfl.coordinator")

# How long one poll of the fleet may block: the granularity of deadlines.
POLL_S = 0.2


class RoundSink(Protocol):
    """Where an open round's accepted updates and rejections go (the round loop's ``RoundResult``)."""

    rejected: Counter

    def record(self, accepted: Accepted, wire_bytes: int) -> None:
        """Take an accepted answer; raises :class:`AggregationRejected` for an update the
        round's rule refuses, having kept nothing of it."""


class Inbox:
    """Routes what the fleet delivers; :meth:`pump_until` is the only loop that polls it.

    ``rejected_total`` is the run's counter of rejections by reason (the coordinator's,
    restored from its checkpoint); the inbox adds to it.
    """

    def __init__(self, fleet: Fleet, registry: Registry, gate: UpdateGate, rejected_total: Counter,
                 presence: PresenceWatch | None = None):
        self.fleet = fleet
        self.presence = presence or PresenceWatch(registry, expected=None)
        self.registry = registry
        self.gate = gate
        self.rejected_total = rejected_total
        self.head_reports: dict[str, dict] = {}
        self._awaited_reports: set[str] = set()
        # The open round: before round 0 none (no tasks; rejections count in the run's
        # total only); between rounds the last one, until the next opens.
        self._tasks = RoundTasks(-1)
        self._sink: RoundSink | None = None
        self._state: ServerState | None = None

    def open_round(self, tasks: RoundTasks, sink: RoundSink, state: ServerState) -> None:
        """Admit answers to ``tasks``, checked against ``state`` (what the tasks were built from), into ``sink``."""
        self._tasks, self._sink, self._state = tasks, sink, state

    def expect_reports(self, agents: Iterable[str]) -> None:
        """Wait for a head-tier report from each of ``agents`` (those that have not reported already)."""
        self._awaited_reports = set(agents) - self.head_reports.keys()

    def reports_complete(self) -> bool:
        return not self._awaited_reports

    def pump_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Route inbound traffic until ``done()`` holds (True) or the ``time.monotonic()``
        ``deadline`` passes (False). ``done`` is asked after every message, so it must not
        do work that grows with the fleet."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._route(self.fleet.poll(min(POLL_S, remaining)))
            self.presence.tick(time.monotonic())
        return True

    # ---------------------------------------------------------------- routing
    def _route(self, event: Incoming | Rejection | None) -> None:
        if event is None:
            return
        if isinstance(event, Rejection):
            self._reject(event)
            return
        if event.channel != AgentChannel.STATUS:  # a status updates the registry itself
            self.registry.show_life(event.agent_id)
        if event.channel == AgentChannel.STATUS:
            self._on_status(event)
        elif event.channel == AgentChannel.UPDATE:
            self._on_update(event)
        elif event.channel == AgentChannel.METRICS:
            self._on_metrics(event)

    def _on_status(self, incoming: Incoming) -> None:
        self.presence.status_arrived(time.monotonic())
        status = admit_status(incoming.agent_id, incoming.frame)
        if isinstance(status, Rejection):
            return self._reject(status)
        was_online = self.registry.update(incoming.agent_id, status)
        if status.state == "online" and not was_online:
            self.fleet.agent_online(incoming.agent_id, status.tier)

    def _on_update(self, incoming: Incoming) -> None:
        verdict = self.gate.admit(incoming.agent_id, incoming.frame, self._tasks, self._state)
        if isinstance(verdict, Rejection):
            return self._reject(verdict)
        # Accepting needs a task, and tasks come only with an open round and its sink.
        assert self._sink is not None
        try:
            self._sink.record(verdict, incoming.wire_bytes)
        except AggregationRejected as exc:
            self._reject(Rejection(incoming.agent_id, exc.reason, str(exc)))

    def _on_metrics(self, incoming: Incoming) -> None:
        m = admit_metrics(incoming.agent_id, incoming.frame)
        if isinstance(m, Rejection):
            return self._reject(m)
        report = {
            "tier": m.tier, "release_id": m.release_id, "head": m.head, "correct": m.eval_correct,
            "total": m.num_test, "accuracy": m.eval_correct / m.num_test if m.num_test else None, **m.values,
        }
        self.head_reports[incoming.agent_id] = report
        self._awaited_reports.discard(incoming.agent_id)
        log.info("agent %s (%s tier) reported accuracy %.4f with head %s", incoming.agent_id, m.tier,
                 report["accuracy"] or float("nan"), m.head)

    def _reject(self, rejection: Rejection) -> None:
        self.rejected_total[rejection.reason] += 1
        if self._sink is not None:
            self._sink.rejected[rejection.reason] += 1
        log.warning("rejected message from %s: %s (%s)", rejection.agent_id or "?", rejection.reason,
                    rejection.detail)
