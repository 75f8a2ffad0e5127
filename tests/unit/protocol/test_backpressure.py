"""The transport's bounded inbox: unit behaviour (a flood through a real Mosquitto:
tests/integration/broker/test_backpressure_flood.py).
"""

from __future__ import annotations

import threading
import time

from edgepfl.protocol.backpressure import BoundedInbox
from edgepfl.protocol.transport import default_inbox_bytes

# ------------------------------------------------------------------ unit


class Acks:
    """The acknowledgements an inbox sent, in order."""

    def __init__(self):
        self.sent: list[int] = []

    def of(self, n: int):
        return lambda: self.sent.append(n)


def test_within_the_bound_every_message_is_acknowledged_on_arrival_and_put_never_waits():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10)
    acks = Acks()
    started = time.monotonic()
    assert inbox.put(1, 60, acks.of(1)) and inbox.put(2, 40, acks.of(2))
    assert inbox.put(3, 10, acks.of(3)) is False  # 110 > 100: held, and put returned at once
    assert time.monotonic() - started < 0.5
    assert acks.sent == [1, 2] and inbox.held == 1 and inbox.admitted_bytes == 100 and inbox.queued_bytes == 110


def test_held_acknowledgements_go_out_in_arrival_order_as_the_consumer_makes_room():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10)
    acks = Acks()
    for n in range(8):
        inbox.put(n, 40, acks.of(n))
    assert acks.sent == [0, 1] and inbox.held == 6 and inbox.held_back == 6
    assert inbox.get(0) == 0
    assert acks.sent == [0, 1, 2]  # 40 bytes freed: room for one more
    taken = [inbox.get(0) for _ in range(7)]
    assert taken == list(range(1, 8)) and acks.sent == list(range(8))
    assert inbox.held == 0 and inbox.queued_bytes == 0 and inbox.admitted_bytes == 0
    assert inbox.peak_bytes == 320 and inbox.peak_held == 6


def test_a_later_small_message_does_not_overtake_a_held_large_one():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10)
    acks = Acks()
    inbox.put(1, 90, acks.of(1))
    assert inbox.put(2, 50, acks.of(2)) is False
    assert inbox.put(3, 5, acks.of(3)) is False  # 95 would fit, but 2 is older (MQTT 3.1.1 §4.6)
    assert acks.sent == [1]
    inbox.get(0)
    assert acks.sent == [1, 2, 3]


def test_the_message_count_is_bounded_too_and_one_oversized_message_passes_an_empty_queue():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=1000, max_messages=2)
    acks = Acks()
    assert inbox.put(1, 1, acks.of(1)) and inbox.put(2, 1, acks.of(2))
    assert inbox.put(3, 1, acks.of(3)) is False  # third message: over the count
    assert inbox.put(4, 5000, acks.of(4)) is False
    assert [inbox.get(0), inbox.get(0)] == [1, 2] and acks.sent == [1, 2, 3]  # 4 waits for 3 to be taken
    assert inbox.get(0) == 3 and acks.sent == [1, 2, 3, 4]  # larger than the whole bound, but alone
    assert inbox.get(0) == 4 and inbox.get(0) is None


def test_past_max_held_put_waits_for_the_consumer_then_queues_over_the_bound():
    """A broker that ignores its in-flight window: the thread waits, but never past max_wait_s."""
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=10, max_messages=10, max_held=2, max_wait_s=0.2)
    acks = Acks()
    for n in range(3):  # 0 admitted, 1 and 2 held
        inbox.put(n, 10, acks.of(n))
    started = time.monotonic()
    inbox.put(3, 10, acks.of(3))  # nobody reads: waits, then queues anyway
    assert time.monotonic() - started >= 0.2 and inbox.overruns == 1 and len(inbox) == 4 and inbox.held == 3
    assert [inbox.get(0) for _ in range(4)] == [0, 1, 2, 3] and acks.sent == [0, 1, 2, 3]


def test_at_max_held_the_wait_ends_when_the_consumer_takes_a_message():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=10, max_messages=10, max_held=2, max_wait_s=30)
    acks = Acks()
    for n in range(3):
        inbox.put(n, 10, acks.of(n))
    threading.Timer(0.2, inbox.get, args=(0,)).start()
    started = time.monotonic()
    inbox.put(3, 10, acks.of(3))  # held 1, 2: waits until 0 is taken and 1 acknowledged
    assert time.monotonic() - started < 20 and inbox.overruns == 0
    assert acks.sent == [0, 1] and inbox.held == 2


def test_get_waits_for_a_message_from_another_thread():
    inbox: BoundedInbox[int] = BoundedInbox(max_bytes=100, max_messages=10)
    threading.Timer(0.2, lambda: inbox.put(7, 1, lambda: None)).start()
    assert inbox.get(5) == 7
    assert inbox.get(0.05) is None


def test_the_default_bound_follows_the_payload_limit():
    assert default_inbox_bytes(256 * 2**20, 1_000_000) == 16 * 2**20
    assert default_inbox_bytes(16 * 2**20, 1_000_000) == 4_000_000  # never below four MQTT messages
