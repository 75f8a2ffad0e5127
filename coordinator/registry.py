"""Fleet registry: who is online, with what tier, device, data and capabilities, from retained status messages.

Besides presence it keeps who may be sent a task of this run (:meth:`Registry.eligible`):
a trainer that is ``online`` (not ``busy``), whose declared capabilities include the
run's method and architecture (:meth:`Registry.require`), and that has not refused a
task of this run for a reason that will not change until it restarts
(:meth:`Registry.exclude`, docs/PROTOCOL.md §10)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from edgepfl.protocol import Capabilities, StatusMeta

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


class Registry:
    """Presence as last announced by each agent (status topic, retained, last will offline).

    The round loop asks these questions once per received message, so every query but
    :meth:`online` is O(1) in the fleet size: at 1,000 agents a sorted list per message
    costs more than the round itself.
    """

    def __init__(self, clock: Clock | None = None) -> None:
        #: the time of an agent's last sign of life (the round loop's clock)
        self.clock = clock or WallClock()
        self.agents: dict[str, AgentInfo] = {}
        self._online_by_tier: Counter[str] = Counter()
        self._unresponsive: set[str] = set()
        self._last_life: dict[str, float] = {}
        #: bumped whenever an agent appears, goes on- or offline or changes tier: the fleet view's cue
        self.revision = 0
        # agent id -> (session, created) of the last status accepted with a session
        self._presence: dict[str, tuple[str, float]] = {}
        # what this run needs of a trainer (require()); None: anything
        self._method: str | None = None
        self._arch: str | None = None
        # trainers that may be sent a task now (online, capable, not excluded): kept up to date per status
        self._eligible: set[str] = set()
        # agent id -> (session, reason) of a refusal that keeps it out of this run until another session
        self._excluded: dict[str, tuple[str | None, str]] = {}
        self._told_incapable: set[str] = set()

    def require(self, method: str, arch: str) -> None:
        """The run's method and architecture: a trainer whose capabilities exclude either gets no task."""
        self._method, self._arch = method, arch
        for agent_id in self.agents:
            self._refresh(agent_id)

    def incapable(self, capabilities: Capabilities | None) -> str | None:
        """Why an agent with these declared capabilities cannot run this run's tasks, or None.
        Undeclared (None) means anything, as for an agent of protocol 1.1."""
        if capabilities is None:
            return None
        if self._method is not None and capabilities.methods is not None and self._method not in capabilities.methods:
            return f"its capabilities do not include method {self._method}"
        if self._arch is not None and capabilities.archs is not None and self._arch not in capabilities.archs:
            return f"its capabilities do not include arch {self._arch}"
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
        if info is not None and info.tier == "trainer" and info.state == "online":
            why = self.incapable(info.capabilities) or self.excluded(agent_id)
            if why is None:
                self._eligible.add(agent_id)
                return
        self._eligible.discard(agent_id)
        if why is not None and agent_id not in self._told_incapable and self.excluded(agent_id) is None:
            self._told_incapable.add(agent_id)  # once per agent: it re-announces on every connect
            log.warning("agent %s gets no task of this %s run: %s", agent_id, self._method or "", why)

    def stale_presence(self, agent_id: str, status: StatusMeta, created: float) -> str | None:
        """Why a status with a ``session`` must not change the agent's presence, or None.

        ``created`` is the status's (signed) creation time on the agent's clock. An
        ``online`` must be newer than the last status accepted; an ``offline`` must be of
        the agent's current session (its will is made before its births, so it is older)
        or newer than the last status accepted (the will of a process whose birth was
        lost). A replayed old ``offline`` fails both. A status without a session (a
        protocol 1.0 agent) is not ordered."""
        last = self._presence.get(agent_id)
        if status.session is None or last is None:
            return None
        session, last_created = last
        if created > last_created:
            return None
        if status.state == "offline" and status.session == session:
            return None
        return (f"{status.state} status of session {status.session[:8]}… made at {created:.3f}, not newer than "
                f"the current session {session[:8]}…'s at {last_created:.3f} (replayed?)")

    def update(self, agent_id: str, status: StatusMeta, created: float | None = None) -> bool:
        """Record a status (made at ``created`` on the agent's clock); returns whether the
        agent was online before it."""
        if status.session is not None and created is not None:
            last = self._presence.get(agent_id)
            self._presence[agent_id] = (status.session, max(created, last[1]) if last else created)
        self.show_life(agent_id)
        was = self.agents.get(agent_id)
        online = status.state != "offline"
        self.agents[agent_id] = AgentInfo(
            agent_id=agent_id, tier=status.tier, device=status.device, num_train=status.num_train,
            num_test=status.num_test, online=online, version=status.version, platform=status.platform,
            state=status.state, session=status.session, capabilities=status.capabilities,
        )
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
        of the run's method and architecture, not excluded by a refusal (O(N log N): not per message)."""
        return sorted(self._eligible)

    def count_eligible(self) -> int:
        return len(self._eligible)

    def responsive(self) -> list[str]:
        """Eligible trainers that answered their last task or have shown life since, sorted."""
        return [a for a in self.eligible() if a not in self._unresponsive]

    def forget(self, agent_id: str) -> None:
        """Drop the agent from the registry (a status the coordinator refuses: it is not registered)."""
        info = self.agents.pop(agent_id, None)
        if info is None:
            return
        if info.online:
            self._online_by_tier[info.tier] -= 1
        self._eligible.discard(agent_id)
        self._presence.pop(agent_id, None)
        self.revision += 1
        log.info("agent %s removed from the registry", agent_id)

    def version(self, agent_id: str) -> str | None:
        """The protocol version the agent's last accepted status announced (None: unknown agent)."""
        info = self.agents.get(agent_id)
        return info.version if info is not None else None

    def mark_unresponsive(self, agent_id: str, silent_since: float) -> None:
        """An agent that let a task time out and sent nothing since ``silent_since``
        (:attr:`clock` time): no tasks until it shows life. One that reconnected during
        the round (its task lost with the old connection) has shown life and is not marked."""
        if self._last_life.get(agent_id, float("-inf")) > silent_since or agent_id in self._unresponsive:
            return
        self._unresponsive.add(agent_id)
        log.info("agent %s did not answer its task; no tasks until it shows life", agent_id)

    def show_life(self, agent_id: str) -> None:
        """Any frame from the agent (a status, an answer even if late) proves it is there."""
        self._last_life[agent_id] = self.clock.now()
        if agent_id in self._unresponsive:
            self._unresponsive.discard(agent_id)
            log.info("agent %s shows life again", agent_id)

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
