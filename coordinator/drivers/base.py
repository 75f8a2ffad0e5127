"""What a round driver is, and the narrow view of the coordinator it drives rounds through.

A :class:`RoundDriver` runs a run's training rounds one call at a time; it sees the
coordinator only as a :class:`RoundContext`: who may be sampled, opening a round, sending
a task, collecting answers, closing a round into a metrics row, waiting on the inbox, and
the two inbox hooks a driver may register once, when it is built. Everything else (the
state, the checkpoint, the privacy ledger's accounting, releases) stays the coordinator's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from edgepfl.config import RunConfig
from edgepfl.methods import ServerState
from edgepfl.metrics import RoundMetrics
from edgepfl.protocol.secagg import SecAggTask
from edgepfl.protocol.signing import Signer

from ..clock import Clock
from ..fleet import Fleet
from ..gate import Refused, StepAnswer
from ..observe import Observer
from ..registry import Registry
from ..result import RoundResult
from ..round_tasks import RoundTasks


class RoundContext(Protocol):
    """The coordinator as a round driver sees it (:class:`~..rounds.Coordinator` is one)."""

    config: RunConfig
    clock: Clock
    registry: Registry
    observer: Observer
    fleet: Fleet
    #: signs what the coordinator sends (None: unsigned deployment)
    signer: Signer | None
    #: whether only enrolled agents' signed frames get in (a keyring is set)
    enrols: bool

    def sample(self, r: int, final: bool) -> tuple[list[str], list[str]]:
        """Who trains round ``r`` and who only evaluates."""
        ...

    def open_round(self, r: int, sampled: list[str], late: bool,
                   final: bool = False) -> tuple[RoundTasks, RoundResult, ServerState]:
        """Open round ``r`` for answers (its aggregate when ``sampled`` train; with ``late``,
        closed rounds' late updates too), its tasks built from the current state; ``final``:
        the run's final evaluation (no training round, nothing spent)."""
        ...

    def send_task(self, tasks: RoundTasks, result: RoundResult, agent_id: str, kind: str,
                  secagg: SecAggTask | None = None) -> None:
        """Send ``agent_id`` a ``kind`` task of the open round."""
        ...

    def collect(self, tasks: RoundTasks, result: RoundResult, started: float) -> None:
        """Admit answers until the round may close (every answer in, or quorum and timeout)."""
        ...

    def close_round(self, tasks: RoundTasks, result: RoundResult, started: float, final: bool,
                    quorum: int) -> RoundMetrics:
        """Adopt the round's aggregate if it passes; the metrics row, then the checkpoint."""
        ...

    def pump_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Route the fleet's traffic until ``done()`` or ``deadline`` (the clock's time)."""
        ...

    def late_rounds(self) -> set[int]:
        """The closed rounds whose late updates the open round takes."""
        ...

    def device_noise(self, sampled: int) -> tuple[float | None, float | None]:
        """Distributed DP: the clip and noise each of ``sampled`` devices applies."""
        ...

    def route_steps(self, handler: Callable[[StepAnswer, int], None],
                    refusals: Callable[[Refused], None] | None = None) -> None:
        """Hand every admitted secure-round step (and its wire bytes) to ``handler``, and
        every refusal of a round's task to ``refusals``."""
        ...

    def resend_lost_tasks(self) -> None:
        """Send a task of the open round again when its agent's connection lost it."""
        ...


class RoundDriver(Protocol):
    """Runs one training round per :meth:`run_round` call (the final evaluation is always a
    synchronous round)."""

    #: whether the loop gives agents that dropped out up to a round timeout to come back
    #: before each round (synchronous modes); a buffered run hands out tasks as devices free up
    waits_between_rounds: bool

    def run_round(self, r: int) -> RoundMetrics:
        """Train round (or buffered state) ``r``; its metrics row."""
        ...
