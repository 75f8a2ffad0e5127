"""Fleet registry: who is online, with what tier, device, data and capabilities, from retained status messages.

Besides presence it keeps who may be sent a task of this run (:meth:`Registry.eligible`):
a trainer that is ``online`` (not ``busy``), whose declared capabilities include the
run's method and architecture (:meth:`Registry.require`), and that has not refused a
task of this run for a reason that will not change until it restarts
(:meth:`Registry.exclude`, docs/PROTOCOL.md §10). A trainer of protocol 1.2 or later whose
status has not declared capabilities yet (its first birth, before it read the presence) is
not sent a task for :data:`CAPABILITIES_WAIT_S`: the task would go out without what they
decide (an uplink codec, a frame limit), and its next status normally declares them."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from edgepfl.protocol import CAPABILITIES, Capabilities, StatusMeta, supports
from edgepfl.protocol.clock import wall_time
from edgepfl.specs import is_import_path

from .clock import Clock, WallClock

log = logging.getLogger("edgepfl.coordinator")


@dataclass
class AgentInfo:
    agent_id: str
    tier: str
    device: str
    num_train: int
    num_test: int
    online: bool
    version: str
    platform: str = ""
    last_seen: float = field(default_factory=time.time)
    #: ``online``, ``busy`` or ``offline``, as last announced (``online`` above is "not offline")
    state: str = "online"
    session: str | None = None
    capabilities: Capabilities | None = None
    #: the broker connection number of the session its last status was made on (protocol 1.3)
    connection: int | None = None
    #: head tier: the release its last status named as installed (protocol 1.4)
    release: str | None = None


#: how far ahead of this host's clock a device's status may set the order of its later ones
#: (the protocol's tolerated clock skew, PROTOCOL §7)
MAX_CLOCK_SKEW_S = 300.0
#: sessions (processes) of one agent whose statuses the registry remembers: a birth of a
#: session not among them is a new process and is heard whatever its clock says
SESSIONS_KEPT = 64
#: a device clock this far off this host's is worth a warning (and shows in the fleet view)
CLOCK_WARNING_S = 60.0
#: how long a trainer of protocol 1.2 or later whose status declares no capabilities waits for
#: one that does before it is sent tasks anyway, as declaring none: its first birth comes before
#: it read the coordinator's presence, the presence goes out again live after 3 s for one that
#: missed the retained copy (``fleet.MISSED_PRESENCE_S``), and an agent that still declares
#: nothing then is taken at its word (capabilities are optional in PROTOCOL.md §10)
CAPABILITIES_WAIT_S = 6.0
#: the most rounds in a row a device that keeps missing its tasks sits out (then it is asked again)
MAX_ROUNDS_BENCHED = 16
#: the rounds a device named by its neighbours' refusals (shares that do not open) first sits out;
#: each time it is named again after coming back, twice as many
ROUNDS_SUSPENDED = 16


class Registry:
    """Presence as last announced by each agent (status topic, retained, last will offline).

    The round loop asks these questions once per received message, so every query but
    :meth:`online` is O(1) in the fleet size: at 1,000 agents a sorted list per message
    costs more than the round itself.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        #: the time of an agent's last sign of life (the round loop's clock)
        self.clock = clock or WallClock()
        #: the tiers whose agents are sent training tasks: trainers, and site aggregators of a
        #: run that takes its sites in summary (each one participant: ``sites.mode: summary``)
        self.training_tiers: frozenset[str] = frozenset({"trainer"})
        self.agents: dict[str, AgentInfo] = {}
        self._online_by_tier: Counter[str] = Counter()
        #: agent id -> (tasks missed in a row, the last round it sits out)
        self._benched: dict[str, tuple[int, int]] = {}
        #: agents whose miss a reconnect excused (once per answer: a device that keeps
        #: re-announcing itself and never answers is benched from its second miss on)
        self._excused: set[str] = set()
        #: agent id -> rounds in a row it kept waiting for a non-answer (:meth:`held_up`)
        self._held_up: dict[str, int] = {}
        self._last_life: dict[str, float] = {}
        self._last_status: dict[str, float] = {}
        self._clock_ahead: dict[str, float] = {}
        #: bumped whenever an agent appears, goes on- or offline or changes tier: the fleet view's cue
        self.revision = 0
        # agent id -> (session, created) of the last status accepted with a session
        self._presence: dict[str, tuple[str, float]] = {}
        # agent id -> the sessions whose statuses were accepted, oldest first (SESSIONS_KEPT at most)
        self._sessions: dict[str, deque[str]] = {}
        # agent id -> (session, the highest broker connection number its statuses were accepted with)
        self._connections: dict[str, tuple[str, int]] = {}
        # what this run needs of a trainer (require()); None: anything
        self._method: str | None = None
        self._arch: str | None = None
        self._task_bytes: int | None = None
        #: the protocol feature (major, minor) this run needs of a trainer, and what needs it (None: none)
        self._feature: tuple[tuple[int, int], str] | None = None
        # trainer id -> (session, when) of a 1.2+ status without capabilities not yet followed by one
        # with them: no task until then, or until CAPABILITIES_WAIT_S have passed
        self._undeclared: dict[str, tuple[str | None, float]] = {}
        # trainers that may be sent a task now (online, capable, not excluded): kept up to date per status
        self._eligible: set[str] = set()
        # agent id -> (session, reason) of a refusal that keeps it out of this run until another session
        self._excluded: dict[str, tuple[str | None, str]] = {}
        self._told_incapable: set[str] = set()
        # head agent id -> the last release it refused, and why (one line; one per agent)
        self._release_refused: dict[str, str] = {}
        # agent id -> (times left out, the last round it sits out, why): named by its neighbours'
        # refusals in secure rounds (:meth:`suspend`); kept across its restarts (its keys are its enrolment)
        self._suspended: dict[str, tuple[int, int, str]] = {}

    def require(self, method: str, arch: str, task_bytes: int | None = None) -> None:
        """The run's method and architecture, and how large its task frames are (None: not yet
        known): a trainer whose capabilities exclude either, or that accepts smaller frames,
        gets no task."""
        self._method, self._arch, self._task_bytes = method, arch, task_bytes
        for agent_id in self.agents:
            self._refresh(agent_id)

    def require_protocol(self, feature: tuple[int, int], needed_by: str) -> None:
        """Trainers whose status announced a protocol before ``feature`` get no task of this
        run (``needed_by``: what needs it, for the log): a secure run's agents must take its steps.
        Of several features required, the latest holds (a minor version has every earlier one's)."""
        if self._feature is not None and self._feature[0] >= feature:
            return
        self._feature = (feature, needed_by)
        for agent_id in self.agents:
            self._refresh(agent_id)

    def _too_old(self, version: str) -> str | None:
        if self._feature is None or supports(version, self._feature[0]):
            return None
        (major, minor), needed_by = self._feature
        return f"it speaks protocol {version}; {needed_by} needs {major}.{minor}"

    def incapable(self, capabilities: Capabilities | None) -> str | None:
        """Why an agent with these declared capabilities cannot run this run's tasks, or None.
        Undeclared (None) means anything, as for an agent of protocol 1.1."""
        if capabilities is None:
            return None
        if self._method is not None and capabilities.methods is not None and self._method not in capabilities.methods:
            return f"its capabilities do not include method {self._method}"
        # an import path (a plugin module:callable) is never announced: the agent finds out when it builds
        # the task's model, and refuses it (unsupported_arch) if the module does not import there
        if (self._arch is not None and capabilities.archs is not None and not is_import_path(self._arch)
                and self._arch not in capabilities.archs):
            return f"its capabilities do not include arch {self._arch}"
        largest = capabilities.max_payload_bytes
        if self._task_bytes is not None and largest is not None and self._task_bytes > largest:
            return f"this run's tasks are {self._task_bytes} bytes, above the {largest} it accepts (max_payload_bytes)"
        return None

    def exclude(self, agent_id: str, reason: str) -> None:
        """The agent refused a task for ``reason``, which will not change while it runs: no
        further task of this run until it announces a status of another session."""
        info = self.agents.get(agent_id)
        self._excluded[agent_id] = (info.session if info else None, reason)
        self._refresh(agent_id)
        log.warning("agent %s refused its task (%s): no further task of this run until it restarts", agent_id, reason)

    def excluded(self, agent_id: str) -> str | None:
        """The refusal reason that keeps the agent out of this run, or None."""
        entry = self._excluded.get(agent_id)
        return entry[1] if entry else None

    def _refresh(self, agent_id: str) -> None:
        """Recompute whether the agent may be sent a task (O(1))."""
        info = self.agents.get(agent_id)
        why = None
        # a site (a summary run's trainer) with no device behind it has nothing to train
        if info is not None and info.tier in self.training_tiers and info.state == "online" \
                and (info.tier != "site" or info.num_train > 0):
            if self._declaring(agent_id):
                self._eligible.discard(agent_id)
                return
            why = self.incapable(info.capabilities) or self._too_old(info.version) or self.excluded(agent_id)
            if why is None:
                self._eligible.add(agent_id)
                return
        self._eligible.discard(agent_id)
        if why is not None and agent_id not in self._told_incapable and self.excluded(agent_id) is None:
            self._told_incapable.add(agent_id)  # once per agent: it re-announces on every connect
            log.warning("agent %s gets no task of this %s run: %s", agent_id, self._method or "", why)

    def _declaring(self, agent_id: str) -> bool:
        """Whether the trainer is still given time to declare its capabilities."""
        entry = self._undeclared.get(agent_id)
        return entry is not None and self.clock.now() < entry[1] + CAPABILITIES_WAIT_S

    def _note_declaration(self, agent_id: str, status: StatusMeta) -> None:
        if status.capabilities is not None or status.tier != "trainer" or not supports(status.version, CAPABILITIES):
            self._undeclared.pop(agent_id, None)
        elif status.state == "online" and (agent_id not in self._undeclared
                                           or self._undeclared[agent_id][0] != status.session):
            # a new process's first birth; kept in the order of arrival (re-inserted at the end), so
            # that the overdue ones are found from the front
            self._undeclared.pop(agent_id, None)
            self._undeclared[agent_id] = (status.session, self.clock.now())

    def _declarations_overdue(self) -> None:
        """Trainers that declared nothing within CAPABILITIES_WAIT_S: taken as declaring none
        (amortised O(1): the entries are in the order they came, the overdue ones in front)."""
        now = self.clock.now()
        overdue = []
        for agent_id, (_, since) in self._undeclared.items():
            if since + CAPABILITIES_WAIT_S > now:
                break
            overdue.append(agent_id)
        for agent_id in overdue:
            del self._undeclared[agent_id]
            log.info("agent %s declared no capabilities within %.0fs of its birth: sent tasks as declaring none",
                     agent_id, CAPABILITIES_WAIT_S)
            self._refresh(agent_id)

    def stale_presence(self, agent_id: str, status: StatusMeta, created: float, signed: bool = True) -> str | None:
        """Why a status with a ``session`` must not change the agent's presence, or None.

        ``created`` is the status's (signed) creation time on the agent's clock. An
        ``online`` must be newer than the last status accepted; an ``offline`` must be of
        the agent's current session (its will is made before its births, so it is older)
        or newer than the last status accepted (the will of a process whose birth was
        lost). A replayed old ``offline`` fails both. A status without a session (a
        protocol 1.0 agent) is not ordered.

        Unless ``signed`` (the status was verified against the agent's enrolled key), an
        ``online`` is never stale: on an unsigned deployment anyone may write any status,
        session and date, so ordering cannot stop a forger, and it must not let one forged
        status (an ``offline`` of a made-up session dated years ahead: docs/SECURITY.md) make the
        real agent's births "older" for the rest of the run. The agent answers a status it
        did not publish with a birth; that birth is always heard."""
        last = self._presence.get(agent_id)
        if status.session is None or last is None:
            return None
        if not signed and status.state != "offline":
            return None
        session, last_created = last
        heard = self._sessions.get(agent_id, ())
        if status.session != session and status.session in heard:
            # an earlier process of this agent: it does not come back, so this is a replay
            # (whatever its clock says: a device restarted with its clock set back makes the
            # earlier process's statuses look newer)
            return self._stale(status, created, session, last_created)
        if created > last_created:
            return None
        newest_connection = self._connections.get(agent_id)
        if (status.state == "online" and status.session == session and status.connection is not None
                and newest_connection is not None and newest_connection[0] == session
                and status.connection > newest_connection[1]):
            # a birth on a later broker connection of the current process (protocol 1.3) is newer
            # whatever the device's clock says: a device whose clock ran ahead and was corrected,
            # then reconnected, was otherwise offline until its clock passed the order mark
            # (up to MAX_CLOCK_SKEW_S), and nothing made it announce itself after that
            return None
        # The same status again while it still holds (the broker re-delivers retained statuses
        # on every subscribe, e.g. after the coordinator reconnects) changes nothing: not
        # stale. Once the agent went offline, its birth replayed is.
        known = self.agents.get(agent_id)
        if (created == last_created and status.session == session and known is not None
                and known.state == status.state):
            return None
        if status.state == "offline" and status.session == session:
            return None
        if status.state == "online" and status.session not in heard:
            # a process this run has not heard before, on a clock behind the last one's (a
            # device restarted with its clock set back): heard, and its clock noted. A replay
            # of a birth is of a session already heard, and stays stale.
            return None
        return self._stale(status, created, session, last_created)

    @staticmethod
    def _stale(status: StatusMeta, created: float, session: str, last_created: float) -> str:
        assert status.session is not None
        return (f"{status.state} status of session {status.session[:8]}… made at {created:.3f}, not newer than "
                f"the current session {session[:8]}…'s at {last_created:.3f} (replayed, or the device's clock is "
                f"{last_created - created:.0f}s behind the one it had)")

    def update(self, agent_id: str, status: StatusMeta, created: float | None = None) -> bool:
        """Record a status (made at ``created`` on the agent's clock); returns whether the
        agent was online before it."""
        if status.session is not None and created is not None:
            last = self._presence.get(agent_id)
            heard = self._sessions.setdefault(agent_id, deque(maxlen=SESSIONS_KEPT))
            # a new process's birth starts the order afresh: its clock, not an earlier process's
            fresh = status.state == "online" and status.session not in heard
            newest = created if fresh or last is None else max(created, last[1])
            if status.session not in heard:
                heard.append(status.session)
            # A device clock far ahead must not set the order for good: once corrected, its
            # statuses would all be "older" (stale_presence) for the rest of the run. The mark
            # never runs more than the tolerated skew ahead of this host's clock.
            now = wall_time()
            self._presence[agent_id] = (status.session, min(newest, now + MAX_CLOCK_SKEW_S))
            known = self._connections.get(agent_id)
            if status.connection is not None and (known is None or known[0] != status.session
                                                  or status.connection > known[1]):
                self._connections[agent_id] = (status.session, status.connection)
            self._note_clock(agent_id, created - now)
        self.show_life(agent_id)
        self._last_status[agent_id] = self.clock.now()
        was = self.agents.get(agent_id)
        online = status.state != "offline"
        self.agents[agent_id] = AgentInfo(
            agent_id=agent_id, tier=status.tier, device=status.device, num_train=status.num_train,
            num_test=status.num_test, online=online, version=status.version, platform=status.platform,
            state=status.state, session=status.session, capabilities=status.capabilities,
            connection=status.connection, release=status.release.release_id if status.release else None,
        )
        self._note_declaration(agent_id, status)
        excluded = self._excluded.get(agent_id)
        if excluded is not None and status.state != "offline" and status.session != excluded[0]:
            del self._excluded[agent_id]  # a restarted agent: its refusal may not hold any more
            log.info("agent %s restarted (session %s): eligible for tasks again", agent_id, status.session)
        self._refresh(agent_id)
        if was is not None and was.online:
            self._online_by_tier[was.tier] -= 1
        if online:
            self._online_by_tier[status.tier] += 1
        if was is None or was.online != online or was.tier != status.tier:
            self.revision += 1
        if was is None or was.online != online:
            log.info("agent %s %s (%s tier, %s, %d samples)", agent_id, "online" if online else "offline",
                     status.tier, status.device, status.num_train)
        return was is not None and was.online

    def online(self, tier: str | None = None) -> list[str]:
        """Ids of the agents whose last status is not offline, sorted (O(N log N): not per message)."""
        return sorted(a for a, info in self.agents.items() if info.online and (tier is None or info.tier == tier))

    def eligible(self) -> list[str]:
        """Trainers that may be sent a task of this run, sorted: online and not ``busy``, capable
        of the run's method and architecture, not excluded by a refusal, its capabilities declared
        (O(N log N): not per message)."""
        self._declarations_overdue()
        return sorted(self._eligible)

    def count_eligible(self) -> int:
        self._declarations_overdue()
        return len(self._eligible)

    def responsive(self, round: int, final: bool = False) -> list[str]:
        """Eligible trainers that do not sit out ``round`` (:meth:`missed`, :meth:`held_up`), sorted.
        ``final``: the run's final evaluation, which asks every device that may answer it — a
        slow or silent one too, whose accuracy the fleet's figure needs and which costs this one
        evaluation at most its deadline — but one that kept two rounds in a row waiting for a
        refusal or a rejected answer (it would keep this one waiting for nothing as well)."""
        def sits_out(agent_id: str) -> bool:
            until = self._benched.get(agent_id, (0, -1))[1]
            suspended = self._suspended.get(agent_id, (0, -1, ""))[1]
            return (round <= until and (not final or self._held_up.get(agent_id, 0) >= 2)) or \
                (round <= suspended and not final)
        return [a for a in self.eligible() if not sits_out(a)]

    def suspend(self, agent_id: str, round: int, why: str) -> None:
        """Leave the agent out of the rounds after ``round``: :data:`ROUNDS_SUSPENDED` of them,
        twice as many each time again (the final evaluation still asks it). ``why`` is shown
        in the fleet view with the round it is asked again."""
        times = self._suspended.get(agent_id, (0, -1, ""))[0] + 1
        until = round + ROUNDS_SUSPENDED * 2 ** (times - 1)
        self._suspended[agent_id] = (times, until, f"{why}; no task before round {until + 1}")
        self.revision += 1
        log.warning("agent %s is left out of the rounds until round %d: %s", agent_id, until + 1, why)

    def suspended(self, agent_id: str, round: int) -> str | None:
        """Why the agent is left out of ``round`` (:meth:`suspend`), or None."""
        entry = self._suspended.get(agent_id)
        return entry[2] if entry is not None and round <= entry[1] else None

    def benched_until(self, agent_id: str) -> int | None:
        """The last round the agent sits out for the tasks it missed in a row (None: none missed)."""
        entry = self._benched.get(agent_id)
        return entry[1] if entry is not None else None

    def forget(self, agent_id: str) -> None:
        """Drop the agent from the registry (a status the coordinator refuses: it is not registered)."""
        info = self.agents.pop(agent_id, None)
        if info is None:
            return
        if info.online:
            self._online_by_tier[info.tier] -= 1
        self._eligible.discard(agent_id)
        self._undeclared.pop(agent_id, None)
        self._presence.pop(agent_id, None)
        self._connections.pop(agent_id, None)
        self.revision += 1
        log.info("agent %s removed from the registry", agent_id)

    def release_report(self, agent_id: str, release_id: str | None, refused: str | None) -> None:
        """A head agent reported on ``release_id``: installed (``refused`` None), or not and why.
        One entry per known agent, so a flood of reports cannot grow it."""
        info = self.agents.get(agent_id)
        if info is None:
            return
        if refused is None and release_id and info.release != release_id:
            # installed: what its status re-published after the install will say, which may come
            # after the run's last view (whose counts then named the release it had before)
            info.release = release_id
            self.revision += 1
        if refused is not None:
            entry = f"{release_id}: {refused}"
            if self._release_refused.get(agent_id) != entry:
                self._release_refused[agent_id] = entry
                self.revision += 1
        elif self._release_refused.pop(agent_id, None) is not None:
            self.revision += 1

    def release_refused(self, agent_id: str) -> str | None:
        """The last release the head agent refused and why, until it reports one installed."""
        return self._release_refused.get(agent_id)

    def version(self, agent_id: str) -> str | None:
        """The protocol version the agent's last accepted status announced (None: unknown agent)."""
        info = self.agents.get(agent_id)
        return info.version if info is not None else None

    def missed(self, agent_id: str, round: int, silent_since: float) -> None:
        """The agent let its task of ``round`` time out (it sent no answer since ``silent_since``,
        :attr:`clock` time). It sits out the next ``2 ** (misses in a row - 1)`` rounds, at most
        :data:`MAX_ROUNDS_BENCHED`, and is then sampled again: a device whose answer was lost
        trains again two rounds later, one that never answers costs a round's deadline ever
        more rarely, and no device is shut out for the run. A device that announced itself
        again during the round (a reconnect loses the task with the connection) is excused
        once per answer."""
        if self._last_status.get(agent_id, float("-inf")) > silent_since and agent_id not in self._excused:
            self._excused.add(agent_id)
            return
        self._bench(agent_id, round, "did not answer its task")

    def held_up(self, agent_id: str, round: int) -> None:
        """The round waited for the agent alone, longer than its patience (a quarter of its
        deadline, :data:`.round_tasks.PATIENCE_SHARE`), and what it then sent was no update or
        evaluation (its own refusal, or its own answer rejected): a miss like a timeout, never
        excused. A device that answers each task with a refusal just before the deadline
        would otherwise cost every round its wait; one that refuses while others still train,
        or just after them (a clock ahead refuses every task at once), costs nothing worth
        counting and is not counted."""
        self._held_up[agent_id] = self._held_up.get(agent_id, 0) + 1
        self._bench(agent_id, round, "kept the round waiting for no answer")

    def _bench(self, agent_id: str, round: int, what: str) -> None:
        misses = self._benched.get(agent_id, (0, 0))[0] + 1
        until = round + min(2 ** (misses - 1), MAX_ROUNDS_BENCHED)
        self._benched[agent_id] = (misses, until)
        log.info("agent %s %s of round %d (%d in a row): no task before round %d", agent_id, what, round, misses,
                 until + 1)

    def clock_ahead(self, agent_id: str) -> float | None:
        """How far ahead of this host's clock the agent's last status was made, when more than
        :data:`CLOCK_WARNING_S` (else None). Only ahead: a status made earlier may simply have
        been retained by the broker for a while, so a clock behind does not show this way."""
        return self._clock_ahead.get(agent_id)

    def _note_clock(self, agent_id: str, ahead: float) -> None:
        if ahead <= CLOCK_WARNING_S:
            self._clock_ahead.pop(agent_id, None)
            return
        if agent_id not in self._clock_ahead:  # once per agent until its clock is right again
            log.warning("agent %s's clock is %.0f s ahead of this coordinator's: beyond %.0f s it drops tasks as "
                        "expired (PROTOCOL §7); check its time synchronisation", agent_id, ahead, MAX_CLOCK_SKEW_S)
        self._clock_ahead[agent_id] = ahead

    def answered(self, agent_id: str) -> None:
        """An update or evaluation from the agent was accepted (even late): it missed nothing. A
        refusal is no answer here: it neither ends nor excuses misses in a row (:meth:`held_up`)."""
        self._excused.discard(agent_id)
        self._held_up.pop(agent_id, None)
        if self._benched.pop(agent_id, None) is not None:
            log.info("agent %s answers again", agent_id)

    def show_life(self, agent_id: str) -> None:
        """Any frame from the agent proves it is there (the fleet view's last seen)."""
        self._last_life[agent_id] = self.clock.now()

    def last_life(self, agent_id: str) -> float | None:
        """The :attr:`clock` time of the agent's last frame of any kind (None: never)."""
        return self._last_life.get(agent_id)

    def count_online(self, tier: str) -> int:
        return self._online_by_tier[tier]

    def is_online(self, agent_id: str) -> bool:
        info = self.agents.get(agent_id)
        return info is not None and info.online

    def known(self, agent_id: str) -> bool:
        return agent_id in self.agents

    def announced_num_train(self, agent_id: str) -> int:
        """Training samples the agent's last status announced (0 for an unknown agent)."""
        info = self.agents.get(agent_id)
        return info.num_train if info is not None else 0
