"""Negative acknowledgements: the coordinator tells an agent that, and why, a frame of its was rejected.

Since protocol 1.2 (docs/PROTOCOL.md §7, "NACKs"). A rejection is answered with a ``nack``
on the agent's task topic only when the frame is provably the agent's own (the gate's
:class:`~.gate.Attribution`), the agent's last accepted status announced 1.2 or later
(``unsupported_version`` is told whatever the agent announced: its status is the frame
refused), and the reason is not ``duplicate`` (the first copy was answered already).

What a device can make the coordinator publish is bounded: at most one NACK per
received frame, at most :data:`AGENT_BURST` in a burst and :data:`AGENT_RATE_PER_S` a
second per agent, and :data:`FLEET_BURST` / :data:`FLEET_RATE_PER_S` over all agents
together (statuses of an unsupported version come from agents nobody registered).
A rejection past the bound is still counted and logged; only the NACK is left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from edgepfl.protocol import MessageType, NackMeta, encode, supports
from edgepfl.protocol.signing import Signer

from .fleet import SENDER, Fleet
from .gate import Rejection
from .registry import Registry

log = logging.getLogger("edgepfl.coordinator")

AGENT_BURST, AGENT_RATE_PER_S = 10, 2.0
FLEET_BURST, FLEET_RATE_PER_S = 200, 50.0
# Buckets kept for agents at most; past it, the full ones (idle agents) are forgotten.
MAX_BUCKETS = 10_000
NACK_FEATURE = (1, 2)


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` a second; :meth:`take` spends one if there is one."""

    burst: float
    rate: float
    tokens: float
    stamp: float

    def refill(self, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens

    def take(self, now: float) -> bool:
        if self.refill(now) < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Nacker:
    """Sends the NACK a rejection earns, within the rate bounds (see the module doc)."""

    def __init__(self, federation: str, fleet: Fleet, registry: Registry, signer: Signer | None = None, *,
                 burst: int = AGENT_BURST, rate_per_s: float = AGENT_RATE_PER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.federation = federation
        self.fleet = fleet
        self.registry = registry
        self.signer = signer
        self.burst, self.rate = burst, rate_per_s
        self.clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._fleet_bucket = TokenBucket(FLEET_BURST, FLEET_RATE_PER_S, FLEET_BURST, clock())
        #: NACKs sent, and NACKs earned but left out by the rate bounds
        self.sent = 0
        self.suppressed = 0

    def rejected(self, rejection: Rejection) -> bool:
        """Send the NACK ``rejection`` earns, if any; returns whether one was sent."""
        a, agent_id = rejection.attributed, rejection.agent_id
        if a is None or agent_id is None or rejection.reason == "duplicate":
            return False
        if rejection.reason != "unsupported_version" and not supports(self.registry.version(agent_id), NACK_FEATURE):
            return False  # a 1.1 agent does not know the message: it is not told
        if not self._allowed(agent_id):
            self.suppressed += 1
            return False
        try:
            meta = NackMeta(message_id=a.message_id, rejected_type=a.type, reason=rejection.reason,
                            detail=rejection.detail[:300], task_id=a.task_id)
        except ValidationError:  # a reason that is not a tag (not one of ours): nothing to tell
            log.debug("no NACK for %s's %s: reason %r", agent_id, a.type, rejection.reason)
            return False
        frame = encode(MessageType.NACK, federation=self.federation, sender=SENDER, round=max(a.round, -1), meta=meta,
                       signer=self.signer, recipient=agent_id if self.signer is not None else None)
        self.fleet.tell(agent_id, frame)
        self.sent += 1
        return True

    def _allowed(self, agent_id: str) -> bool:
        now = self.clock()
        bucket = self._buckets.get(agent_id)
        if bucket is not None and bucket.refill(now) < 1.0:
            return False
        if not self._fleet_bucket.take(now):
            return False
        if bucket is None:  # made only with a fleet token: at most FLEET_RATE_PER_S new buckets a second
            if len(self._buckets) >= MAX_BUCKETS:
                self._buckets = {k: b for k, b in self._buckets.items() if b.refill(now) < b.burst}
            bucket = self._buckets[agent_id] = TokenBucket(self.burst, self.rate, self.burst, now)
        return bucket.take(now)
