"""Update codecs: fewer bytes for an update's change, decoded to an ordinary update.

An agent's update moves the shared state from the round's ``reference`` (the state its
task carried). A codec sends that *change*, not the state: quantized to 8 or 4 bits
with one float32 step per block of ``block`` values, optionally only its ``keep``
largest-magnitude share (top-k). Which codecs exist, and the stages each runs a tensor's
change through, is the table :data:`~edgepfl.codec_stages.CODECS`; this module runs them
over a whole update. :func:`decode` turns a frame back into
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
the compressed ones the codec's streams (:data:`~edgepfl.codec_stages.STREAMS`: level
codes, steps, top-k's kept positions), each the tensors' parts concatenated in header
order, each part starting on a byte boundary; the stages' docstrings say what a part is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .aggregation import STATISTIC_LEAVES
from .codec_stages import CODECS, INDEX, PAYLOAD, SCALES, STREAMS, CodecError, Cursor, Stage, is_sparse, streams_of
from .protocol.codec import CODEC_NAMES, DEFAULT_BLOCK, CodecHeader, CodecName, CompressedTensor, UplinkSpec
from .state import TensorDict

#: leaves sent exactly whatever the codec: BatchNorm's running statistics and its counter
EXACT_LEAVES = (*STATISTIC_LEAVES, "num_batches_tracked")


class CodecSpec(BaseModel):
    """How an agent compresses its updates' changes.

    ``name``: a codec of :data:`~edgepfl.codec_stages.CODECS` (``none``: every tensor exact).
    ``block``: values sharing one float32 step; smaller blocks follow the change's local
    magnitude more closely for ``32 / block`` more bits per value (256: 0.125 bit, 1.6 % of
    an 8-bit payload). ``keep``: with a sparse (top-k) codec, and only with one, the share
    of each tensor's values sent (at least one).
    """

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    name: CodecName = "q8"
    block: int = Field(DEFAULT_BLOCK, ge=1, le=2**20)
    keep: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _keep_with_top_k(self) -> CodecSpec:
        if (self.keep is not None) != is_sparse(self.name):
            raise ValueError(f"keep goes with a top-k codec, and only with one (not with {self.name})")
        return self

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The codec's stages, in encoding order."""
        return CODECS[self.name]

    @classmethod
    def from_name(cls, name: str, *, block: int = DEFAULT_BLOCK, keep: float = 0.1) -> CodecSpec:
        """The spec of codec ``name`` (``keep`` applies to the top-k codecs only)."""
        if name not in CODECS:
            raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")
        return cls(name=name, block=block, keep=keep if is_sparse(name) else None)

    @classmethod
    def from_uplink(cls, uplink: UplinkSpec) -> CodecSpec:
        """The spec a task's ``uplink`` asks for."""
        return cls.from_name(uplink.codec, block=uplink.block, keep=uplink.keep if uplink.keep is not None else 0.1)


@dataclass(frozen=True)
class Encoded:
    """An encoded update: the header and the arrays of :meth:`arrays`."""

    header: CodecHeader
    #: the codec's streams (:func:`~edgepfl.codec_stages.streams_of`), each the parts of
    #: every compressed tensor in header order
    streams: Mapping[str, np.ndarray]
    #: the tensors sent as they are
    exact: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def payload(self) -> np.ndarray:
        """The level codes of every compressed tensor (empty under ``none``)."""
        return self._stream(PAYLOAD)

    @property
    def scales(self) -> np.ndarray:
        """One float32 step per block of every compressed tensor (empty under ``none``)."""
        return self._stream(SCALES)

    @property
    def index(self) -> np.ndarray:
        """Top-k: the kept positions of every compressed tensor (empty otherwise)."""
        return self._stream(INDEX)

    def _stream(self, name: str) -> np.ndarray:
        return self.streams[name] if name in self.streams else np.zeros(0, STREAMS[name])

    def arrays(self) -> TensorDict:
        """The frame's body: the exact tensors, then the codec's streams in frame order."""
        out: TensorDict = dict(self.exact)
        out.update((name, self.streams[name]) for name in streams_of(self.header.codec))
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
        streams = streams_of(head.codec)
        if set(arrays) != set(head.exact) | set(streams):
            raise CodecError("malformed", f"the arrays {sorted(arrays)} are not the header's "
                                          f"{sorted(set(head.exact) | set(streams))}")
        given = {name: np.asarray(value) for name, value in arrays.items()}
        for name, dtype in streams.items():
            if given[name].dtype != dtype or given[name].ndim != 1:
                raise CodecError("malformed", f"{name} is {given[name].dtype}{list(given[name].shape)}, "
                                              f"not a flat {np.dtype(dtype)} array")
        return cls(head, {name: given[name] for name in streams}, {name: given[name] for name in head.exact})

    def sizes(self) -> ByteCount:
        """Bytes of each tensor as encoded and as float32 (:class:`ByteCount`)."""
        per_tensor = {name: (used, 4 * math.prod(shape)) for name, shape, _, used in _walk(self)}
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
    unrounded) and send ``exact`` as they are: the step under :func:`encode`. Each change
    goes through the codec's stages in order, tensor by tensor (so ``rng``'s draws, and the
    bytes, follow the order of ``changes``)."""
    for name, value in (*changes.items(), *exact.items()):
        if name.startswith("codec:"):
            raise ValueError(f"{name!r}: tensor names starting with 'codec:' are the codec's own")
        value = np.asarray(value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise ValueError(f"{name!r} holds NaN or Inf: a codec encodes finite values only")
    exact = {name: np.asarray(value) for name, value in exact.items()}
    if not spec.stages and changes:
        raise ValueError("codec none compresses nothing: send every tensor exact")
    parts: dict[str, list[np.ndarray]] = {name: [] for name in streams_of(spec.name)}
    entries = []
    for name, change in changes.items():
        values, fields = np.asarray(change, np.float64).reshape(-1), {}
        for stage in spec.stages:
            values, written, more = stage.encode(values, spec, rng, name)
            for stream, part in written.items():
                parts[stream].append(part)
            fields.update(more)
        entries.append(CompressedTensor(name=name, shape=np.shape(change), **fields))
    header = CodecHeader(codec=spec.name, block=spec.block, tensors=tuple(entries), exact=tuple(exact))
    streams = {name: np.concatenate(chunks).astype(STREAMS[name]) if chunks else np.zeros(0, STREAMS[name])
               for name, chunks in parts.items()}
    return Encoded(header, streams, exact)


# --------------------------------------------------------------------------- decode
def dequantize(encoded: Encoded) -> TensorDict:
    """The compressed tensors' changes as a decoder sees them (float32, full shape,
    zero where top-k sent nothing); raises :class:`CodecError` for a malformed frame.

    Float32 arithmetic, one rounding per step, so any IEEE 754 implementation gets the
    same bits: ``change = float32(level * step)``."""
    return {name: change for name, _, change, _ in _walk(encoded)}


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
    for name, _, change, _ in _walk(encoded):
        ref = np.asarray(reference[name])
        with np.errstate(over="ignore"):
            value = ref + change
        if not np.isfinite(value).all():
            raise CodecError("non_finite", f"{name} decodes past float32's range")
        out[name] = value
    out.update((name, np.asarray(encoded.exact[name])) for name in header.exact)
    return out


def _walk(encoded: Encoded) -> Iterator[tuple[str, tuple[int, ...], np.ndarray, int]]:
    """Each compressed tensor in header order: its name, shape, change (the codec's stages
    run backwards) and the bytes its parts of the streams took. Raises :class:`CodecError`
    for a malformed frame, the streams' leftovers included once every tensor is read."""
    header = encoded.header
    stages = CODECS[header.codec]
    if not stages:
        if any(value.size for value in encoded.streams.values()):
            raise CodecError("malformed", "codec none carries no codec streams")
        return
    for stage in stages:
        stage.check(encoded.streams)
    cursor = Cursor(encoded.streams)
    for t in header.tensors:
        counts = [math.prod(t.shape)]  # the values each stage is given
        for stage in stages[:-1]:
            counts.append(stage.passes(counts[-1], t))
        before = sum(cursor.at[name] * value.itemsize for name, value in encoded.streams.items())
        values = None
        for stage, count in zip(reversed(stages), reversed(counts)):
            values = stage.decode(values, count, t, header.block, cursor)
        after = sum(cursor.at[name] * value.itemsize for name, value in encoded.streams.items())
        assert values is not None
        yield t.name, t.shape, values.reshape(t.shape), after - before
    if not cursor.finished():
        raise CodecError("malformed", "the codec streams are longer than the header's tensors need")


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
    exact = set(update) if not spec.stages else exact_names(update, reference, marked)
    return ([name for name in update if name not in exact],
            {name: np.asarray(update[name]) for name in update if name in exact})


__all__ = [
    "CODECS", "CODEC_NAMES", "DEFAULT_BLOCK", "EXACT_LEAVES", "INDEX", "PAYLOAD", "SCALES", "ByteCount", "CodecError",
    "CodecHeader", "CodecSpec", "CompressedTensor", "Encoded", "ErrorFeedback", "UplinkSpec", "decode", "dequantize",
    "encode", "encode_changes", "exact_names",
]
