"""systemd service notifications (sd_notify): readiness, watchdog, stopping.

A service started by systemd with ``Type=notify`` gets ``NOTIFY_SOCKET``; with
``WatchdogSec=`` also ``WATCHDOG_USEC``. :func:`notifier` returns one process-wide
:class:`ServiceNotifier` that sends each state as one datagram to that socket (the whole
of sd_notify(3)'s protocol: a path, or an abstract name written with a leading ``@``),
and does nothing when the process was not started that way (no ``NOTIFY_SOCKET``) — so
the agent and the coordinator call it unconditionally. No package for it: the one there
was ships no wheel, which kept the head tier's closure from installing binary-only.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

log = logging.getLogger("edgepfl.service")


class ServiceNotifier:
    """Sends ``READY=1``, ``WATCHDOG=1``, ``STATUS=…`` and ``STOPPING=1`` to systemd, if it listens."""

    def __init__(self) -> None:
        env = os.environ
        self._lock = threading.Lock()
        self._last_ping = 0.0
        usec = env.get("WATCHDOG_USEC", "")
        # ping at twice the rate systemd requires, as sd_watchdog_enabled(3) advises
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
        address = env.get("NOTIFY_SOCKET", "")
        #: where the states go (None: no service manager listens)
        self._address: str | None = "\0" + address[1:] if address.startswith("@") else address or None

    @property
    def active(self) -> bool:
        """True when a service manager listens."""
        return self._address is not None

    def _send(self, state: str) -> None:
        if self._address is None:
            return
        with self._lock, socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            try:
                sock.sendto(state.encode(), self._address)
            except OSError as exc:  # the manager went away: the service itself goes on
                log.warning("could not notify the service manager at NOTIFY_SOCKET (%s)", exc)

    def ready(self, status: str | None = None) -> None:
        """The service is up (e.g. its broker connection is)."""
        self._send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def status(self, text: str) -> None:
        """A one-line status ``systemctl status`` shows."""
        self._send(f"STATUS={text}")

    def watchdog(self) -> None:
        """Call from the service loop; pings systemd's watchdog when it is due (cheap otherwise)."""
        if self.watchdog_interval_s is None or self._address is None:
            return
        now = time.monotonic()
        if now - self._last_ping >= self.watchdog_interval_s:
            self._last_ping = now
            self._send("WATCHDOG=1")

    def stopping(self) -> None:
        """The service is shutting down."""
        self._send("STOPPING=1")


_notifier: ServiceNotifier | None = None


def notifier() -> ServiceNotifier:
    """This process's notifier (made on first use from the environment)."""
    global _notifier
    if _notifier is None:
        _notifier = ServiceNotifier()
    return _notifier
