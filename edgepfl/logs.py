"""Logging for the ``edgepfl`` command: levels and formats that act on the ``edgepfl`` logger tree only.

Every module logs under ``edgepfl.`` (``edgepfl.coordinator``, ``edgepfl.agent``, ...), so
``--log-level debug`` shows our debug lines without turning on matplotlib's, paho's or
torch's: the root logger keeps Python's default (warnings and errors of other libraries
still reach stderr through it).

``--log-format json`` writes one JSON object per line — ``time`` (ISO 8601, UTC),
``level``, ``logger``, ``message``, the process's context (:func:`set_log_context`: the
federation, the agent id and tier, the round in progress, ...) and any extras a call passed
(``log.info(..., extra={"release": rid})``, which win over the context) — for journald or a
log shipper: every line of an agent says which agent and federation it is about, every
line of a coordinator which round, without each call having to say so.
Nothing else goes to stderr as text then: Python warnings (a solver's ConvergenceWarning,
say) and other libraries' warnings and errors become JSON lines too (loggers ``py.warnings``
and theirs), so a journal read as JSON has no line that does not parse.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TextIO

#: the levels ``--log-level`` accepts
LEVELS = ("debug", "info", "warning", "error")
#: the formats ``--log-format`` accepts
FORMATS = ("text", "json")
ROOT = "edgepfl"

# attributes every LogRecord has; anything else on a record came in through ``extra=``
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


#: fields every JSON line of this process carries (set_log_context); a record's own extras win
_CONTEXT: dict[str, str | int | float | bool | None] = {}


def set_log_context(**fields: str | int | float | bool | None) -> None:
    """Add ``fields`` to every JSON log line of this process from now on (None removes one):
    a service sets who it is once (``federation``, ``agent``, ``tier``), a round loop its
    ``round`` and ``phase`` as they change."""
    for key, value in fields.items():
        if value is None:
            _CONTEXT.pop(key, None)
        else:
            _CONTEXT[key] = value


def log_context() -> dict[str, str | int | float | bool | None]:
    """The fields :func:`set_log_context` set (a copy)."""
    return dict(_CONTEXT)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, extras (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_CONTEXT,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _text_formatter() -> logging.Formatter:
    return logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", datefmt="%H:%M:%S")


def setup_logging(level: str = "warning", fmt: str = "text", stream: TextIO | None = None) -> logging.Logger:
    """Send the ``edgepfl`` logger tree to ``stream`` (stderr) at ``level`` in ``fmt``; idempotent.

    Raises ValueError for a level or format outside :data:`LEVELS` / :data:`FORMATS`.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose from {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose from {', '.join(FORMATS)}")
    logger = logging.getLogger(ROOT)
    others = logging.getLogger()  # other libraries' records, and Python warnings through py.warnings
    for owner in (logger, others):
        for handler in [h for h in owner.handlers if getattr(h, "_edgepfl", False)]:
            owner.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._edgepfl = True  # type: ignore[attr-defined]  # marks the handler this function owns
    handler.setFormatter(JsonFormatter() if fmt == "json" else _text_formatter())
    logger.addHandler(handler)
    if fmt == "json":
        # otherwise printed as text: warnings.warn's two lines, logging's last-resort handler
        outside = logging.StreamHandler(stream or sys.stderr)
        outside._edgepfl = True  # type: ignore[attr-defined]
        outside.setLevel(logging.WARNING)
        outside.setFormatter(JsonFormatter())
        others.addHandler(outside)
    logging.captureWarnings(fmt == "json")
    logger.setLevel(level.upper())
    # our records are handled here; passing them on to the root would print them twice
    # wherever an application (or pytest) also configured the root logger
    logger.propagate = False
    return logger


#: a limited key's lines per window, and the window (seconds): LogLimiter's defaults
LINES_PER_WINDOW = 10
WINDOW_S = 60.0


class LogLimiter:
    """Per-message warnings that a flood cannot turn into a flood of lines: at most
    ``per_window`` lines per key (a rejection reason, a topic's kind) every ``window_s``
    seconds, then one line saying the rest are counted, not logged, and when the window
    ends one line with how many were left out. Whatever is limited is still counted by
    its caller; only the log is spared."""

    def __init__(self, logger: logging.Logger, per_window: int = LINES_PER_WINDOW, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.logger, self.per_window, self.window_s, self.clock = logger, per_window, window_s, clock
        self._windows: dict[str, tuple[float, int]] = {}  # key -> (window start, lines asked for in it)

    def warning(self, key: str, message: str, *args: object) -> None:
        """Log ``message % args`` at WARNING unless ``key`` has had its lines this window."""
        now = self.clock()
        start, seen = self._windows.get(key, (float("-inf"), 0))
        if now - start >= self.window_s:
            if seen > self.per_window:
                self.logger.warning("%d more %s warnings were not logged", seen - self.per_window, key)
            start, seen = now, 0
        self._windows[key] = (start, seen + 1)
        if seen < self.per_window:
            self.logger.warning(message, *args)
        elif seen == self.per_window:
            self.logger.warning("more %s warnings this minute are counted, not logged", key)
