"""The coordinator's sense of time: the wall clock, or a simulation's virtual one.

Every deadline of the round loop (round timeouts, waiting for agents, an agent's last
sign of life) is read from its fleet's :class:`Clock`. Over MQTT that is
``time.monotonic``; in-process it is a :class:`VirtualClock` that only the fleet moves,
to the virtual time of the next thing that happens, so a simulated run never depends on
how fast the host computes.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale; only differences mean anything."""

    #: True: simulated time, which passes only as the fleet's simulated devices work
    virtual: bool

    def now(self) -> float: ...


class WallClock:
    """``time.monotonic()``: a real fleet's time."""

    virtual = False

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Time that passes only when :meth:`advance_to` says so (never backwards)."""

    virtual = True

    def __init__(self, start: float = 0.0):
        self._now = start

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        self._now = max(self._now, t)
