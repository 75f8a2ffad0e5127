"""Reassembly limits: per-source partial and byte bounds, the global byte budget, and
that every eviction, expiry and refusal is reported with its reason (never silent)."""

from __future__ import annotations

import random
import time
import uuid

import numpy as np
import pytest

from edgepfl.protocol import ChunkMeta, ProtocolError, Reassembler, decode, encode, split_frame

FED = "fed1"
SLOW = "edgepfl/v1/fed1/agents/slow/update"
FLOOD = "edgepfl/v1/fed1/agents/noisy/update"


def update_frame(n: int, fill: float = 1.0) -> bytes:
    from edgepfl.protocol import MessageType, UpdateMeta

    meta = UpdateMeta(task_id="a" * 32, kind="train", num_train=10, num_test=5, eval_correct=1)
    return encode(MessageType.UPDATE, federation=FED, sender="slow", round=0, meta=meta,
                  tensors={"w": np.full(n, fill, np.float32)})


def chunks_of(frame: bytes, max_message: int = 20_000) -> list:
    return [decode(c) for c in split_frame(frame, max_message, federation=FED, sender="slow", round=0)]


def flood_chunk(total: int = 50_000_000, size: int = 16):
    """What an attacker can send cheaply: one tiny chunk of a huge message that never completes."""
    meta = ChunkMeta(parent_id=uuid.uuid4().hex, index=0, count=10_000, total_bytes=total, total_sha256="0" * 64)
    return decode(encode("chunk", federation=FED, sender="noisy", round=0, meta=meta,
                         tensors={"data": np.zeros(size, np.uint8)}))


class Drops:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, source: str, reason: str, detail: str) -> None:
        assert detail  # a one-line reason for the log
        self.seen.append((source, reason))


def test_a_flood_on_one_topic_evicts_only_that_topics_partials():
    drops = Drops()
    reasm = Reassembler(max_bytes=100_000_000, on_drop=drops)
    frame = update_frame(60_000)
    slow = chunks_of(frame)
    assert len(slow) > 5
    done = []
    for chunk in slow:  # a slow sender: 500 flood frames between each of its chunks
        for _ in range(500):
            assert reasm.add(FLOOD, flood_chunk()) is None
        out = reasm.add(SLOW, chunk)
        if out is not None:
            done.append(out)
    assert done == [frame]
    assert drops.seen and set(drops.seen) == {(FLOOD, "evicted")}
    assert reasm.dropped == {"evicted": len(drops.seen)}
    assert 0 < reasm.pending <= reasm.max_partials_per_source  # the flooder's own last few, nothing more


def test_the_oldest_partial_of_the_crowded_source_goes_when_the_receiver_is_full():
    drops = Drops()
    reasm = Reassembler(max_pending=3, max_partials_per_source=10, on_drop=drops)
    frame = update_frame(30_000)
    slow = chunks_of(frame)
    assert reasm.add(SLOW, slow[0]) is None
    for _ in range(20):
        reasm.add(FLOOD, flood_chunk())
    assert reasm.pending == 3 and all(source == FLOOD for source, _ in drops.seen) and len(drops.seen) == 18
    assert [reasm.add(SLOW, c) for c in slow[1:]][-1] == frame


def test_a_source_may_buffer_one_largest_message_an_abandoned_one_makes_room():
    drops = Drops()
    frame, old = update_frame(30_000), update_frame(30_000, fill=2.0)
    # (the two lengths may differ by a byte or two: the header's `created` is a float)
    reasm = Reassembler(max_bytes=max(len(frame), len(old)), on_drop=drops)
    assert len(old) + len(frame) > reasm.max_source_bytes
    for chunk in chunks_of(old)[:-1]:  # a sender that died before its last chunk
        reasm.add(SLOW, chunk)
    assert reasm.reserved_bytes == len(old) and reasm.buffered_bytes > len(frame) // 2
    done = [out for out in (reasm.add(SLOW, c) for c in chunks_of(frame)) if out is not None]
    assert done == [frame] and drops.seen == [(SLOW, "evicted")]
    assert reasm.pending == 0 and reasm.buffered_bytes == reasm.reserved_bytes == 0


def test_the_global_budget_refuses_the_newcomer_and_keeps_what_is_held():
    drops = Drops()
    first, second = update_frame(30_000), update_frame(30_000, fill=3.0)
    reasm = Reassembler(max_buffered_bytes=len(first) + 10_000, on_drop=drops)
    a, b = chunks_of(first), chunks_of(second)
    for chunk in a[:-1]:
        reasm.add("topic/a", chunk)
    refused = 0
    for chunk in b:
        try:
            reasm.add("topic/b", chunk)
        except ProtocolError as exc:
            assert exc.reason == "over_budget"
            refused += 1
    assert refused == len(b) and reasm.dropped == {"over_budget": refused}  # refused from its first chunk on
    assert drops.seen == []  # the budget evicts nobody: the refusal is the chunk's own ProtocolError
    assert reasm.add("topic/a", a[-1]) == first  # what was held completes


def test_partials_idle_past_their_expiry_are_reported():
    drops = Drops()
    reasm = Reassembler(expire_s=0.05, on_drop=drops)
    chunks = chunks_of(update_frame(30_000))
    reasm.add(SLOW, chunks[0])
    time.sleep(0.1)
    reasm.add(FLOOD, flood_chunk())
    assert drops.seen == [(SLOW, "expired")] and reasm.dropped == {"expired": 1}
    assert [reasm.add(SLOW, c) for c in chunks[1:]][-1] is None  # it cannot complete any more


def test_the_reserved_bytes_always_equal_what_the_partials_reserve_and_bound_what_they_hold():
    """Bookkeeping under a random mix of completions, duplicates, evictions and refusals."""
    rng = random.Random(1)
    reasm = Reassembler(max_bytes=200_000, max_partials_per_source=2, max_pending=5, max_buffered_bytes=300_000,
                        on_drop=lambda *a: None)
    streams = {f"t/{i}": chunks_of(update_frame(rng.randint(5_000, 40_000), fill=i)) for i in range(6)}
    events = [(src, c) for src, cs in streams.items() for c in cs] * 2 + [(FLOOD, flood_chunk(total=150_000)) for _ in range(30)]
    rng.shuffle(events)
    for source, chunk in events:
        try:
            reasm.add(source, chunk)
        except ProtocolError as exc:
            assert exc.reason in {"over_budget", "malformed"}
        partials = list(reasm._pending.values())
        assert reasm.buffered_bytes == sum(len(b) for p in partials for b in p.parts.values())
        assert reasm.reserved_bytes == sum(p.meta.total_bytes for p in partials) <= 300_000
        assert reasm.buffered_bytes <= reasm.reserved_bytes and reasm.pending <= 5


@pytest.mark.parametrize("total", [10, 1000])
def test_a_chunk_that_lies_about_its_size_is_refused_and_holds_nothing(total):
    meta = ChunkMeta(parent_id="e" * 32, index=0, count=3, total_bytes=total, total_sha256="0" * 64)
    chunk = decode(encode("chunk", federation=FED, sender="s", round=0, meta=meta,
                          tensors={"data": np.zeros(5000, np.uint8)}))
    reasm = Reassembler()
    with pytest.raises(ProtocolError) as err:
        reasm.add("s", chunk)
    assert err.value.reason == "malformed" and reasm.pending == 0 and reasm.reserved_bytes == 0


def test_a_source_the_receiver_expects_nothing_of_reserves_nothing_and_one_it_expects_its_allowance():
    """The coordinator's allowance (coordinator/inbox.py): eight chunks on strangers' topics
    declaring the largest message once filled the whole budget; now they hold nothing, and an
    expected sender holds at most its allowance, making room among its own partials only."""
    reasm = Reassembler(max_bytes=256 * 2**20, max_buffered_bytes=2 * 2**30)
    frame = update_frame(60_000)
    reasm.allowance = lambda source: 2 * len(frame) if source == SLOW else 0
    for i in range(8):
        with pytest.raises(ProtocolError) as refused:
            reasm.add(f"edgepfl/v1/fed1/agents/stranger-{i}/update", flood_chunk(total=256 * 2**20))
        assert refused.value.reason == "unexpected"
    assert reasm.reserved_bytes == 0 and reasm.dropped == {"unexpected": 8}
    with pytest.raises(ProtocolError) as refused:  # more than its allowance: refused whole
        reasm.add(SLOW, flood_chunk(total=2 * len(frame) + 1))
    assert refused.value.reason == "over_budget" and reasm.reserved_bytes == 0
    chunks = chunks_of(frame)
    reasm.add(SLOW, flood_chunk(total=len(frame)))  # its own abandoned partial ...
    reasm.add(SLOW, flood_chunk(total=len(frame)))
    assert reasm.reserved_bytes == 2 * len(frame)
    assert [reasm.add(SLOW, c) for c in chunks][-1] == frame  # ... makes room for its update
    assert reasm.dropped["evicted"] == 1 and reasm.reserved_bytes == len(frame)
