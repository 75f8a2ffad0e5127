"""Round drivers: how a run's training rounds are run, one module each.

:data:`edgepfl.config.ROUND_DRIVERS` names the driver of each (asynchrony mode, secure
aggregation) pair a config may ask for; the config refuses the other pairs from that same
table, and :data:`DRIVERS` here holds the class behind each name. A new round mode is a
module here whose class follows :class:`~.base.RoundDriver` over a
:class:`~.base.RoundContext`, plus its row in each table (``tests/unit/coordinator/test_drivers.py``
checks that they agree).
"""

from __future__ import annotations

from collections.abc import Callable

from edgepfl.config import RunConfig, round_driver

from .base import RoundContext, RoundDriver
from .buffered import BufferedRounds
from .secure import SecureRounds
from .sync import SyncRounds

#: driver name (:data:`edgepfl.config.ROUND_DRIVERS`) -> the driver built over a coordinator
DRIVERS: dict[str, Callable[[RoundContext], RoundDriver]] = {
    "sync": SyncRounds,
    "buffered": BufferedRounds,
    "secure": SecureRounds,
}


def driver_for(config: RunConfig, context: RoundContext) -> RoundDriver:
    """The driver of ``config``'s training rounds, built over ``context``."""
    return DRIVERS[round_driver(config)](context)


__all__ = ["DRIVERS", "BufferedRounds", "RoundContext", "RoundDriver", "SecureRounds", "SyncRounds", "driver_for"]
