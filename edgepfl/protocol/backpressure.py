"""The transport's inbound queue: bounded by the acknowledgements it grants.

paho hands every received MQTT message to a callback on its network thread. The
transport runs paho with ``manual_ack``: the callback only queues the message here, and
the message's PUBACK is the queue's to send. :class:`BoundedInbox` acknowledges a
message at once while the acknowledged messages waiting for the consumer fit the bound
(bytes and messages); past it, it holds the acknowledgements back, in arrival order, and
sends them as the consumer takes messages. The broker's in-flight window for this client
(Mosquitto's ``max_inflight_messages``, MQTT 5's Receive Maximum) then fills, and the
broker keeps the rest in its queue for the client (``max_queued_messages`` /
``max_queued_bytes``) instead of pushing it into this process's memory. That is the
backpressure MQTT offers a subscriber; it does not reach the publishers, whose messages
the broker still accepts.

Why not make the callback wait for room: the network thread must keep reading. A
PINGRESP arrives behind the messages the broker has already sent, and paho closes the
connection when it has not read one within the keepalive of its PINGREQ; a thread that
waits in the callback reads a message per wait, so a stalled consumer with a backlog in
the socket lost the connection (and, with a clean session, the broker's queue for it).
Here the thread does not wait: a stall of any length costs the broker's in-flight window
over the bound, never the connection.

Brokers do not all keep to their window: Mosquitto 2.0.11, with its default window of 20,
was measured with 20-39 unacknowledged messages at a stalled client in most runs and 70-95
in some (``tests/integration/broker/test_backpressure_flood.py``'s floods). So the held acknowledgements have a
bound of their own, ``max_held`` (``broker.inbox_max_held_acks``, default 100), well above
the common windows (Mosquitto 20, EMQX 32): past it the thread waits for the consumer after
all, at most ``max_wait_s`` (below the keepalive), then queues the message over the bound
with its acknowledgement held too (PUBACKs go in arrival order), counted in
:attr:`BoundedInbox.overruns` and logged. Past a window the consumer is taking messages,
so that wait is short.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

Acknowledge = Callable[[], None]

#: a consumer that keeps falling behind is logged once per this many seconds
WARN_EVERY_S = 60.0


class BoundedInbox(Generic[T]):
    """A FIFO of received items that grants their acknowledgements as the consumer makes room.

    :meth:`put` does not block (but see ``max_held``). It calls the item's ``ack`` at once when no earlier item
    waits for its acknowledgement and the acknowledged items queued, with this one, fit
    ``max_bytes`` and ``max_messages``; otherwise the acknowledgement is held, and
    :meth:`get` sends held ones, oldest first, as it frees room. An item larger than
    ``max_bytes`` is acknowledged when no acknowledged item is queued, so one message of
    any size the broker allows always gets through. Acknowledgements are sent in arrival
    order (MQTT 3.1.1 §4.6), under the queue's lock.

    A broker that sends past its in-flight window meets ``max_held``: with that many
    acknowledgements held, :meth:`put` waits for the consumer up to ``max_wait_s``.
    """

    def __init__(self, max_bytes: int, max_messages: int, max_held: int = 100, max_wait_s: float = 10.0):
        if max_bytes <= 0 or max_messages <= 0 or max_held <= 0 or max_wait_s <= 0:
            raise ValueError("max_bytes, max_messages, max_held and max_wait_s must be positive")
        self.max_bytes = max_bytes
        self.max_messages = max_messages
        self.max_held = max_held
        self.max_wait_s = max_wait_s
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0
        # acknowledged and not yet taken: what the bound counts
        self._admitted_bytes = 0
        self._admitted = 0
        # (size, ack) of the newest queued items whose acknowledgement is held, oldest first
        self._held: deque[tuple[int, Acknowledge]] = deque()
        self._cond = threading.Condition()
        #: the most bytes queued at once (acknowledged and held)
        self.peak_bytes = 0
        #: the most items queued at once with their acknowledgement held
        self.peak_held = 0
        #: items whose acknowledgement was held because the queue was full
        self.held_back = 0
        #: items queued past ``max_held`` because the consumer took none within ``max_wait_s``
        self.overruns = 0
        self._warned_at = -WARN_EVERY_S

    @property
    def queued_bytes(self) -> int:
        """Bytes queued for the consumer, acknowledged or held."""
        return self._bytes

    @property
    def admitted_bytes(self) -> int:
        """Bytes acknowledged and not yet taken by the consumer: at most ``max_bytes`` (or one item)."""
        return self._admitted_bytes

    @property
    def held(self) -> int:
        """Items queued whose acknowledgement is held back."""
        return len(self._held)

    def __len__(self) -> int:
        return len(self._items)

    def _fits(self, size: int) -> bool:
        if self._admitted == 0:
            return True
        return self._admitted_bytes + size <= self.max_bytes and self._admitted < self.max_messages

    def _admit(self, size: int, ack: Acknowledge) -> None:
        self._admitted_bytes += size
        self._admitted += 1
        ack()

    def put(self, item: T, size: int, ack: Acknowledge) -> bool:
        """Queue ``item`` of ``size`` bytes; True when ``ack`` was called at once, False when it is held."""
        with self._cond:
            if len(self._held) >= self.max_held:
                self._wait_below_max_held()
            self._items.append((item, size))
            self._bytes += size
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            admitted = not self._held and self._fits(size)
            if admitted:
                self._admit(size, ack)
            else:
                if not self._held and time.monotonic() - self._warned_at >= WARN_EVERY_S:
                    self._warned_at = time.monotonic()
                    log.warning("inbound queue full (%d messages, %d bytes, bound %d bytes): the consumer is behind; "
                                "holding acknowledgements back so that the broker keeps the backlog",
                                self._admitted, self._admitted_bytes, self.max_bytes)
                self._held.append((size, ack))
                self.held_back += 1
                self.peak_held = max(self.peak_held, len(self._held))
            self._cond.notify_all()
        return admitted

    def _wait_below_max_held(self) -> None:
        if not self._cond.wait_for(lambda: len(self._held) < self.max_held, self.max_wait_s):
            self.overruns += 1
            log.warning("%d acknowledgements held and the consumer took no message for %.1fs: queued over the bound "
                        "so that the connection's keepalive survives (%d messages, %d bytes queued)",
                        len(self._held), self.max_wait_s, len(self._items), self._bytes)

    def get(self, timeout: float | None = None) -> T | None:
        """The oldest item, or None when none came within ``timeout`` seconds (None: wait forever)."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._items), timeout):
                return None
            item, size = self._items.popleft()
            self._bytes -= size
            # the front item is always acknowledged: held ones are the newest, and the
            # oldest held one is admitted as soon as nothing acknowledged is queued
            self._admitted_bytes -= size
            self._admitted -= 1
            while self._held and self._fits(self._held[0][0]):
                self._admit(*self._held.popleft())
            self._cond.notify_all()
            return item
