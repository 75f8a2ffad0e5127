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

    def update(self, agent_id: str, status: StatusMeta) -> bool:
        """Record a status; returns whether the agent was online before it."""
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
        if was is None or was.online != online:
            log.info("agent %s %s (%s tier, %s, %d samples)", agent_id, "online" if online else "offline",
                     status.tier, status.device, status.num_train)
        return was is not None and was.online

    def online(self, tier: str | None = None) -> list[str]:
        """Ids of the agents whose last status is not offline, sorted (O(N log N): not per message)."""
        return sorted(a for a, info in self.agents.items() if info.online and (tier is None or info.tier == tier))

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
