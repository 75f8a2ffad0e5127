"""Warnings that the coordinator's view of the fleet may be cut short by the broker.

A (re)starting coordinator learns who is online from the retained statuses the broker
replays when it subscribes. Mosquitto queues at most ``max_queued_messages`` (default
1,000) plus ``max_inflight_messages`` (20) for one client and silently drops the rest,
so a coordinator facing 2,000 connected agents sees 1,020 of them and nothing says why.
:class:`PresenceWatch` notices it two ways: fewer trainers online (that may run the run's
tasks: :meth:`~.registry.Registry.eligible`) than the run's ``expected_agents``, and a
replay burst that stopped at such a cap's count
(``k x 100 + 20``). Each is one log line naming the broker setting to raise.
"""

from __future__ import annotations

import logging

from .registry import Registry

log = logging.getLogger("edgepfl.coordinator")

# The replay of retained statuses is over once none arrived for this long.
BURST_QUIET_S = 1.0
# Mosquitto's default max_inflight_messages: a truncated replay is the queue's cap plus these.
BROKER_INFLIGHT = 20
HINT = ("raise the broker's per-client queue (Mosquitto: max_queued_messages, default 1000, 0 for no limit; "
        "and max_queued_bytes) above the fleet size")


def looks_capped(count: int) -> bool:
    """A replay of ``count`` messages that matches a round queue cap plus the in-flight window."""
    return count > BROKER_INFLIGHT + 99 and (count - BROKER_INFLIGHT) % 100 == 0


class PresenceWatch:
    """Counts the statuses of the coordinator's first burst and compares presence with ``expected``.

    :meth:`status_arrived` is told of every status frame, :meth:`tick` is called by every
    wait (it ends the burst after :data:`BURST_QUIET_S` of quiet), :meth:`round_starts`
    before every round's tasks go out. All are O(1).
    """

    def __init__(self, registry: Registry, expected: int | None):
        self.registry = registry
        self.expected = expected
        self.burst = 0
        self.burst_over = False
        self._last_status = 0.0
        self._warned_online: int | None = None

    def status_arrived(self, now: float) -> None:
        if not self.burst_over:
            self.burst += 1
            self._last_status = now

    def tick(self, now: float) -> None:
        if self.burst_over or not self.burst or now - self._last_status < BURST_QUIET_S:
            return
        self.burst_over = True
        online = self.registry.count_eligible()
        if self.expected is not None and online < self.expected:
            self._warned_online = online
            log.warning("presence may be truncated: the broker replayed %d agent statuses, %d trainers online of "
                        "expected_agents=%d; %s", self.burst, online, self.expected, HINT)
        elif looks_capped(self.burst):
            log.warning("presence may be truncated: the broker's replay of retained statuses stopped at %d, a "
                        "queue cap plus its in-flight window; %s", self.burst, HINT)

    def round_starts(self, round: int) -> None:
        online = self.registry.count_eligible()
        if self.expected is None or online >= self.expected or online == self._warned_online:
            return
        self._warned_online = online  # one line per shortfall, not one per round
        log.warning("round %d starts with %d of expected_agents=%d trainers online; if they are connected, the "
                    "broker may have dropped their statuses: %s", round, online, self.expected, HINT)
