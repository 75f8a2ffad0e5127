"""Putting chunked frames back together, with memory bounded per source and in all.

:func:`~edgepfl.protocol.envelope.split_frame` cuts a frame larger than the broker's
message size into ``chunk`` frames; :class:`Reassembler` collects them per (source,
parent id) — the source is the MQTT topic they came on — and hands back the whole frame
once every slice is there and its SHA-256 matches.

A receiver cannot trust a chunk's claims, so partial frames are bounded at three levels,
and one source's traffic can only ever cost that source its own partials. A partial
**reserves** the whole size its first chunk declares (``total_bytes``, itself at most
``max_bytes``): later chunks only fill what was reserved, so a partial that was let in
can always complete, and memory never exceeds what is reserved.

* **per source**: at most ``max_partials_per_source`` partial frames reserving at most
  ``max_source_bytes``; a new partial past either evicts that source's least recently
  progressed ones (``evicted``) — a flood of chunk frames on one topic evicts only that
  topic's partials;
* **in all**: at most ``max_pending`` partial frames (past it, the least recently
  progressed partial of the source holding the most is evicted: ``evicted``) reserving
  at most ``max_buffered_bytes``: a new partial past that is refused (``over_budget``);
  the budget evicts nobody;
* **in time**: a partial that has not progressed for ``expire_s`` is dropped (``expired``);
* **by sender**, where the receiver knows whom it expects frames from (:attr:`Reassembler.allowance`):
  a source it expects nothing from reserves nothing (``unexpected``), the others at most
  what it allows them (``over_budget`` beyond).

A refused chunk raises :class:`ProtocolError` with its reason; an eviction or expiry
(which happens to *another* partial, while a chunk is accepted) is reported to
``on_drop(source, reason, detail)``. Either way the receiver logs and counts it: nothing
is dropped silently.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .envelope import DEFAULT_MAX_PAYLOAD_BYTES, Message, ProtocolError
from .messages import ChunkMeta

#: default bound on all partial frames' buffered bytes together
DEFAULT_MAX_BUFFERED_BYTES = 2 * 2**30

DropHandler = Callable[[str, str, str], None]
#: bytes a source's partials may reserve now (0: none), by source
Allowance = Callable[[str], int]


@dataclass
class _Partial:
    """One frame being put back together."""

    source: str
    meta: ChunkMeta
    touched: float  # time.monotonic() of the last chunk that added to it
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0  # bytes held in parts

    @property
    def reserved(self) -> int:
        return self.meta.total_bytes


class Reassembler:
    """Collects chunk frames per (source, parent id) and returns the whole frame when complete.

    ``max_bytes``: the largest whole frame (larger ones are ``oversized``).
    ``max_source_bytes`` defaults to ``max_bytes``: one source may buffer one largest frame.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, max_pending: int = 1024, expire_s: float = 300.0,
                 *, max_partials_per_source: int = 4, max_source_bytes: int | None = None,
                 max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES, on_drop: DropHandler | None = None):
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self.expire_s = expire_s
        self.max_partials_per_source = max_partials_per_source
        self.max_source_bytes = max_source_bytes if max_source_bytes is not None else max_bytes
        self.max_buffered_bytes = max_buffered_bytes
        self.on_drop = on_drop
        #: what each source's partials may reserve now, at most ``max_source_bytes`` (None: that
        #: much for every source). A coordinator allows only the agents it holds an open task of
        #: (coordinator/inbox.py), so chunks on any other topic reserve nothing of the budget
        self.allowance: Allowance | None = None
        self._pending: dict[tuple[str, str], _Partial] = {}
        self._by_source: dict[str, set[str]] = {}  # source -> parent ids of its partials
        self._source_reserved: dict[str, int] = {}
        self._reserved = 0
        #: partials dropped or chunks refused, by reason (evicted, expired, over_budget, unexpected)
        self.dropped: dict[str, int] = {}

    @property
    def pending(self) -> int:
        """Partial frames held now."""
        return len(self._pending)

    @property
    def reserved_bytes(self) -> int:
        """Bytes the partial frames held now reserve (what they hold when complete)."""
        return self._reserved

    @property
    def buffered_bytes(self) -> int:
        """Bytes the partial frames hold now."""
        return sum(p.size for p in self._pending.values())

    def add(self, source: str, chunk: Message) -> bytes | None:
        """Take one decoded chunk from ``source``; the whole frame once complete, else None.

        Raises :class:`ProtocolError` for a chunk that is refused (its partial, if any, is
        dropped with it): ``oversized``, ``malformed``, ``corrupt``, ``over_budget``, ``unexpected``."""
        meta = chunk.meta_as(ChunkMeta)
        if meta.total_bytes > self.max_bytes:
            raise ProtocolError("oversized", f"chunked message of {meta.total_bytes} bytes > limit {self.max_bytes}")
        if meta.index >= meta.count:
            raise ProtocolError("malformed", "chunk index out of range")
        data = chunk.tensors.get("data")
        if data is None or set(chunk.tensors) != {"data"} or data.dtype != np.uint8 or data.ndim != 1:
            raise ProtocolError("malformed", "a chunk carries exactly one 1-D uint8 tensor named 'data'")
        if data.size > meta.total_bytes:
            raise ProtocolError("malformed", f"chunk of {data.size} bytes for a message of {meta.total_bytes}")
        now = time.monotonic()
        self._expire(now)
        key = (source, meta.parent_id)
        partial = self._pending.get(key)
        if partial is None:
            partial = self._open(source, meta, now)  # raises over_budget when it may not
        elif (partial.meta.count, partial.meta.total_sha256, partial.meta.total_bytes) != (
                meta.count, meta.total_sha256, meta.total_bytes):
            self._remove(partial)
            raise ProtocolError("malformed", "chunks of one message disagree on count, size or checksum")
        self._store(partial, meta.index, data.tobytes(), now)
        if len(partial.parts) < meta.count:
            return None
        self._remove(partial)
        frame = b"".join(partial.parts[i] for i in range(meta.count))
        if len(frame) != meta.total_bytes or hashlib.sha256(frame).hexdigest() != meta.total_sha256:
            raise ProtocolError("corrupt", "reassembled message fails its checksum")
        return frame

    # ---------------------------------------------------------------- bookkeeping
    def _open(self, source: str, meta: ChunkMeta, now: float) -> _Partial:
        limit = self.max_source_bytes
        if self.allowance is not None:
            allowed = self.allowance(source)
            if allowed <= 0:
                self._count("unexpected")
                raise ProtocolError("unexpected", "no chunked message is expected on this topic now")
            limit = min(limit, allowed)
        if meta.total_bytes > limit:
            self._count("over_budget")
            raise ProtocolError("over_budget", f"a message of {meta.total_bytes} bytes; this topic may buffer at most "
                                               f"{limit} now")
        if self._reserved + meta.total_bytes > self.max_buffered_bytes + self._source_reserved.get(source, 0):
            # even evicting every partial of this source would not make room: refuse before evicting any
            self._count("over_budget")
            raise ProtocolError("over_budget", f"partial messages reserve {self._reserved} bytes; "
                                               f"{meta.total_bytes} more would pass the budget of "
                                               f"{self.max_buffered_bytes}")
        while len(self._by_source.get(source, ())) >= self.max_partials_per_source:
            self._evict(self._oldest(source), f"{source} has {self.max_partials_per_source} partial messages, "
                                              f"at most {self.max_partials_per_source} per topic")
        while self._source_reserved.get(source, 0) + meta.total_bytes > limit:
            self._evict(self._oldest(source), f"{source} would reserve more than {limit} bytes")
        while self._reserved + meta.total_bytes > self.max_buffered_bytes:
            self._evict(self._oldest(source), f"partial messages would reserve more than {self.max_buffered_bytes} "
                                              f"bytes in all")
        if len(self._pending) >= self.max_pending:
            crowded = max(self._by_source, key=lambda s: (len(self._by_source[s]), -self._oldest(s).touched))
            self._evict(self._oldest(crowded), f"{len(self._pending)} partial messages held, at most {self.max_pending}")
        partial = _Partial(source, meta, now)
        self._pending[(source, meta.parent_id)] = partial
        self._by_source.setdefault(source, set()).add(meta.parent_id)
        self._source_reserved[source] = self._source_reserved.get(source, 0) + partial.reserved
        self._reserved += partial.reserved
        return partial

    def _store(self, partial: _Partial, index: int, piece: bytes, now: float) -> None:
        grow = len(piece) - len(partial.parts.get(index, b""))  # a duplicate index overwrites
        if partial.size + grow > partial.reserved:  # memory stays within what the partial reserved
            self._remove(partial)
            raise ProtocolError("malformed", "chunks add up to more than their declared total")
        partial.parts[index] = piece
        partial.size += grow
        partial.touched = now

    def _partials_of(self, source: str) -> list[_Partial]:
        return [self._pending[(source, parent)] for parent in self._by_source.get(source, ())]

    def _oldest(self, source: str) -> _Partial:
        return min(self._partials_of(source), key=lambda p: p.touched)

    def _remove(self, partial: _Partial) -> None:
        if self._pending.pop((partial.source, partial.meta.parent_id), None) is None:
            return
        parents = self._by_source[partial.source]
        parents.discard(partial.meta.parent_id)
        if not parents:
            del self._by_source[partial.source]
        self._source_reserved[partial.source] -= partial.reserved
        if not self._source_reserved[partial.source]:
            del self._source_reserved[partial.source]
        self._reserved -= partial.reserved

    def _evict(self, partial: _Partial, why: str) -> None:
        self._drop(partial, "evicted", f"partial message {partial.meta.parent_id} ({len(partial.parts)}/"
                                       f"{partial.meta.count} chunks) evicted: {why}")

    def _expire(self, now: float) -> None:
        for partial in [p for p in self._pending.values() if now - p.touched > self.expire_s]:
            self._drop(partial, "expired", f"partial message {partial.meta.parent_id} ({len(partial.parts)}/"
                                           f"{partial.meta.count} chunks) idle for more than {self.expire_s:g} s")

    def _drop(self, partial: _Partial, reason: str, detail: str) -> None:
        self._remove(partial)
        self._count(reason)
        if self.on_drop is not None:
            self.on_drop(partial.source, reason, detail)

    def _count(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


__all__ = ["DEFAULT_MAX_BUFFERED_BYTES", "Reassembler"]
