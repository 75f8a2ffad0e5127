"""Round drivers: how a run's training rounds are run, one module each.

:data:`edgepfl.config.ROUND_DRIVERS` names, by import path, the driver of each
(asynchrony mode, secure aggregation) pair a config may ask for; the config refuses the
other pairs from that same table. A new round mode is a module whose class follows
:class:`~.base.RoundDriver` over a :class:`~.base.RoundContext`, plus its row in that table
(``tests/unit/coordinator/test_drivers.py`` runs a whole federation on a driver defined in
the test itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from edgepfl.config import ROUND_DRIVERS, ConfigError, RunConfig, round_driver

from .base import RoundContext, RoundDriver
from .buffered import BufferedRounds
from .secure import SecureRounds
from .sync import SyncRounds


def load_driver(path: str) -> Callable[[RoundContext], RoundDriver]:
    """The driver class at ``path`` (``module:Class``); ConfigError naming it when it cannot be loaded."""
    module, _, name = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"round driver {path}: {exc}") from None
    if not callable(getattr(found, "run_round", None)):
        raise ConfigError(f"round driver {path} has no run_round(r): it is not a RoundDriver")
    return found


def driver_for(config: RunConfig, context: RoundContext) -> RoundDriver:
    """The driver of ``config``'s training rounds, built over ``context``."""
    return load_driver(round_driver(config))(context)


__all__ = ["ROUND_DRIVERS", "BufferedRounds", "RoundContext", "RoundDriver", "SecureRounds", "SyncRounds",
           "driver_for", "load_driver"]
