"""Fleet registry: who is online, with what tier, device and data, from retained status messages."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from edgepfl.protocol import StatusMeta

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


class Registry:
    """Presence as last announced by each agent (status topic, retained, last will offline).

    The round loop asks these questions once per received message, so every query but
    :meth:`online` is O(1) in the fleet size: at 1,000 agents a sorted list per message
    costs more than the round itself.
    """

    def __init__(self) -> None:
        self.agents: dict[str, AgentInfo] = {}
        self._online_by_tier: Counter[str] = Counter()
        self._unresponsive: set[str] = set()
        self._last_life: dict[str, float] = {}
        #: bumped whenever an agent appears, goes on- or offline or changes tier: the fleet view's cue
        self.revision = 0
        # agent id -> (session, created) of the last status accepted with a session
        self._presence: dict[str, tuple[str, float]] = {}

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
        )
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

    def responsive(self, tier: str) -> list[str]:
        """Online agents of ``tier`` that answered their last task or have shown life since, sorted."""
        return [a for a in self.online(tier) if a not in self._unresponsive]

    def mark_unresponsive(self, agent_id: str, silent_since: float) -> None:
        """An agent that let a task time out and sent nothing since ``silent_since``
        (``time.monotonic()``): no tasks until it shows life. One that reconnected during
        the round (its task lost with the old connection) has shown life and is not marked."""
        if self._last_life.get(agent_id, float("-inf")) >= silent_since or agent_id in self._unresponsive:
            return
        self._unresponsive.add(agent_id)
        log.info("agent %s did not answer its task; no tasks until it shows life", agent_id)

    def show_life(self, agent_id: str) -> None:
        """Any frame from the agent (a status, an answer even if late) proves it is there."""
        self._last_life[agent_id] = time.monotonic()
        if agent_id in self._unresponsive:
            self._unresponsive.discard(agent_id)
            log.info("agent %s shows life again", agent_id)

    def last_life(self, agent_id: str) -> float | None:
        """``time.monotonic()`` of the agent's last frame of any kind (None: never)."""
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
