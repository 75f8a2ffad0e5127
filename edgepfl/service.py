"""systemd service notifications (sd_notify), and a stop that interrupts a long step.

A service started by systemd with ``Type=notify`` gets ``NOTIFY_SOCKET``; with
``WatchdogSec=`` also ``WATCHDOG_USEC``. :func:`notifier` returns one process-wide
:class:`ServiceNotifier` that sends each state as one datagram to that socket (the whole
of sd_notify(3)'s protocol: a path, or an abstract name written with a leading ``@``),
and does nothing when the process was not started that way (no ``NOTIFY_SOCKET``) — so
the agent and the coordinator call it unconditionally. No package for it: the one there
was ships no wheel, which kept the head tier's closure from installing binary-only.

**Stopping a long step.** A service loop looks at its stop flag between messages; a
message whose handling takes minutes on a slow board (a release install, a training
round) would make SIGTERM wait for it, and systemd SIGKILL it after ``TimeoutStopSec=``.
So the signal handler calls :func:`request_stop`, which raises :class:`Stopped` in the
main thread when it is inside :func:`interruptible` (at the next Python instruction: after
the current onnxruntime batch or solver iteration), so that ``finally`` blocks still say
goodbye on the broker. Files are written atomically, so an exception anywhere leaves each
file old or new; a few writes that must happen together (a release's switch) go in
:func:`uninterruptible`, and a stop that arrives during them takes effect at their end.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("edgepfl.service")

#: the share of the time a computation must spend on the CPU to count as advancing
#: (:meth:`ServiceNotifier.fed_while_computing`); a step waiting on a lock or I/O spends none,
#: while a fit on a board loaded by other work may get only a few percent of a core
MIN_CPU_SHARE = 0.01


class ServiceNotifier:
    """Sends ``READY=1``, ``WATCHDOG=1``, ``STATUS=…`` and ``STOPPING=1`` to systemd, if it listens."""

    def __init__(self) -> None:
        env = os.environ
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
        # a socket per datagram and no lock: a stop raised in the main thread (request_stop)
        # can leave no lock held that the goodbye (STOPPING=1) or the watchdog thread then waits on
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
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

    @contextmanager
    def fed_while_computing(self) -> Iterator[None]:
        """Around one long computation with no progress points of its own (a head fit: one
        library call; a local training round): a helper thread pings the watchdog while the
        calling thread's own CPU clock advances — it computes — and not while it does not
        (blocked, deadlocked), so that systemd still restarts a step that hangs. The residual
        blind spot is a step that computes forever."""
        if self.watchdog_interval_s is None or self._address is None:
            yield
            return
        interval = self.watchdog_interval_s
        clock = time.pthread_getcpuclockid(threading.get_ident())
        done = threading.Event()

        def feed() -> None:
            last = time.clock_gettime(clock)
            while not done.wait(interval):
                now = time.clock_gettime(clock)
                if now - last >= MIN_CPU_SHARE * interval:
                    self._last_ping = time.monotonic()
                    self._send("WATCHDOG=1")
                last = now

        helper = threading.Thread(target=feed, name="edgepfl-watchdog-feed", daemon=True)
        helper.start()
        try:
            yield
        finally:
            done.set()
            helper.join()


_notifier: ServiceNotifier | None = None


def notifier() -> ServiceNotifier:
    """This process's notifier (made on first use from the environment)."""
    global _notifier
    if _notifier is None:
        _notifier = ServiceNotifier()
    return _notifier


class Stopped(BaseException):
    """A stop request (SIGTERM) that ended a long step (:func:`interruptible`).

    A BaseException, like KeyboardInterrupt: the ``except Exception`` that turns a failed
    install or task into a logged refusal must not swallow it."""


# Depths of the sections the main thread is in, a stop that waits for the end of an
# uninterruptible one, and whether a stop was raised in the current interruptible section.
# Main thread only: signal handlers run there.
_interruptible = 0
_uninterruptible = 0
_pending = False
_raised = False


@contextmanager
def interruptible() -> Iterator[None]:
    """A long step that :func:`request_stop` ends at once, raising :class:`Stopped` inside it.

    The stop may surface as another exception: a handler runs wherever the step is, and C
    code that calls back into Python (pydantic's validators calling ``re``) reports an
    exception raised inside as its own error, a ValidationError of a frame that was fine.
    Any exception leaving a section in which a stop was raised is therefore the stop."""
    global _interruptible, _pending, _raised
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _interruptible == 0:
        _raised = False
    _interruptible += 1
    try:
        yield
    except Stopped:
        raise
    except BaseException as exc:
        if _raised:
            raise Stopped() from exc
        raise
    finally:
        _interruptible -= 1
        if _interruptible == 0:
            _pending = False  # a stop deferred to the end of a section is seen by the caller's flag


@contextmanager
def uninterruptible() -> Iterator[None]:
    """Writes that must all happen or none (in the main thread): a stop request that
    arrives meanwhile raises :class:`Stopped` once they are done."""
    global _uninterruptible, _pending, _raised
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _uninterruptible += 1
    try:
        yield
    finally:
        _uninterruptible -= 1
    if _uninterruptible == 0 and _pending and _interruptible:
        _pending, _raised = False, True
        raise Stopped()


def request_stop() -> None:
    """Call from a signal handler, after setting the loop's stop flag: inside
    :func:`interruptible`, raises :class:`Stopped` now (or at the end of an
    :func:`uninterruptible` section); elsewhere returns, and the loop sees its flag."""
    global _pending, _raised
    if not _interruptible or threading.current_thread() is not threading.main_thread():
        return
    if _uninterruptible:
        _pending = True
        return
    _raised = True
    raise Stopped()
