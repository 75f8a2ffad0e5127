"""Update codecs: fewer bytes for an update's change, decoded to an ordinary update.

An agent's update moves the shared state from the round's ``reference`` (the state its
task carried). A codec sends that *change*, not the state: quantized to 8 or 4 bits
with one float32 step per block of ``block`` values, optionally only its ``keep``
largest-magnitude share (top-k). :func:`decode` turns a frame back into
``reference + dequantized change`` in float32, so the coordinator's update bound,
robust rules and exact fixed-point sums see an ordinary update; decoding is
deterministic, so the sums stay bit-identical in any arrival order.

* **Unbiased.** Each value is rounded up or down to a neighbouring level with the
  probabilities that make its expectation the value itself (stochastic rounding, drawn
  from the caller's seeded ``np.random.Generator``: an encode is reproducible). Top-k
  is not unbiased; :class:`ErrorFeedback` carries what it (and the rounding) left out
  into the next round, so nothing is lost over rounds.
* **Exact where it must be.** BatchNorm running statistics (estimates of the device's
  data, which the coordinator bounds in their own geometry), integer tensors such as
  ``num_batches_tracked``, any floating tensor other than float32, any tensor the
  reference has not (a method's statistics) and any name the caller marks exact go as
  they are, bit for bit.
* **Nothing executable on the wire.** An :class:`Encoded` is a small JSON-able header
  (:class:`CodecHeader`) and a few flat arrays (uint8 and float32, the envelope's own
  dtypes); docs/COMPRESSION.md describes them byte by byte for other implementations.

Wire layout (:meth:`Encoded.arrays`): the exact tensors under their own names, and for
the compressed ones, concatenated in header order, each tensor's part starting on a
byte boundary:

* ``codec:payload`` (uint8): the level codes, offset binary (``code = level + 2**(bits-1)``,
  so 8-bit codes are 1..255 and 4-bit codes 1..15; 0 is never a level). Two 4-bit codes
  share a byte, the first in the low nibble; an odd count ends with a zero nibble.
* ``codec:scales`` (float32): per block, the step between levels; a value decodes to
  ``(code - 2**(bits-1)) * step``, and the block's largest magnitude is at most
  ``(2**(bits-1) - 1) * step``.
* ``codec:index`` (uint8, top-k only): which flat positions (C order) were kept, per
  tensor the smaller of a bitmap (one bit per position, least significant bit first)
  and LEB128 varints of the gaps between kept positions (``position - previous - 1``,
  the first from -1); the header says which.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .aggregation import STATISTIC_LEAVES
from .protocol.codec import CODEC_NAMES, DEFAULT_BLOCK, CodecHeader, CompressedTensor, UplinkSpec

TensorDict = dict[str, np.ndarray]

#: array names of the codec's own streams; a state_dict key never contains ":"
PAYLOAD, SCALES, INDEX = "codec:payload", "codec:scales", "codec:index"
#: leaves sent exactly whatever the codec: BatchNorm's running statistics and its counter
EXACT_LEAVES = (*STATISTIC_LEAVES, "num_batches_tracked")
_MAX_VARINT_BYTES = 5  # a gap below 2**32 needs at most five 7-bit groups


class CodecError(ValueError):
    """A frame a decoder must refuse (``reason`` tags the rejection counter), or an
    update an encoder cannot encode."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class CodecSpec(BaseModel):
    """How an agent compresses its updates' changes.

    ``bits``: 8 or 4 bits per value (levels ``-L..L`` with ``L = 2**(bits-1) - 1``: 127
    or 7, symmetric so that zero is a level and a sign flip costs nothing), or None for
    no compression at all (``none``: every tensor exact). ``block``: values sharing one
    float32 step; smaller blocks follow the change's local magnitude more closely for
    ``32 / block`` more bits per value (256: 0.125 bit, 1.6 % of an 8-bit payload).
    ``keep``: with top-k, the share of each tensor's values sent (at least one).
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    bits: Literal[8, 4] | None = 8
    block: int = Field(DEFAULT_BLOCK, ge=1, le=2**20)
    keep: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _keep_needs_bits(self) -> CodecSpec:
        if self.keep is not None and self.bits is None:
            raise ValueError("top-k needs a quantizer (bits 8 or 4): its kept values are sent quantized")
        return self

    @property
    def name(self) -> str:
        """The codec family: one of :data:`CODEC_NAMES`."""
        if self.bits is None:
            return "none"
        return f"{'topk+' if self.keep is not None else ''}q{self.bits}"

    @classmethod
    def from_name(cls, name: str, *, block: int = DEFAULT_BLOCK, keep: float = 0.1) -> CodecSpec:
        """The spec of family ``name`` (``keep`` applies to the top-k families only)."""
        if name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODEC_NAMES)}")
        if name == "none":
            return cls(bits=None, block=block)
        return cls(bits=_bits_of(name), block=block, keep=keep if name.startswith("topk+") else None)

    @classmethod
    def from_uplink(cls, uplink: UplinkSpec) -> CodecSpec:
        """The spec a task's ``uplink`` asks for."""
        return cls.from_name(uplink.codec, block=uplink.block, keep=uplink.keep if uplink.keep is not None else 0.1)


@dataclass(frozen=True)
class Encoded:
    """An encoded update: the header and the arrays of :meth:`arrays`."""

    header: CodecHeader
    #: the level codes of every compressed tensor (module docstring)
    payload: np.ndarray
    #: one float32 step per block of every compressed tensor
    scales: np.ndarray
    #: top-k: the kept positions of every compressed tensor
    index: np.ndarray
    #: the tensors sent as they are
    exact: Mapping[str, np.ndarray]

    def arrays(self) -> TensorDict:
        """The frame's body: the exact tensors and the codec's streams (payload and scales
        unless the codec is ``none``, index with top-k)."""
        out: TensorDict = dict(self.exact)
        if self.header.codec != "none":
            out[PAYLOAD], out[SCALES] = self.payload, self.scales
        if self.header.codec.startswith("topk+"):
            out[INDEX] = self.index
        return out

    @classmethod
    def from_arrays(cls, header: Mapping | CodecHeader, arrays: Mapping[str, np.ndarray]) -> Encoded:
        """What a receiver rebuilds from a frame's header and body; raises
        :class:`CodecError` (``malformed``) when they do not belong together."""
        try:
            head = header if isinstance(header, CodecHeader) else CodecHeader.model_validate(header)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "header"
            raise CodecError("malformed", f"codec header: {where}: {first['msg']}") from None
        streams = {PAYLOAD: np.uint8, SCALES: np.float32} if head.codec != "none" else {}
        if head.codec.startswith("topk+"):
            streams[INDEX] = np.uint8
        if set(arrays) != set(head.exact) | set(streams):
            raise CodecError("malformed", f"the arrays {sorted(arrays)} are not the header's "
                                          f"{sorted(set(head.exact) | set(streams))}")
        given = {name: np.asarray(value) for name, value in arrays.items()}
        for name, dtype in streams.items():
            if given[name].dtype != dtype or given[name].ndim != 1:
                raise CodecError("malformed", f"{name} is {given[name].dtype}{list(given[name].shape)}, "
                                              f"not a flat {np.dtype(dtype)} array")
        empty_u8, empty_f32 = np.zeros(0, np.uint8), np.zeros(0, np.float32)
        return cls(head, given.get(PAYLOAD, empty_u8), given.get(SCALES, empty_f32), given.get(INDEX, empty_u8),
                   {name: given[name] for name in head.exact})

    def sizes(self) -> ByteCount:
        """Bytes of each tensor as encoded and as float32 (:class:`ByteCount`)."""
        per_tensor: dict[str, tuple[int, int]] = {}
        bits = _bits_of(self.header.codec)
        index_at = 0
        for t in self.header.tensors:
            count = math.prod(t.shape)
            values = count if t.kept is None else t.kept
            index_bytes = 0
            if t.kept is not None:
                index_bytes = _index_bytes(self.index, index_at, count, t.kept, t.index)
                index_at += index_bytes
            encoded = _payload_bytes(values, bits) + 4 * _blocks(values, self.header.block) + index_bytes
            per_tensor[t.name] = (encoded, 4 * count)
        for name, value in self.exact.items():
            per_tensor[name] = (value.nbytes, value.nbytes)  # the same bytes either way
        return ByteCount(per_tensor, len(json.dumps(self.header_fields(), separators=(",", ":"))))

    def header_fields(self) -> dict:
        """The header as JSON-able fields for a frame's meta (absent: ``kept`` and
        ``index`` of a dense codec's tensors)."""
        return self.header.model_dump(mode="json", exclude_none=True)


@dataclass(frozen=True)
class ByteCount:
    """What an encoded update costs against the same tensors sent uncompressed."""

    #: name -> (bytes as encoded, bytes as the uncompressed tensor): a compressed tensor's
    #: share of the payload, scales and index streams; an exact tensor's own bytes, both
    per_tensor: Mapping[str, tuple[int, int]]
    #: the codec header as compact JSON (the frame's envelope is not counted either way)
    header: int

    @property
    def encoded(self) -> int:
        """Every array's bytes and the header's."""
        return sum(e for e, _ in self.per_tensor.values()) + self.header

    @property
    def uncompressed(self) -> int:
        """The same tensors' bytes as an ordinary update sends them."""
        return sum(u for _, u in self.per_tensor.values())

    @property
    def ratio(self) -> float:
        """``encoded / uncompressed`` (1.0 for an empty update)."""
        return self.encoded / self.uncompressed if self.uncompressed else 1.0


# --------------------------------------------------------------------------- encode
def exact_names(update: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray],
                marked: Collection[str] = ()) -> set[str]:
    """The tensors of ``update`` no codec compresses: those ``marked`` exact, those
    ``reference`` has not (a method's statistics, a personal part it uploads: there is no
    change to take), every tensor that is not float32 (integers, float16, float64), and
    BatchNorm's running statistics and counter (:data:`EXACT_LEAVES`)."""
    return {name for name, value in update.items()
            if name in marked or name not in reference or np.asarray(value).dtype != np.float32
            or name.rsplit(".", 1)[-1] in EXACT_LEAVES}


def encode(update: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], spec: CodecSpec,
           rng: np.random.Generator, *, exact: Collection[str] = ()) -> Encoded:
    """Encode ``update`` as its changes from ``reference``, the tensors its task carried.

    The tensors of :func:`exact_names` (``exact``: more names the caller's method keeps
    exact) go as the update's own values; the others as ``update - reference``,
    compressed by ``spec`` with randomness from ``rng``. Without error feedback: an agent
    uses :meth:`ErrorFeedback.encode`. Raises ValueError for NaN or Inf and for a tensor
    whose shape or dtype differs from the reference's."""
    lossy, exact_values = _partition(update, reference, spec, exact)
    changes = {name: np.asarray(update[name], np.float64) - np.asarray(reference[name], np.float64)
               for name in lossy}
    return encode_changes(changes, exact_values, spec, rng)


def encode_changes(changes: Mapping[str, np.ndarray], exact: Mapping[str, np.ndarray], spec: CodecSpec,
                   rng: np.random.Generator) -> Encoded:
    """Compress ``changes`` (finite; float64 keeps a change with error feedback's residual
    unrounded) and send ``exact`` as they are: the step under :func:`encode`."""
    for name, value in (*changes.items(), *exact.items()):
        if name.startswith("codec:"):
            raise ValueError(f"{name!r}: tensor names starting with 'codec:' are the codec's own")
        value = np.asarray(value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(f"{name!r} holds NaN or Inf: a codec encodes finite values only")
    exact = {name: np.asarray(value) for name, value in exact.items()}
    empty_u8, empty_f32 = np.zeros(0, np.uint8), np.zeros(0, np.float32)
    if spec.bits is None:
        if changes:
            raise ValueError("codec none compresses nothing: send every tensor exact")
        return Encoded(CodecHeader(codec="none", block=spec.block, exact=tuple(exact)), empty_u8, empty_f32,
                       empty_u8, exact)
    bits, middle = spec.bits, 2 ** (spec.bits - 1)
    payloads, scales, indexes, entries = [], [], [], []
    for name, change in changes.items():
        flat = np.asarray(change, np.float64).reshape(-1)
        kept = index = None
        if spec.keep is not None:
            positions = _top_k(flat, max(1, math.ceil(spec.keep * flat.size)) if flat.size else 0)
            index_bytes, index = _write_index(positions, flat.size)
            indexes.append(index_bytes)
            kept, flat = len(positions), flat[positions]
        codes, steps = _quantize(flat, spec.block, middle - 1, rng)
        if not np.isfinite(steps).all():
            raise ValueError(f"{name!r}: a change this large has no float32 step")
        payloads.append(_pack(codes + middle, bits))
        scales.append(steps)
        entries.append(CompressedTensor(name=name, shape=np.shape(change), kept=kept, index=index))
    header = CodecHeader(codec=spec.name, block=spec.block, tensors=tuple(entries), exact=tuple(exact))
    return Encoded(header, _concat(payloads, np.uint8), _concat(scales, np.float32), _concat(indexes, np.uint8),
                   exact)


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


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes.astype(np.uint8)
    nibbles = np.zeros(codes.size + codes.size % 2, np.uint8)
    nibbles[: codes.size] = codes
    return nibbles[0::2] | (nibbles[1::2] << 4)


# --------------------------------------------------------------------------- decode
def dequantize(encoded: Encoded) -> TensorDict:
    """The compressed tensors' changes as a decoder sees them (float32, full shape,
    zero where top-k sent nothing); raises :class:`CodecError` for a malformed frame.

    Float32 arithmetic, one rounding per step, so any IEEE 754 implementation gets the
    same bits: ``change = float32(level * step)``."""
    return dict(_changes(encoded))


def decode(encoded: Encoded, reference: Mapping[str, np.ndarray]) -> TensorDict:
    """The update ``encoded`` stands for: ``float32(reference + change)`` for each
    compressed tensor, then the exact tensors as sent. Deterministic, so that the same
    frame gives the same bits at every coordinator. Raises :class:`CodecError` when the
    frame is malformed, compresses a tensor ``reference`` has not or of another shape, or
    decodes to a value float32 cannot hold; which tensors an update must have is the
    method's to check, as for any update."""
    header = encoded.header
    compressed = {t.name: t for t in header.tensors}
    if not set(compressed) <= set(reference):
        raise CodecError("wrong_tensors", f"the frame compresses {sorted(set(compressed) - set(reference))[:3]}, "
                                          "which the reference has not")
    for name, tensor in compressed.items():  # before dequantizing: a header's shape sizes what is allocated
        ref = np.asarray(reference[name])
        if ref.dtype != np.float32 or ref.shape != tensor.shape:
            raise CodecError("wrong_shape", f"{name}: float32{list(tensor.shape)}, the reference is "
                                            f"{ref.dtype}{list(ref.shape)}")
    out: TensorDict = {}
    for name, change in _changes(encoded):
        ref = np.asarray(reference[name])
        with np.errstate(over="ignore"):
            value = ref + change
        if not np.isfinite(value).all():
            raise CodecError("non_finite", f"{name} decodes past float32's range")
        out[name] = value
    out.update((name, np.asarray(encoded.exact[name])) for name in header.exact)
    return out


def _changes(encoded: Encoded) -> Iterator[tuple[str, np.ndarray]]:
    header = encoded.header
    if header.codec == "none":
        if encoded.payload.size or encoded.scales.size or encoded.index.size:
            raise CodecError("malformed", "codec none carries no codec streams")
        return
    bits = _bits_of(header.codec)
    middle = 2 ** (bits - 1)
    if not (np.isfinite(encoded.scales).all() and (encoded.scales >= 0).all()):
        raise CodecError("malformed", "a step is negative, NaN or Inf")
    payload_at = scales_at = index_at = 0
    for t in header.tensors:
        count = math.prod(t.shape)
        values = count if t.kept is None else t.kept
        payload_bytes, blocks = _payload_bytes(values, bits), _blocks(values, header.block)
        payload = encoded.payload[payload_at: payload_at + payload_bytes]
        steps = encoded.scales[scales_at: scales_at + blocks]
        if payload.size != payload_bytes or steps.size != blocks:
            raise CodecError("malformed", f"{t.name}: the payload or scales stream ends early")
        payload_at, scales_at = payload_at + payload_bytes, scales_at + blocks
        codes = _unpack(payload, values, bits, t.name)
        if (codes == 0).any():
            raise CodecError("malformed", f"{t.name}: code 0 is no level")
        step_of_value = steps[np.arange(values) // header.block]
        with np.errstate(over="ignore"):  # a step too large for its levels: decode() refuses the Inf
            sent = (codes.astype(np.int64) - middle).astype(np.float32) * step_of_value
        if t.kept is None:
            change = sent
        else:
            positions, used = _read_index(encoded.index, index_at, count, t.kept, t.index, t.name)
            index_at += used
            change = np.zeros(count, np.float32)
            change[positions] = sent
        yield t.name, change.reshape(t.shape)
    if (payload_at, scales_at, index_at) != (encoded.payload.size, encoded.scales.size, encoded.index.size):
        raise CodecError("malformed", "the codec streams are longer than the header's tensors need")


def _unpack(payload: np.ndarray, values: int, bits: int, name: str) -> np.ndarray:
    if bits == 8:
        return payload
    codes = np.empty(payload.size * 2, np.uint8)
    codes[0::2], codes[1::2] = payload & 0x0F, payload >> 4
    if values % 2 and codes[-1] != 0:
        raise CodecError("malformed", f"{name}: the padding nibble is not 0")
    return codes[:values]


def _read_index(stream: np.ndarray, at: int, count: int, kept: int, form: str | None,
                name: str) -> tuple[np.ndarray, int]:
    """The kept positions of one tensor from ``stream[at:]`` and the bytes they took."""
    if form == "bitmap":
        size = (count + 7) // 8
        bitmap = stream[at: at + size]
        if bitmap.size != size:
            raise CodecError("malformed", f"{name}: the index stream ends early")
        bits = np.unpackbits(bitmap, bitorder="little")
        if bits[count:].any():
            raise CodecError("malformed", f"{name}: the bitmap's padding bits are not 0")
        positions = np.flatnonzero(bits[:count])
        if positions.size != kept:
            raise CodecError("malformed", f"{name}: the bitmap marks {positions.size} positions, the header {kept}")
        return positions, size
    ends = np.flatnonzero(stream[at:] < 0x80)[:kept]
    if ends.size != kept:
        raise CodecError("malformed", f"{name}: the index stream ends early")
    used = int(ends[-1]) + 1 if kept else 0
    group = stream[at: at + used]
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
    return positions, used


# --------------------------------------------------------------------------- error feedback
class ErrorFeedback:
    """The device's memory of what its encoded updates left out (EF-SGD, Karimireddy et
    al. 2019): each round compresses ``change + residual`` and keeps ``residual =
    change + residual - sent``, where *sent* is the change the coordinator will decode.
    Over rounds the decoded changes then add up to the true ones less the last residual,
    at most one step per value with dense quantization, instead of an error that grows.

    The residual lives in change space, so it carries across references (each round's
    new state). It is reset to zeros when the compressed tensors' names or shapes change
    (another model, another method's shared part): a residual of one model means nothing
    for another. :meth:`state_dict` / :meth:`load_state_dict` keep it across restarts as
    float32 arrays (safetensors-friendly).
    """

    def __init__(self) -> None:
        self.residual: TensorDict = {}

    def encode(self, update: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], spec: CodecSpec,
               rng: np.random.Generator, *, exact: Collection[str] = ()) -> Encoded:
        """:func:`encode` with the residual added before compression and updated after."""
        lossy, exact_values = _partition(update, reference, spec, exact)
        if {k: v.shape for k, v in self.residual.items()} != {k: np.shape(reference[k]) for k in lossy}:
            self.residual = {name: np.zeros(np.shape(reference[name]), np.float32) for name in lossy}
        targets = {name: np.asarray(update[name], np.float64) - np.asarray(reference[name], np.float64)
                   + self.residual[name] for name in lossy}
        encoded = encode_changes(targets, exact_values, spec, rng)
        decoded = decode(encoded, reference)
        self.residual = {name: (targets[name] - (decoded[name].astype(np.float64) - reference[name])).astype(np.float32)
                         for name in lossy}
        return encoded

    def state_dict(self) -> TensorDict:
        """The residual, one float32 array per compressed tensor."""
        return {name: value.copy() for name, value in self.residual.items()}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore :meth:`state_dict`; raises ValueError for a non-finite residual."""
        loaded = {name: np.array(value, np.float32) for name, value in state.items()}
        for name, value in loaded.items():
            if not np.isfinite(value).all():
                raise ValueError(f"residual {name!r} holds NaN or Inf")
        self.residual = loaded


# --------------------------------------------------------------------------- shared helpers
def _bits_of(codec: str) -> int:
    return 4 if codec.endswith("q4") else 8


def _blocks(values: int, block: int) -> int:
    return -(-values // block)


def _payload_bytes(values: int, bits: int) -> int:
    return values if bits == 8 else (values + 1) // 2


def _index_bytes(stream: np.ndarray, at: int, count: int, kept: int, form: str | None) -> int:
    if form == "bitmap":
        return (count + 7) // 8
    return int(np.flatnonzero(stream[at:] < 0x80)[kept - 1]) + 1 if kept else 0


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _partition(update: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], spec: CodecSpec,
               marked: Collection[str]) -> tuple[list[str], TensorDict]:
    """The names of ``update`` to compress, and the tensors to send exact (every one under
    codec ``none``); raises ValueError for a tensor of another shape or dtype than the
    reference's (finiteness is :func:`encode_changes`'s to check, on the changes)."""
    for name, value in update.items():
        value = np.asarray(value)
        ref = np.asarray(reference.get(name, value))
        if value.shape != ref.shape or value.dtype != ref.dtype:
            raise ValueError(f"{name}: the update is {value.dtype}{list(value.shape)}, the reference "
                             f"{ref.dtype}{list(ref.shape)}")
    exact = set(update) if spec.bits is None else exact_names(update, reference, marked)
    return ([name for name in update if name not in exact],
            {name: np.asarray(update[name]) for name in update if name in exact})


__all__ = [
    "CODEC_NAMES", "DEFAULT_BLOCK", "EXACT_LEAVES", "INDEX", "PAYLOAD", "SCALES", "ByteCount", "CodecError",
    "CodecHeader", "CodecSpec", "CompressedTensor", "Encoded", "ErrorFeedback", "UplinkSpec", "decode", "dequantize",
    "encode", "encode_changes", "exact_names",
]
