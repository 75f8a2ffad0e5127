"""The stages a codec is made of, and :data:`CODECS`, the table of codecs.

A codec is a row of :data:`CODECS`: its name (what agents announce in
``capabilities.codecs``, tasks ask for and headers carry) and its stages. Each tensor's
change goes through the stages in order, each passing values on to the next (top-k passes
the kept ones, quantization ends the row), and each writes its parts of the frame's codec
streams (:data:`STREAMS`); decoding runs the stages backwards. :mod:`edgepfl.codecs`
drives them over a whole update; docs/COMPRESSION.md describes the bytes.

The table is the one list of codec names: the wire's ``Literal`` types
(:mod:`edgepfl.protocol.codec`), the run config, the codecs an agent announces, and the
codec tests read it. Adding a codec is one :class:`Stage` subclass (where no existing stage
does the job) and one row; the name then travels on the wire, so it is a protocol change.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

#: array names of the codec's own streams; a state_dict key never contains ":"
PAYLOAD, SCALES, INDEX = "codec:payload", "codec:scales", "codec:index"
#: every codec stream, in the order a frame carries them, with its dtype
STREAMS: Mapping[str, type[np.generic]] = {PAYLOAD: np.uint8, SCALES: np.float32, INDEX: np.uint8}
_MAX_VARINT_BYTES = 5  # a gap below 2**32 needs at most five 7-bit groups


class CodecError(ValueError):
    """A frame a decoder must refuse (``reason`` tags the rejection counter), or an
    update an encoder cannot encode."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Parameters(Protocol):
    """What a task or a run sets for a codec (:class:`edgepfl.codecs.CodecSpec`)."""

    @property
    def block(self) -> int:
        """Values sharing one float32 step."""

    @property
    def keep(self) -> float | None:
        """With a sparse stage, the share of each tensor's values sent."""


class TensorEntry(Protocol):
    """A compressed tensor's header entry as the stages read it
    (:class:`edgepfl.protocol.codec.CompressedTensor`)."""

    @property
    def name(self) -> str: ...

    @property
    def kept(self) -> int | None: ...

    @property
    def index(self) -> str | None: ...


class Cursor:
    """Where the next tensor's part begins in each codec stream of a frame: the stages read
    the tensors' parts in header order, one after the other."""

    def __init__(self, streams: Mapping[str, np.ndarray]):
        self.streams = streams
        self.at = dict.fromkeys(streams, 0)

    def take(self, stream: str, size: int) -> np.ndarray:
        """The next ``size`` items of ``stream`` (fewer where it ends early: the caller refuses)."""
        part = self.streams[stream][self.at[stream]: self.at[stream] + size]
        self.at[stream] += size
        return part

    def rest(self, stream: str) -> np.ndarray:
        """What is left of ``stream``."""
        return self.streams[stream][self.at[stream]:]

    def finished(self) -> bool:
        """Whether every stream has been read to its end."""
        return all(self.at[name] == value.size for name, value in self.streams.items())


class Stage(ABC):
    """One step of a codec, applied to each compressed tensor's flat values.

    :meth:`encode` gets the values the stage before passed on (the change itself for the
    first stage, float64) and returns what the next stage encodes, the parts it writes to
    its :attr:`streams` and its fields of the tensor's header entry. :meth:`decode` gets
    what the stages after it decoded (None for the last stage) and returns the ``count``
    values the stage before passed it, float32. Stages are deterministic but for the
    ``rng`` they are given, so a seeded encode is reproducible.
    """

    #: the codec streams (:data:`STREAMS`) it writes
    streams: ClassVar[tuple[str, ...]] = ()
    #: sends only a share of each tensor's values (``keep``); its tensors' header entries have
    #: ``kept`` and ``index``
    sparse: ClassVar[bool] = False

    @abstractmethod
    def encode(self, values: np.ndarray, spec: Parameters, rng: np.random.Generator,
               name: str) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
        """(values for the next stage, stream -> this tensor's part, header fields)."""

    def passes(self, count: int, tensor: TensorEntry) -> int:
        """How many of a tensor's ``count`` values reach the next stage (a decoder's sizes)."""
        return count

    def check(self, streams: Mapping[str, np.ndarray]) -> None:
        """Refuse a frame whose streams this stage cannot read (before any tensor is decoded)."""
        return  # most stages check their parts tensor by tensor, in decode

    @abstractmethod
    def decode(self, values: np.ndarray | None, count: int, tensor: TensorEntry, block: int,
               cursor: Cursor) -> np.ndarray:
        """The ``count`` values this stage was given, from ``values`` and its streams."""


@dataclass(frozen=True)
class Quantize(Stage):
    """Stochastic rounding to ``bits`` bits per value (levels ``-L..L``, ``L = 2**(bits-1) - 1``:
    127 or 7, symmetric so that zero is a level), one float32 step per block of values.

    Each value goes to the level below or above ``value / step`` with the probabilities that
    make its expectation the value itself, so the rounding is unbiased. Writes the offset
    binary codes (``code = level + 2**(bits-1)``, never 0; two 4-bit codes share a byte, the
    first in the low nibble) to ``codec:payload`` and the steps to ``codec:scales``. Decodes
    to ``float32(level * step)``: one rounding, the same bits on any IEEE 754 machine."""

    bits: Literal[8, 4]
    streams: ClassVar[tuple[str, ...]] = (PAYLOAD, SCALES)

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"{self.bits} bits: a quantizer packs 8 or 4 bits per value")

    @property
    def levels(self) -> int:
        """``L``: the outermost level on either side of zero."""
        return 2 ** (self.bits - 1) - 1

    @property
    def middle(self) -> int:
        """The code of level 0."""
        return 2 ** (self.bits - 1)

    def encode(self, values: np.ndarray, spec: Parameters, rng: np.random.Generator,
               name: str) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
        codes, steps = _quantize(values, spec.block, self.levels, rng)
        if not np.isfinite(steps).all():
            raise ValueError(f"{name!r}: a change this large has no float32 step")
        return values, {PAYLOAD: self._pack(codes + self.middle), SCALES: steps}, {}

    def check(self, streams: Mapping[str, np.ndarray]) -> None:
        scales = streams[SCALES]
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError("malformed", "a step is negative, NaN or Inf")

    def decode(self, values: np.ndarray | None, count: int, tensor: TensorEntry, block: int,
               cursor: Cursor) -> np.ndarray:
        payload_bytes, blocks = self.payload_bytes(count), _blocks(count, block)
        payload, steps = cursor.take(PAYLOAD, payload_bytes), cursor.take(SCALES, blocks)
        if payload.size != payload_bytes or steps.size != blocks:
            raise CodecError("malformed", f"{tensor.name}: the payload or scales stream ends early")
        codes = self._unpack(payload, count, tensor.name)
        if (codes == 0).any():
            raise CodecError("malformed", f"{tensor.name}: code 0 is no level")
        step_of_value = steps[np.arange(count) // block]
        with np.errstate(over="ignore"):  # a step too large for its levels: decode() refuses the Inf
            return (codes.astype(np.int64) - self.middle).astype(np.float32) * step_of_value

    def payload_bytes(self, count: int) -> int:
        """Bytes of ``count`` codes."""
        return count if self.bits == 8 else (count + 1) // 2

    def _pack(self, codes: np.ndarray) -> np.ndarray:
        if self.bits == 8:
            return codes.astype(np.uint8)
        nibbles = np.zeros(codes.size + codes.size % 2, np.uint8)
        nibbles[: codes.size] = codes
        return nibbles[0::2] | (nibbles[1::2] << 4)

    def _unpack(self, payload: np.ndarray, count: int, name: str) -> np.ndarray:
        if self.bits == 8:
            return payload
        codes = np.empty(payload.size * 2, np.uint8)
        codes[0::2], codes[1::2] = payload & 0x0F, payload >> 4
        if count % 2 and codes[-1] != 0:
            raise CodecError("malformed", f"{name}: the padding nibble is not 0")
        return codes[:count]


@dataclass(frozen=True)
class TopK(Stage):
    """Only the ``keep`` share of each tensor's largest magnitudes (at least one value) goes on.

    Not unbiased: :class:`edgepfl.codecs.ErrorFeedback` carries what it leaves out into the
    next round. Writes which flat positions (C order) were kept to ``codec:index``, per
    tensor the smaller of a bitmap (one bit per position, least significant bit first; the
    bitmap on a tie) and LEB128 varints of the gaps between kept positions (``position -
    previous - 1``, the first from -1); the header entry's ``index`` says which, its ``kept``
    how many. Unsent positions decode to no change."""

    streams: ClassVar[tuple[str, ...]] = (INDEX,)
    sparse: ClassVar[bool] = True

    def encode(self, values: np.ndarray, spec: Parameters, rng: np.random.Generator,
               name: str) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
        assert spec.keep is not None  # CodecSpec's validation
        positions = _top_k(values, max(1, math.ceil(spec.keep * values.size)) if values.size else 0)
        index, form = _write_index(positions, values.size)
        return values[positions], {INDEX: index}, {"kept": len(positions), "index": form}

    def passes(self, count: int, tensor: TensorEntry) -> int:
        assert tensor.kept is not None  # the header's validation
        return tensor.kept

    def decode(self, values: np.ndarray | None, count: int, tensor: TensorEntry, block: int,
               cursor: Cursor) -> np.ndarray:
        assert values is not None and tensor.kept is not None  # a top-k stage is followed by a quantizer
        positions = self._read_index(cursor, count, tensor.kept, tensor.index, tensor.name)
        change = np.zeros(count, np.float32)
        change[positions] = values
        return change

    @staticmethod
    def _read_index(cursor: Cursor, count: int, kept: int, form: str | None, name: str) -> np.ndarray:
        """The kept positions of one tensor, taken from the cursor's index stream."""
        if form == "bitmap":
            size = (count + 7) // 8
            bitmap = cursor.take(INDEX, size)
            if bitmap.size != size:
                raise CodecError("malformed", f"{name}: the index stream ends early")
            bits = np.unpackbits(bitmap, bitorder="little")
            if bits[count:].any():
                raise CodecError("malformed", f"{name}: the bitmap's padding bits are not 0")
            positions = np.flatnonzero(bits[:count])
            if positions.size != kept:
                raise CodecError("malformed", f"{name}: the bitmap marks {positions.size} positions, the header {kept}")
            return positions
        stream = cursor.rest(INDEX)
        ends = np.flatnonzero(stream < 0x80)[:kept]
        if ends.size != kept:
            raise CodecError("malformed", f"{name}: the index stream ends early")
        used = int(ends[-1]) + 1 if kept else 0
        group = cursor.take(INDEX, used)
        starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64) if kept else np.zeros(0, np.int64)
        lengths = ends - starts + 1
        if kept and (lengths.max() > _MAX_VARINT_BYTES or ((lengths > 1) & (group[ends] == 0)).any()):
            raise CodecError("malformed", f"{name}: a gap is not a minimal LEB128 varint below 2**35")
        place = np.arange(used) - np.repeat(starts, lengths)
        weights = (group & 0x7F).astype(np.int64) << (7 * place)
        gaps = np.add.reduceat(weights, starts) if kept else np.zeros(0, np.int64)
        positions = np.cumsum(gaps + 1) - 1
        if kept and positions[-1] >= count:
            raise CodecError("malformed", f"{name}: a kept position is past the tensor's {count} values")
        return positions


#: every codec: its name and its stages, in encoding order. Parameters (block, keep) travel
#: in each task and frame, not in the name.
CODECS: Mapping[str, tuple[Stage, ...]] = {
    "none": (),  # every tensor exact
    "q8": (Quantize(8),),
    "q4": (Quantize(4),),
    "topk+q8": (TopK(), Quantize(8)),
    "topk+q4": (TopK(), Quantize(4)),
}


def is_sparse(codec: str) -> bool:
    """Whether ``codec`` sends only a share of each tensor's values (takes ``keep``)."""
    return any(stage.sparse for stage in CODECS[codec])


def streams_of(codec: str) -> dict[str, type[np.generic]]:
    """The codec streams a frame of ``codec`` carries, in frame order, with their dtypes."""
    used = {stream for stage in CODECS[codec] for stream in stage.streams}
    return {name: dtype for name, dtype in STREAMS.items() if name in used}


#: the codecs a release delta (and a task delta) may use: the dense ones, since every weight
#: changes between two releases (a share of them would leave the rest behind)
DELTA_CODECS = tuple(name for name, stages in CODECS.items() if stages and not is_sparse(name))


# --------------------------------------------------------------------------- helpers
def _blocks(values: int, block: int) -> int:
    return -(-values // block)


def _quantize(values: np.ndarray, block: int, levels: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Levels in ``-levels..levels`` (int64) and one float32 step per block.

    The step is the block's largest magnitude over ``levels``, rounded *up* to float32 so
    that no value lands past the outermost level; each value then goes to the level below
    or above ``value / step`` with the probabilities that make its expectation exact."""
    blocks = _blocks(values.size, block)
    padded = np.zeros(blocks * block)
    padded[: values.size] = np.abs(values)
    largest = padded.reshape(blocks, block).max(axis=1)
    steps = (largest / levels).astype(np.float32)
    short = steps.astype(np.float64) * levels < largest
    steps[short] = np.nextafter(steps[short], np.float32(np.inf))
    step_of_value = np.repeat(steps.astype(np.float64), block)[: values.size]
    scaled = np.divide(values, step_of_value, out=np.zeros_like(values), where=step_of_value > 0)
    floor = np.floor(scaled)
    # |scaled| <= levels: the step was rounded up, and step * levels is exact in float64
    return (floor + (rng.random(values.size) < scaled - floor)).astype(np.int64), steps


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """The positions of the ``k`` largest magnitudes, ascending (ties: the earlier position)."""
    order = np.argsort(-np.abs(values), kind="stable")
    return np.sort(order[:k])


def _write_index(positions: np.ndarray, count: int) -> tuple[np.ndarray, Literal["bitmap", "gaps"]]:
    """The smaller of a bitmap and gap varints for ``positions`` (the bitmap on a tie)."""
    gaps = _varints(np.diff(positions, prepend=-1) - 1)
    if (count + 7) // 8 <= gaps.size:
        mask = np.zeros(count, bool)
        mask[positions] = True
        return np.packbits(mask, bitorder="little"), "bitmap"
    return gaps, "gaps"


def _varints(values: np.ndarray) -> np.ndarray:
    """LEB128: seven bits per byte, least significant group first, high bit set on all
    but each value's last byte."""
    values = values.astype(np.uint64)
    lengths = np.ones(values.size, np.int64)
    for group in range(1, _MAX_VARINT_BYTES):
        lengths += values >= np.uint64(1 << (7 * group))
    starts = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()), np.uint8)
    for group in range(_MAX_VARINT_BYTES):
        has = lengths > group
        byte = (values[has] >> np.uint64(7 * group)) & np.uint64(0x7F)
        more = (lengths[has] > group + 1).astype(np.uint64) << np.uint64(7)
        out[starts[has] + group] = (byte | more).astype(np.uint8)
    return out


__all__ = ["CODECS", "DELTA_CODECS", "INDEX", "PAYLOAD", "SCALES", "STREAMS", "CodecError", "Cursor", "Parameters",
           "Quantize", "Stage", "TensorEntry", "TopK", "is_sparse", "streams_of"]
