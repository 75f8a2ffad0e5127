"""Fleet registry: who is online, with what tier, device and data, from retained status messages."""

from __future__ import annotations

import logging
import time
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
    """Presence as last announced by each agent (status topic, retained, last will offline)."""

    def __init__(self) -> None:
        self.agents: dict[str, AgentInfo] = {}

    def update(self, agent_id: str, status: StatusMeta) -> None:
        was = self.agents.get(agent_id)
        online = status.state != "offline"
        self.agents[agent_id] = AgentInfo(
            agent_id=agent_id, tier=status.tier, device=status.device, num_train=status.num_train,
            num_test=status.num_test, online=online, version=status.version, platform=status.platform,
        )
        if was is None or was.online != online:
            log.info("agent %s %s (%s tier, %s, %d samples)", agent_id, "online" if online else "offline",
                     status.tier, status.device, status.num_train)

    def online(self, tier: str | None = None) -> list[str]:
        return sorted(a for a, info in self.agents.items() if info.online and (tier is None or info.tier == tier))

    def known(self, agent_id: str) -> bool:
        return agent_id in self.agents
