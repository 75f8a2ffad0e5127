"""The transport's inbound queue, bounded in bytes and messages.

paho hands every received MQTT message to a callback on its network thread, and for a
QoS 1 message it sends the PUBACK only when that callback returns. :class:`BoundedInbox`
makes the callback wait while the queue is full: the PUBACKs are held back, the broker's
in-flight window for this client (Mosquitto's ``max_inflight_messages``) fills, and the
broker keeps the rest in its queue for the client (``max_queued_messages`` /
``max_queued_bytes``) instead of pushing it into this process's memory. That is the
backpressure MQTT offers a subscriber; it does not reach the publishers, whose messages
the broker still accepts.

The network thread also sends the keepalive PINGREQs and this process's own publishes,
so it is never blocked for long: after ``max_wait_s`` (below the keepalive) a message is
queued over the bound, counted in :attr:`BoundedInbox.overruns` and logged. Nothing is
dropped here; a consumer that has stalled for that long costs one message over the bound
per wait instead of the connection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class BoundedInbox(Generic[T]):
    """A FIFO of items with a byte size: :meth:`put` waits (up to ``max_wait_s``) while the
    queue holds ``max_bytes`` or ``max_messages``; :meth:`get` waits for an item.

    An item larger than ``max_bytes`` is taken when the queue is empty, so one message
    of any size the broker allows always gets through.
    """

    def __init__(self, max_bytes: int, max_messages: int, max_wait_s: float):
        if max_bytes <= 0 or max_messages <= 0 or max_wait_s <= 0:
            raise ValueError("max_bytes, max_messages and max_wait_s must be positive")
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.max_wait_s = max_wait_s
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0
        self._cond = threading.Condition()
        #: the most bytes queued at once
        self.peak_bytes = 0
        #: messages queued over the bound because the consumer did not make room in time
        self.overruns = 0
        #: seconds the producer (paho's network thread) spent waiting for room
        self.waited_s = 0.0

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def _full(self, size: int) -> bool:
        if not self._items:
            return False
        return self._bytes + size > self.max_bytes or len(self._items) >= self.max_messages

    def put(self, item: T, size: int) -> bool:
        """Queue ``item``; returns False when it went in over the bound after waiting ``max_wait_s``."""
        with self._cond:
            within = True
            if self._full(size):
                started = time.monotonic()
                deadline = started + self.max_wait_s
                while self._full(size):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        within = False
                        self.overruns += 1
                        break
                    self._cond.wait(left)
                self.waited_s += time.monotonic() - started
            self._items.append((item, size))
            self._bytes += size
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self._cond.notify_all()
        if not within:
            log.warning("inbound queue full for %.1fs (%d messages, %d bytes, bound %d bytes): the consumer is "
                        "stalled; queued over the bound so that the connection's keepalive survives",
                        self.max_wait_s, len(self._items), self._bytes, self.max_bytes)
        return within

    def get(self, timeout: float | None = None) -> T | None:
        """The oldest item, or None when none came within ``timeout`` seconds (None: wait forever)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._items), timeout):
                return None
            item, size = self._items.popleft()
            self._bytes -= size
            self._cond.notify_all()
            return item
