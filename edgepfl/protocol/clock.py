"""The time a process stamps its frames with and times its work by.

Real processes read the host's clocks. An in-process simulation (``edgepfl simulate
--in-process``) runs every agent and the coordinator in one process on a virtual
clock, and swaps both sources for it (:func:`simulated_time`) for the length of the
run: a frame's ``created`` and an agent's ``train_seconds`` then depend on the
simulation alone, so the same seed gives the same frames, byte for byte, on any host at
any load. Nothing else may swap them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Unix time at virtual time 0 of a simulation: 2026-01-01T00:00:00Z
SIMULATION_EPOCH = 1_767_225_600.0

_wall: Callable[[], float] = time.time
_stopwatch: Callable[[], float] = time.perf_counter


def wall_time() -> float:
    """Unix time now: what a frame's ``created`` says and a deadline is checked against."""
    return _wall()


def stopwatch() -> float:
    """A monotonic reading for timing work (differences only)."""
    return _stopwatch()


@contextmanager
def simulated_time(virtual_now: Callable[[], float]) -> Iterator[None]:
    """Within the block, both clocks read the simulation's ``virtual_now`` (seconds from
    its start; wall time is :data:`SIMULATION_EPOCH` plus that)."""
    global _wall, _stopwatch
    saved = _wall, _stopwatch
    _wall, _stopwatch = (lambda: SIMULATION_EPOCH + virtual_now()), virtual_now
    try:
        yield
    finally:
        _wall, _stopwatch = saved
