"""Who is told: the coordinator's NACKs are bounded per agent (burst and refill) and over
the whole fleet (docs/PROTOCOL.md §7). Protocol 1.2 on the coordinator side end to end,
on the test Mosquitto: tests/integration/rounds/test_nack_live.py.
"""

from __future__ import annotations

from edgepfl.coordinator.gate import Attribution, Rejection
from edgepfl.coordinator.nack import AGENT_BURST, AGENT_RATE_PER_S, FLEET_BURST, Nacker
from edgepfl.coordinator.registry import Registry
from edgepfl.protocol import Message, MessageType, StatusMeta, decode, new_message_id


class Told:
    """A fleet that only records what it is asked to tell."""

    def __init__(self) -> None:
        self.told: list[tuple[str, Message]] = []

    def tell(self, agent_id: str, frame: bytes) -> int:
        self.told.append((agent_id, decode(frame)))
        return len(frame)


def rejection(agent: str, reason: str = "malformed", attributed: bool = True) -> Rejection:
    return Rejection(agent, reason, "x" * 400, Attribution(new_message_id(), "update", 3, None) if attributed else None)


def test_who_is_told_burst_and_refill_per_agent_and_a_fleet_wide_bound():
    now = [0.0]
    registry = Registry()
    for agent, version in [("new", "1.2"), ("old", "1.1"), ("newer", "1.7")]:
        registry.update(agent, StatusMeta(state="online", version=version))
    fleet = Told()
    nacks = Nacker("f", fleet, registry, clock=lambda: now[0])  # type: ignore[arg-type]
    assert not nacks.rejected(rejection("old"))  # 1.1: does not know the message
    assert not nacks.rejected(rejection("stranger"))  # never registered: version unknown
    assert not nacks.rejected(rejection("new", "duplicate"))  # the first copy was answered
    assert not nacks.rejected(rejection("new", attributed=False))  # not provably its frame
    assert nacks.rejected(rejection("stranger", "unsupported_version"))  # told whatever it announced
    assert nacks.rejected(rejection("newer"))
    agent, nack = fleet.told[-1]
    assert agent == "newer" and nack.type == MessageType.NACK and len(nack.meta.detail) == 300
    assert nack.header.round == 3 and nack.header.sender == "coordinator"

    sent = sum(nacks.rejected(rejection("new")) for _ in range(50))
    assert sent == AGENT_BURST and nacks.suppressed == 50 - AGENT_BURST
    now[0] += 1.0
    assert sum(nacks.rejected(rejection("new")) for _ in range(50)) == int(AGENT_RATE_PER_S)
    assert nacks.rejected(rejection("newer"))  # another agent's bucket is its own

    # statuses of an unsupported version from ever new ids: bounded over the whole fleet
    now[0] += 100.0
    sent = sum(nacks.rejected(rejection(f"sybil-{i}", "unsupported_version")) for i in range(1000))
    assert sent == FLEET_BURST
