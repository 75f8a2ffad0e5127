"""The topic grammar: the only place that builds or parses an MQTT topic.

``edgepfl/v1/<federation>/agents/<agent>/<channel>`` for per-agent traffic,
``edgepfl/v1/<federation>/<channel>`` for federation-wide traffic and
``edgepfl/v1/<federation>/release/<index>`` for the retained parts of a release too large
for one MQTT message (docs/PROTOCOL.md §12). Every name
segment matches ``[A-Za-z0-9_-]+`` so a topic never carries a wildcard or a
separator smuggled in by a name, and a broker ACL keyed on the username
(``pattern readwrite edgepfl/v1/+/agents/%u/#``) confines each agent to its own
topics. Each channel has exactly one direction, noted on its enum member below and
tabled in docs/PROTOCOL.md ("Channels"); tests/integration/releases/test_mixed_fleet.py checks every frame
of a real run against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

ROOT = "edgepfl"
VERSION_SEGMENT = "v1"
#: the longest name a segment (federation, agent id) may be
NAME_MAX_CHARS = 64
#: a federation or agent name: a topic segment, and the envelope's ``federation`` / ``sender`` / ``recipient``
NAME_PATTERN = rf"^[A-Za-z0-9_-]{{1,{NAME_MAX_CHARS}}}$"
_SEGMENT = re.compile(NAME_PATTERN)
#: a part index: decimal, no leading zero, below a chunk's largest ``count`` (1 000 000)
_PART = re.compile(r"^(0|[1-9][0-9]{0,5})$")


class AgentChannel(str, Enum):
    STATUS = "status"  # agent -> all, retained, last will "offline"
    TASK = "task"  # coordinator -> agent
    UPDATE = "update"  # agent -> coordinator
    METRICS = "metrics"  # agent -> coordinator (head tier reports, serving stats)


class FederationChannel(str, Enum):
    COORDINATOR = "coordinator"  # coordinator -> all, retained presence
    RELEASE = "release"  # coordinator -> all, retained pointer to the current encoder
    VIEW = "view"  # coordinator -> operators, retained plain JSON (edgepfl.protocol.view), not a frame


class TopicError(ValueError):
    """A topic or a name that cannot be part of one."""


def check_segment(value: str, what: str = "name") -> str:
    if not isinstance(value, str) or not _SEGMENT.match(value):
        raise TopicError(f"{what} {value!r} must match [A-Za-z0-9_-]{{1,{NAME_MAX_CHARS}}}")
    return value


def agent_topic(federation: str, agent: str, channel: AgentChannel) -> str:
    check_segment(federation, "federation")
    check_segment(agent, "agent id")
    return f"{ROOT}/{VERSION_SEGMENT}/{federation}/agents/{agent}/{AgentChannel(channel).value}"


def agent_wildcard(federation: str, channel: AgentChannel) -> str:
    """Subscription filter for one channel of every agent (coordinator side)."""
    check_segment(federation, "federation")
    return f"{ROOT}/{VERSION_SEGMENT}/{federation}/agents/+/{AgentChannel(channel).value}"


def federation_topic(federation: str, channel: FederationChannel) -> str:
    check_segment(federation, "federation")
    return f"{ROOT}/{VERSION_SEGMENT}/{federation}/{FederationChannel(channel).value}"


def release_part_topic(federation: str, index: int) -> str:
    """The retained topic of chunk ``index`` of a release published in parts."""
    if not isinstance(index, int) or not _PART.match(str(index)):
        raise TopicError(f"release part index {index!r} must be an integer in 0..999999")
    return f"{federation_topic(federation, FederationChannel.RELEASE)}/{index}"


@dataclass(frozen=True)
class ParsedTopic:
    federation: str
    channel: AgentChannel | FederationChannel
    agent: str | None = None
    #: the index of a release part topic (``…/release/<index>``), else None
    part: int | None = None


def parse_topic(topic: str) -> ParsedTopic:
    """Inverse of :func:`agent_topic` / :func:`federation_topic` / :func:`release_part_topic`; raises TopicError."""
    parts = topic.split("/")
    if len(parts) < 4 or parts[0] != ROOT or parts[1] != VERSION_SEGMENT:
        raise TopicError(f"not an edgepfl/{VERSION_SEGMENT} topic: {topic!r}")
    federation = check_segment(parts[2], "federation")
    try:
        if len(parts) == 6 and parts[3] == "agents":
            return ParsedTopic(federation, AgentChannel(parts[5]), check_segment(parts[4], "agent id"))
        if len(parts) == 4:
            return ParsedTopic(federation, FederationChannel(parts[3]))
        if len(parts) == 5 and parts[3] == FederationChannel.RELEASE.value and _PART.match(parts[4]):
            return ParsedTopic(federation, FederationChannel.RELEASE, part=int(parts[4]))
    except ValueError as exc:
        raise TopicError(f"unknown channel in topic {topic!r}") from exc
    raise TopicError(f"malformed topic {topic!r}")
