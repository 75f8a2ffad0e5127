"""The coordinator's one way of waiting: pump the fleet's traffic until a condition holds.

:class:`Inbox` routes every inbound event — statuses to the :class:`~.registry.Registry`
(telling the fleet who came online), updates through the :class:`~.gate.UpdateGate`
into the open round (whose aggregate folds each one in at once, or refuses it with an
:class:`~edgepfl.aggregation.AggregationRejected`), refusals of tasks to the round's
counters (and the registry, which may exclude the agent), head-tier metrics to the head
reports, and every rejection, by reason, to the round's and the run's counters, the log
and, through the :class:`~.nack.Nacker`, a NACK to the agent whose frame it was.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Protocol

from edgepfl.aggregation import AggregationRejected
from edgepfl.logs import LogLimiter
from edgepfl.methods import ServerState
from edgepfl.metrics import HeadReport
from edgepfl.protocol import AgentChannel, StatusMeta, unbounded_values
from edgepfl.protocol.signing import SIGNATURE_REASONS, Keyring
from edgepfl.service import notifier

from .clock import Clock, WallClock
from .fleet import AgentFrame, Fleet
from .gate import (
    EXCLUDING_REFUSALS,
    Accepted,
    Attribution,
    Presence,
    Refused,
    Rejection,
    StepAnswer,
    UpdateGate,
    admit_metrics,
    admit_presence,
)
from .nack import Nacker
from .presence import PresenceWatch
from .registry import Registry
from .result import RunCounters
from .round_tasks import MAX_TASK_COPIES, LateWindow, RoundTasks, Task

log = logging.getLogger("edgepfl.coordinator")

# How long one poll of the fleet may block: the granularity of deadlines.
POLL_S = 0.2
#: head-tier reports kept per agent: its last this many releases (the current one and a few before)
REPORTS_KEPT_PER_AGENT = 4
#: what the chunked frames of one agent holding a task may reserve, in task frames of the run, plus
#: :data:`CHUNK_HEADROOM`: an update carries the tensors its task carried, and at most as much again
#: (a method's uploaded personal head, a secure round's 64-bit masked vector of 32-bit weights)
CHUNK_ALLOWANCE_TASKS = 2
#: bytes above that for an update's header (its meta, values, signature)
CHUNK_HEADROOM = 2**20


#: how many agents' allowances a site aggregator's chunked answer may reserve: its partial sum is
#: two int64 words per parameter, four float32 tasks' worth (docs/PROTOCOL.md §20)
SITE_ANSWER_TASKS = 3


class SiteStatuses(Protocol):
    """Told every site aggregator's accepted status (:class:`.site_relay.SiteRelay`)."""

    #: the agent ids that may be sites
    ids: frozenset[str]

    def status(self, site_id: str, status: StatusMeta, created: float | None) -> None: ...

    def summed(self, site_id: str, round: int, trained_on: int | None = None) -> None: ...


class RoundSink(Protocol):
    """Where an open round's accepted updates and rejections go (the round loop's ``RoundResult``)."""

    rejected: Counter
    #: refused tasks by reason
    refused: Counter
    #: bytes of tasks sent this round
    bytes_down: int

    def sent(self, wire_bytes: int, downlink: str = "whole") -> None:
        """Count a task put on the wire (whole, or a task delta of codec ``downlink``)."""

    def record(self, accepted: Accepted, wire_bytes: int) -> None:
        """Take an accepted answer; raises :class:`AggregationRejected` for an update the
        round's rule refuses, having kept nothing of it."""


class Inbox:
    """Routes what the fleet delivers; :meth:`pump_until` is the only loop that polls it.

    ``counters`` are the run's rejections and refused tasks by reason (the round loop's,
    restored from its checkpoint): the inbox counts each into them and into the open
    round's sink at the moment it decides.
    """

    def __init__(self, fleet: Fleet, registry: Registry, gate: UpdateGate, counters: RunCounters,
                 tick: Callable[[], None] | None = None, keyring: Keyring | None = None,
                 presence: PresenceWatch | None = None, nacks: Nacker | None = None, clock: Clock | None = None):
        self.fleet = fleet
        #: deadlines and presence are in this clock's time (the fleet's); the log's rate limit is the wall's
        self.clock = clock or WallClock()
        #: answers attributable rejections with NACKs (None: nobody is told)
        self.nacks = nacks
        self.tick = tick  # called after every poll; O(1) unless it decides to publish (the fleet view)
        self.presence = presence or PresenceWatch(registry, expected=None)
        self.registry = registry
        self.gate = gate
        self.counters = counters
        #: release id -> agent id -> the agent's report measured with that release; an agent's
        #: reports on its last :data:`REPORTS_KEPT_PER_AGENT` releases only (a device naming a
        #: fresh release id in every report would otherwise grow this without bound)
        self.reports_by_release: dict[str, dict[str, HeadReport]] = {}
        self._releases_reported: dict[str, list[str]] = {}
        #: with a keyring, statuses and metrics must be signed by the sender's enrolled key
        self.keyring = keyring
        # a flood of rejections (Sybils, forged statuses) must not flood the log; each is still counted
        self._log = LogLimiter(log)  # per rejection reason
        self._awaited_reports: set[str] = set()
        self._awaited_release: str | None = None
        # The open round: before round 0 none (no tasks; rejections count in the run's
        # total only); between rounds the last one, until the next opens.
        self._tasks = RoundTasks(-1)
        self._sink: RoundSink | None = None
        self._state: ServerState | None = None
        self._late: Mapping[int, LateWindow] | None = None
        #: takes the open secure round's ``secagg`` steps, with their wire bytes (None: no secure round open;
        #: they are ignored)
        self.steps: Callable[[StepAnswer, int], None] | None = None
        #: told every refusal of the open round's tasks (None: nobody is)
        self.refusals: Callable[[Refused], None] | None = None
        #: sends a task of the open round again, same id (returns the bytes sent); None where
        #: the fleet cannot lose a task (:attr:`~.fleet.Fleet.loses_tasks`)
        self.resend: Callable[[Task, int], int] | None = None
        # what one agent's chunked answer may reserve (expect_updates); None: no chunked frame is expected
        self._chunk_bytes: int | None = None
        #: the run's sites, told every site aggregator's status (None: the run takes none, and refuses them)
        self.sites: SiteStatuses | None = None

    def open_round(self, tasks: RoundTasks, sink: RoundSink, state: ServerState,
                   late: Mapping[int, LateWindow] | None = None) -> None:
        """Admit answers to ``tasks``, checked against ``state`` (what the tasks were built from), into ``sink``;
        with ``late``, also the training updates of agents those closed rounds dropped."""
        self._tasks, self._sink, self._state, self._late = tasks, sink, state, late

    def expect_updates(self, task_bytes: int) -> None:
        """The run's task frames are ``task_bytes`` long: an agent holding a task may reserve
        about two of them for its chunked answer (:func:`chunk_allowance`)."""
        self._chunk_bytes = CHUNK_ALLOWANCE_TASKS * task_bytes + CHUNK_HEADROOM

    def chunk_allowance(self, agent_id: str, channel: AgentChannel) -> int:
        """Bytes the chunked frames on ``agent_id``'s ``channel`` topic may reserve now: an
        answer's worth on the update topic of an agent the open round (or a closed one still
        taking late updates) expects an answer of, else none. Statuses and metrics fit one
        message (docs/PROTOCOL.md §8), and a topic of an agent nobody asked reserves nothing,
        so chunks on strangers' topics cannot fill the budget that honest answers need."""
        if self._chunk_bytes is None or channel != AgentChannel.UPDATE:
            return 0
        task = self._tasks.get(agent_id)
        if task is not None and task.site is not None and self._tasks.expects(agent_id):
            return SITE_ANSWER_TASKS * self._chunk_bytes
        if self._tasks.expects(agent_id) or any(agent_id in w.tasks.waiting for w in (self._late or {}).values()):
            return self._chunk_bytes
        return 0

    @property
    def late_rounds(self) -> set[int]:
        """The closed rounds whose late updates the open round takes."""
        return set(self._late or ())

    def collect_reports(self, release_id: str, timeout: float, heads: int = 0, wait_s: float = 0.0) -> bool:
        """Route inbound traffic until every head agent online has reported on ``release_id``
        (installed or refused), or ``timeout`` passes. First, up to ``wait_s`` for ``heads``
        head agents to be online (the ones a simulated fleet started, which may come up after
        a short run's release: they get it late). False: no head agent is online."""
        if heads:
            self.pump_until(lambda: self.registry.count_online("head") >= heads, self.clock.now() + wait_s)
        if not (online := self.registry.online("head")):
            return False
        self._awaited_release = release_id
        self._awaited_reports = set(online) - self.reports_by_release.get(release_id, {}).keys()
        self.pump_until(lambda: not self._awaited_reports, self.clock.now() + timeout)
        return True

    def wait_for_trainers(self, need: int, deadline: float, note: Callable[[str], None]) -> int:
        """Route inbound traffic until ``need`` trainers that may be sent this run's tasks are
        online (:meth:`Registry.eligible`) or ``deadline`` passes; returns how many are.
        ``note`` shows the count, at most once a second: a thousand agents coming online
        are not a thousand lines."""
        shown, shown_at = -1, float("-inf")

        def enough() -> bool:
            nonlocal shown, shown_at
            online = self.registry.count_eligible()
            if online < need and online != shown and self.clock.now() - shown_at >= 1.0:
                note(f"waiting for agents: {online}/{need} online")
                shown, shown_at = online, self.clock.now()
            return online >= need

        self.pump_until(enough, deadline)
        return self.registry.count_eligible()

    def pump_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Route inbound traffic until ``done()`` holds (True) or the :attr:`clock`'s
        ``deadline`` passes (False). ``done`` is asked after every message, so it must not
        do work that grows with the fleet."""
        while not done():
            notifier().watchdog()  # the coordinator's service loop: systemd's WatchdogSec= is fed here
            remaining = deadline - self.clock.now()
            if remaining <= 0:
                return False
            self._route(self.fleet.poll(min(POLL_S, remaining)))
            self.presence.tick(self.clock.now())
            if self.tick is not None:
                self.tick()
        return True

    def collect(self, tasks: RoundTasks, sampled: int, participants: list[str], started: float, timeout: float,
                quorum: int) -> list[str]:
        """Admit answers until every task of ``tasks`` is answered or, once ``quorum`` of the
        ``sampled`` agents' updates are in (``participants``, live), ``timeout`` passes or every
        agent still owing an answer is offline; never past twice the timeout. Returns who did
        not answer (sorted), whom the round then drops."""
        waiting = tasks.waiting  # live: the gate removes agents as they answer
        tasks.start_collecting()

        def closable() -> bool:
            if not waiting:
                return True
            if len(participants) < quorum:
                return False
            # is_online is a dict lookup, and any() stops at the first agent still online:
            # no per-message work that grows with the fleet.
            return self.clock.now() - started > timeout or not any(self.registry.is_online(a) for a in waiting)

        self.pump_until(closable, started + 2 * timeout)
        if waiting:
            log.info("round %d: closed with %d/%d updates after %.0fs; no answer from %s", tasks.round,
                     len(participants), sampled, self.clock.now() - started, ", ".join(sorted(waiting)))
        # a site aggregator that did not answer is no device of the round: its devices are the dropped ones
        # (a summary site is the round's participant itself)
        return sorted(a for a in waiting if (task := tasks.get(a)) is None or task.site is None
                      or task.site.sample is not None)

    # ---------------------------------------------------------------- routing
    def _route(self, event: AgentFrame | Rejection | Refused | None) -> None:
        if event is None:
            return
        if isinstance(event, Rejection):
            self._reject(event)
            return
        if isinstance(event, Refused):
            self._undelivered(event)
            return
        if event.channel == AgentChannel.STATUS:
            self._on_status(event)
        elif event.channel == AgentChannel.UPDATE:
            self._on_update(event)
        elif event.channel == AgentChannel.METRICS:
            self._on_metrics(event)

    def _on_status(self, incoming: AgentFrame) -> None:
        self.presence.status_arrived(self.clock.now())
        status = admit_presence(incoming.agent_id, incoming.frame, self.keyring, self.registry)
        if isinstance(status, Rejection):
            return self._reject(status)
        assert isinstance(status, Presence)
        if status.meta.tier == "site" and (self.sites is None or incoming.agent_id not in self.sites.ids):
            return self._reject(Rejection(incoming.agent_id, "not_a_site", "a site aggregator's status from an agent "
                                          "that is none of sites.ids" if self.sites is not None else
                                          "a site aggregator's status; this run takes no sites (sites.enabled)", None))
        was_online = self.registry.update(incoming.agent_id, status.meta, status.created)
        if status.meta.tier == "site" and self.sites is not None:
            self.sites.status(incoming.agent_id, status.meta, status.created)
        capabilities = status.meta.capabilities
        self.fleet.agent_limits(incoming.agent_id, capabilities.max_message_bytes if capabilities else None,
                                capabilities.max_payload_bytes if capabilities else None)
        self.fleet.agent_status(incoming.agent_id, status.meta, came_online=status.meta.state == "online" and not was_online)
        if status.meta.state == "online":
            self._resend_lost_task(incoming.agent_id, status.meta.session, status.meta.connection)

    def _resend_lost_task(self, agent_id: str, session: str | None, connection: int | None) -> None:
        """An agent's birth on a later connection of the session its open task went to: the
        task may have been lost with the old connection (a broker that restarted forgets what
        it had not delivered), so it goes again, same task id, seed and payload (PROTOCOL.md
        §10). A birth on the same connection (a roll call's answer, a re-announcement) brings
        nothing; an agent that got the task after all trains it once and answers the copy
        from its cache, which is then counted ``duplicate``."""
        tasks = self._tasks
        task = tasks.get(agent_id)
        if (self.resend is None or tasks.closed or task is None or agent_id not in tasks.waiting
                or task.copies >= MAX_TASK_COPIES or not task.lost_with_connection(session, connection)):
            return
        tasks.add(replace(task, connection=connection, copies=task.copies + 1))
        sent = self.resend(task, tasks.round)
        if self._sink is not None:
            self._sink.sent(sent)  # a task sent again goes whole
        log.info("round %d: %s reconnected (connection %s) with its task unanswered; sent it again", tasks.round,
                 agent_id, connection)

    def _on_update(self, incoming: AgentFrame) -> None:
        agent_id, tasks = incoming.agent_id, self._tasks
        waited_for = agent_id in tasks.waiting
        verdict = self.gate.admit(agent_id, incoming.frame, tasks, self._state, self._late)
        self._shows_life(agent_id, verdict)
        if isinstance(verdict, Rejection):
            # a rejection ends the agent's wait only when its enrolled key signed the frame
            if waited_for and self._held_up(agent_id, provably_its_own=True):
                self.registry.held_up(agent_id, tasks.round)
            return self._reject(verdict)
        if isinstance(verdict, StepAnswer):
            if self.steps is not None:
                self.steps(verdict, incoming.wire_bytes)
            return
        # Accepting needs a task, and tasks come only with an open round and its sink.
        assert self._sink is not None
        if isinstance(verdict, Refused):
            if waited_for and self._held_up(agent_id, verdict.may_exclude or self.fleet.own_frames):
                self.registry.held_up(agent_id, tasks.round)
            return self._on_refusal(verdict)
        try:
            self._sink.record(verdict, incoming.wire_bytes)
        except AggregationRejected as exc:
            # an update the round's rule refuses is no answer either (accepted by the gate, it is
            # provably the agent's own only where updates must be signed)
            if waited_for and self._held_up(agent_id, self.keyring is not None or self.fleet.own_frames):
                self.registry.held_up(agent_id, tasks.round)
            update = verdict.meta
            self._reject(Rejection(agent_id, exc.reason, str(exc), Attribution(
                verdict.message_id, "update", self._tasks.round, update.task_id, verified=self.keyring is not None)))
            return
        self.registry.answered(agent_id)
        site = verdict.meta.site
        if site is not None:
            # what the site refused of its devices' frames, and what its devices refused, count in the
            # round's row and the run's totals as if this coordinator had met them itself
            for counts, sink, run in ((site.rejected, self._sink.rejected, self.counters.rejected),
                                      (site.refused, self._sink.refused, self.counters.refused)):
                sink.update(counts)
                run.update(counts)
        if site is not None and self.sites is not None:
            for device in site.devices:
                self.registry.answered(device.agent)
            if verdict.site is not None:
                self.sites.summed(agent_id, tasks.round, verdict.late.tasks.round if verdict.late is not None else None)

    def _held_up(self, agent_id: str, provably_its_own: bool) -> bool:
        """Whether the agent's frame, which was no update or evaluation the round could use (a
        refusal, a rejected answer, an update the rule refused), just ended a wait for it alone
        longer than the round's patience (:meth:`.RoundTasks.held_up_by`): the round then waited
        for nothing. Only a frame ``provably_its_own`` counts (signed by its enrolled key, or
        from a fleet whose frames are its agents' own), so a forged one benches nobody."""
        return provably_its_own and self._tasks.held_up_by(agent_id)

    def _undelivered(self, refused: Refused) -> None:
        """A task of the open round the fleet did not send (larger than the agent accepts): it
        answers the task as the agent's refusal would, so the round does not wait for it."""
        if self._sink is None or refused.agent_id not in self._tasks.waiting:
            return
        self._tasks.mark_answered(refused.agent_id)
        self._on_refusal(refused)

    def _on_refusal(self, refused: Refused) -> None:
        assert self._sink is not None
        self._sink.refused[refused.reason] += 1
        self.counters.refused[refused.reason] += 1
        log.info("round %d: agent %s refused its task: %s (%s)", self._tasks.round, refused.agent_id, refused.reason,
                 refused.detail)
        if refused.reason in EXCLUDING_REFUSALS and (refused.may_exclude or self.fleet.own_frames):
            self.registry.exclude(refused.agent_id, refused.reason)
        if self.refusals is not None:
            self.refusals(refused)

    def _on_metrics(self, incoming: AgentFrame) -> None:
        m = admit_metrics(incoming.agent_id, incoming.frame, self.keyring, self.registry)
        self._shows_life(incoming.agent_id, m)
        if isinstance(m, Rejection):
            return self._reject(m)
        # the accuracy is the coordinator's, from the counts; the agent's values are only its own figures,
        # and none of a report that carries more than a report's few (PROTOCOL.md §5: never a fitted head)
        refused = m.refused if m.tier == "head" else None
        values = m.values
        if (why := unbounded_values(values)) is not None:
            self._log.warning("values_dropped", "the metrics of %s carry %s: its counts are kept, its values are not",
                              incoming.agent_id, why)
            values = {}
        report = HeadReport(tier=m.tier, release_id=m.release_id, head=m.head, correct=0 if refused else m.eval_correct,
                            total=0 if refused else m.num_test, values=values, refused=refused)
        self._keep_report(incoming.agent_id, m.release_id or "", report)
        if m.release_id == self._awaited_release:
            self._awaited_reports.discard(incoming.agent_id)  # a refusal is its answer too: nothing to wait for
        if m.tier == "head":
            self.registry.release_report(incoming.agent_id, m.release_id, refused)
            # which release it has: the next one may go to it as a delta (or, refused as one, whole)
            self.fleet.releases.reported(incoming.agent_id, m.release_id, refused is not None)
        if refused:
            self._log.warning("release_refused", "head agent %s did not install release %s: %s",
                              incoming.agent_id, m.release_id, refused)
        else:
            log.debug("agent %s (%s tier) reported accuracy %.4f with head %s", incoming.agent_id, m.tier,
                      report.accuracy or float("nan"), m.head)

    def _keep_report(self, agent_id: str, release_id: str, report: HeadReport) -> None:
        """Keep ``report``, dropping the agent's report on its oldest release when it has more than allowed."""
        self.reports_by_release.setdefault(release_id, {})[agent_id] = report
        releases = self._releases_reported.setdefault(agent_id, [])
        if release_id in releases:
            releases.remove(release_id)
        releases.append(release_id)
        while len(releases) > REPORTS_KEPT_PER_AGENT:
            oldest = releases.pop(0)
            reports = self.reports_by_release[oldest]
            del reports[agent_id]
            if not reports:
                del self.reports_by_release[oldest]

    def _shows_life(self, agent_id: str, verdict: object) -> None:
        """Any frame from the agent (an answer even if late) proves it is there; a forged one does not."""
        if not (isinstance(verdict, Rejection) and verdict.reason in SIGNATURE_REASONS):
            self.registry.show_life(agent_id)

    def _reject(self, rejection: Rejection) -> None:
        if rejection.reason == "unsupported_version" and rejection.attributed is not None:
            self.registry.forget(rejection.agent_id or "")  # an agent of another major version is not registered
        if self.nacks is not None:
            self.nacks.rejected(rejection)
        self.counters.rejected[rejection.reason] += 1
        if self._sink is not None:
            self._sink.rejected[rejection.reason] += 1
        self._log.warning(rejection.reason, "rejected message from %s: %s (%s)", rejection.agent_id or "?",
                          rejection.reason, rejection.detail)
