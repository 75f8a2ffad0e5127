"""Update / delta compression codecs, implemented from the text alone.

Written (session 42, for issue #54) by someone given only docs/COMPRESSION.md and the
protocol's passages on compressed updates, task deltas, release deltas and tensors (§5,
§6, §12), told to read nothing else of edgepfl. Every choice the text left open is marked
``GAP n`` and numbered as in CODECS_GAPS.md beside this file; the text has since settled
them, and where edgepfl had chosen otherwise (the change and its step in float64, a step
of -0.0, runs of count 0) this module follows the text as it now reads.
tests/unit/core/test_codecs_from_the_text.py checks it against the text's worked examples,
tests/unit/core/test_codecs_text_against_edgepfl.py against edgepfl, bit for bit.

Layout of this module, top to bottom:

1. the codec table and constants
2. small pieces: levels, steps, stochastic rounding, code packing, the top-k index
3. the encoder (one tensor, then a whole update) and the frame it builds
4. the decoder (validation, then IEEE 754 float32 decoding)
5. error feedback
6. task deltas (the rounded state, ``tensors_digest``)
7. release deltas (runs of an artifact)
8. a minimal safetensors body (PROTOCOL §6), to check byte orders end to end

numpy only.  The decoder's arithmetic is float32, one rounding per operation; the
encoder's is float64 on the change, as the text says.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

import numpy as np

# --------------------------------------------------------------------------------------
# 1. The codec table
# --------------------------------------------------------------------------------------

#: name -> (bits, top-k?) ; ``none`` has no bits.  (COMPRESSION.md "Codecs")
CODECS: dict[str, tuple[int | None, bool]] = {
    "none": (None, False),
    "q8": (8, False),
    "q4": (4, False),
    "topk+q8": (8, True),
    "topk+q4": (4, True),
}

BLOCK_MIN, BLOCK_MAX = 1, 2 ** 20
PAYLOAD, SCALES, INDEX = "codec:payload", "codec:scales", "codec:index"
CODEC_PREFIX = "codec:"
BN_STATS = ("running_mean", "running_var", "num_batches_tracked")
VARINT_MAX_BYTES = 5

#: third word of the random streams of the coordinator's roundings
TASK_DELTA_STREAM = 0xD0317      # [seed, round, 0xD0317]     (Task deltas)
RELEASE_DELTA_STREAM = 0x5E1EA5E  # [seed, round, 0x5E1EA5E]  (Release deltas)
RELEASE_MAX_RUNS = 65536


class CodecError(ValueError):
    """A frame the decoder refuses; ``reason`` is the protocol's rejection reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DeltaRefused(ValueError):
    """A task delta (``no_base``) or release delta the agent refuses."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def levels_of(bits: int) -> int:
    """``L = 2^(bits-1) - 1``: 127 at 8 bits, 7 at 4 bits."""
    return 2 ** (bits - 1) - 1


def code_offset(bits: int) -> int:
    """Codes are offset binary: ``c = q + 2^(bits-1)``."""
    return 2 ** (bits - 1)


# --------------------------------------------------------------------------------------
# 2. Small pieces
# --------------------------------------------------------------------------------------

def round_up_to_f32(q64: np.ndarray) -> np.ndarray:
    """Smallest float32 >= each float64 value (the step is 'rounded **up** to float32').

    The quotient ``a / L`` is computed in float64.  For a float32 ``a`` and L = 7 or 127
    the float64 quotient is never a float32 value unless the exact quotient is, and lies
    in the same float32 interval, so this is the round-up of the exact quotient (GAP 6).
    """
    q64 = np.asarray(q64, dtype=np.float64)
    f = q64.astype(np.float32)
    low = f.astype(np.float64) < q64
    f[low] = np.nextafter(f[low], np.float32(np.inf))
    return f


def block_steps(sent: np.ndarray, block: int, L: int) -> np.ndarray:
    """One float32 step per block of the sent values: largest magnitude / L, rounded up;
    0 for a block of zeros."""
    m = sent.size
    nb = -(-m // block)
    if nb == 0:
        return np.zeros(0, dtype=np.float32)
    mag = np.zeros(nb * block, dtype=np.float64)  # the text: float64 changes, their float64 magnitudes
    mag[:m] = np.abs(sent)
    largest = mag.reshape(nb, block).max(axis=1)
    # the text: float32(largest / L) to nearest, then one float32 up where step * L < largest
    # (both in float64, where step * L is exact)
    steps = (largest / L).astype(np.float32)
    short = steps.astype(np.float64) * L < largest
    steps[short] = np.nextafter(steps[short], np.float32(np.inf))
    return steps


def steps_per_value(steps: np.ndarray, block: int, m: int) -> np.ndarray:
    """Block ``b`` holds sent values ``b*block ... min((b+1)*block, m) - 1``."""
    return np.repeat(steps, block)[:m]


def stochastic_levels(sent: np.ndarray, step_v: np.ndarray, L: int, u: np.ndarray) -> np.ndarray:
    """Level ``floor(s) + 1`` with probability ``s - floor(s)``, else ``floor(s)``,
    ``s = x / step``.

    Choices (GAP 1, GAP 4, GAP 5): ``s`` is computed in float64 from the float32 value and the
    float32 step; one uniform ``u`` in [0, 1) per sent value; up iff ``u < s - floor(s)``
    (so an integer ``s`` never moves, and ``|q| <= L`` always); a zero step gives level 0.
    """
    x = sent.astype(np.float64)
    st = step_v.astype(np.float64)
    s = np.zeros_like(x)
    nz = st > 0
    s[nz] = x[nz] / st[nz]
    fl = np.floor(s)
    q = fl + (np.asarray(u, dtype=np.float64) < (s - fl))
    q = q.astype(np.int64)
    if q.size and np.abs(q).max() > L:  # cannot happen with a rounded-up step
        raise AssertionError("level past L")
    return q


def pack_codes(codes: np.ndarray, bits: int) -> bytes:
    """8 bits: one byte a code.  4 bits: ``byte = c[2j] | c[2j+1] << 4``, a zero high
    nibble after an odd count."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes.tobytes()
    if codes.size % 2:
        codes = np.concatenate([codes, np.zeros(1, dtype=np.uint8)])
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8).tobytes()


def payload_bytes(m: int, bits: int) -> int:
    return m if bits == 8 else (m + 1) // 2


def unpack_codes(part: bytes, m: int, bits: int, name: str) -> np.ndarray:
    """The inverse of ``pack_codes``; refuses a code 0 and a non-zero padding nibble."""
    b = np.frombuffer(part, dtype=np.uint8)
    if bits == 8:
        codes = b.copy()
    else:
        codes = np.empty(b.size * 2, dtype=np.uint8)
        codes[0::2] = b & 0x0F
        codes[1::2] = b >> 4
        if m % 2:
            if codes[m] != 0:
                raise CodecError("malformed", f"{name}: non-zero padding nibble")
        codes = codes[:m]
    if codes.size and (codes == 0).any():
        raise CodecError("malformed", f"{name}: code 0")
    return codes


# --- the top-k index ---------------------------------------------------------------

def bitmap_encode(positions: np.ndarray, n: int) -> bytes:
    """Position ``p`` is bit ``p % 8`` (least significant first) of byte ``p // 8``."""
    bits = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
    bits[np.asarray(positions, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def varint_encode(v: int) -> bytes:
    """Unsigned LEB128: seven bits a byte, least significant group first."""
    if v < 0:
        raise ValueError("negative varint")
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        if v:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def gaps_of(positions: np.ndarray) -> list[int]:
    """``g_j = p_j - p_(j-1) - 1`` with ``p_(-1) = -1``."""
    prev = -1
    gaps = []
    for p in np.asarray(positions, dtype=np.int64).tolist():
        gaps.append(p - prev - 1)
        prev = p
    return gaps


def gaps_encode(positions: np.ndarray) -> bytes:
    return b"".join(varint_encode(g) for g in gaps_of(positions))


def choose_index(positions: np.ndarray, n: int) -> tuple[str, bytes]:
    """Whichever is smaller for that tensor, the bitmap on a tie."""
    bm = bitmap_encode(positions, n)
    gp = gaps_encode(positions)
    return ("gaps", gp) if len(gp) < len(bm) else ("bitmap", bm)


def varint_decode(buf: bytes, pos: int, what: str) -> tuple[int, int]:
    """One varint at ``buf[pos]`` (GAP 24); refuses a non-minimal (trailing zero group) or
    over-long (more than 5 bytes) varint, and one that runs past the stream."""
    value = 0
    for i in range(VARINT_MAX_BYTES):
        if pos + i >= len(buf):
            raise CodecError("malformed", f"{what}: index stream too short")
        byte = buf[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i > 0 and byte == 0:
                raise CodecError("malformed", f"{what}: non-minimal varint")
            return value, pos + i + 1
    raise CodecError("malformed", f"{what}: varint longer than {VARINT_MAX_BYTES} bytes")


# --------------------------------------------------------------------------------------
# 3. The encoder
# --------------------------------------------------------------------------------------

def kept_count(n: int, keep: float) -> int:
    """``max(1, ceil(keep * n))``, computed as the float64 product (GAP 9), and never
    more than ``n`` (an empty tensor keeps 0: GAP 10)."""
    return min(n, max(1, math.ceil(keep * n)))


def top_k_positions(change: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest magnitudes, ties to the earlier position, in ascending order."""
    order = np.argsort(-np.abs(change), kind="stable")[:k]
    return np.sort(order)


@dataclass
class TensorParts:
    """One compressed tensor's header entry and its parts of the three streams."""

    name: str
    shape: tuple[int, ...]
    payload: bytes
    scales: np.ndarray  # float32
    kept: int | None = None
    index_kind: str | None = None
    index: bytes = b""

    def header_entry(self) -> dict:
        e = {"name": self.name, "shape": list(self.shape), "dtype": "float32"}
        if self.kept is not None:
            e["kept"] = self.kept
            e["index"] = self.index_kind
        return e


def encode_tensor(name: str, change: np.ndarray, codec: str, block: int,
                  keep: float | None, rng) -> TensorParts:
    """Encode one tensor's float32 change.  ``rng`` is anything with ``.random(size)``
    returning float64 uniforms in [0, 1) (a ``numpy.random.Generator``); it is called once
    per tensor, for its ``m`` sent values, in the order they are sent (GAP 1)."""
    bits, topk = CODECS[codec]
    change = np.asarray(change)
    if change.dtype not in (np.float32, np.float64):
        raise TypeError(f"{name}: the change must be float32 or float64")
    flat = change.reshape(-1).astype(np.float64)  # the text: changes are computed and scaled in float64
    if not np.isfinite(flat).all():
        raise ValueError(f"{name}: a change that is not finite cannot be encoded (GAP 14)")
    n = flat.size
    L = levels_of(bits)
    if topk:
        if keep is None or not (0.0 < keep < 1.0):
            raise ValueError("top-k needs keep in (0, 1)")
        positions = top_k_positions(flat, kept_count(n, keep))
        sent = flat[positions]
    else:
        positions = None
        sent = flat
    m = sent.size
    steps = block_steps(sent, block, L)
    u = rng.random(m)
    q = stochastic_levels(sent, steps_per_value(steps, block, m), L, u)
    codes = (q + code_offset(bits)).astype(np.uint8)
    parts = TensorParts(name, tuple(change.shape), pack_codes(codes, bits), steps)
    if topk:
        parts.kept = m
        parts.index_kind, parts.index = choose_index(positions, n)
    return parts


def is_exact(name: str, value: np.ndarray, reference: dict, exact_prefixes=()) -> bool:
    """Exact tensors (COMPRESSION.md "In the code", PROTOCOL "Compressed updates").

    A prefix ``p`` covers ``p`` itself and every name that starts with ``p + "."``
    (GAP 16); a reference tensor of another dtype or shape also makes the tensor exact
    (GAP 17).
    """
    if name.rsplit(".", 1)[-1] in BN_STATS:
        return True
    if np.asarray(value).dtype != np.float32:
        return True
    ref = reference.get(name)
    if ref is None:
        return True
    ref = np.asarray(ref)
    if ref.dtype != np.float32 or ref.shape != np.asarray(value).shape:
        return True
    return any(name == p or name.startswith(p + ".") for p in exact_prefixes)


@dataclass
class Encoded:
    """A frame: the codec header and the body's arrays (name -> numpy array)."""

    header: dict
    arrays: dict = field(default_factory=dict)
    parts: list = field(default_factory=list)

    def header_json(self) -> str:
        return header_json(self.header)


def header_json(header: dict) -> str:
    """Compact JSON: the serialization under which the q4 example's header is 114 bytes
    (GAP 3)."""
    return json.dumps(header, separators=(",", ":"), ensure_ascii=False)


def assemble(codec: str, block: int, parts: list[TensorParts], exact: dict) -> Encoded:
    """Header and arrays: each stream is the tensors' parts in header order, nothing
    between them.  Streams are present (maybe empty) for every codec but ``none``."""
    bits, topk = CODECS[codec]
    header = {"codec": codec, "block": block,
              "tensors": [p.header_entry() for p in parts],
              "exact": list(exact)}
    arrays = {k: np.asarray(v) for k, v in exact.items()}
    if bits is not None:
        arrays[PAYLOAD] = np.frombuffer(b"".join(p.payload for p in parts), dtype=np.uint8).copy()
        sc = [p.scales for p in parts]
        arrays[SCALES] = (np.concatenate(sc) if sc else np.zeros(0)).astype(np.float32)
        if topk:
            arrays[INDEX] = np.frombuffer(b"".join(p.index for p in parts), dtype=np.uint8).copy()
    return Encoded(header, arrays, parts)


def encode_changes(changes: dict, exact: dict, codec: str, block: int = 256,
                   keep: float | None = None, rng=None) -> Encoded:
    """Encode float32 changes (header order = ``changes``' order, GAP 15) plus exact
    tensors."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    if not (isinstance(block, int) and BLOCK_MIN <= block <= BLOCK_MAX):
        raise ValueError("block out of range")
    bits, _ = CODECS[codec]
    if bits is None:
        if changes:
            raise ValueError("codec none sends every tensor exact")
        return assemble(codec, block, [], exact)
    parts = [encode_tensor(k, v, codec, block, keep, rng) for k, v in changes.items()]
    return assemble(codec, block, parts, exact)


def split_update(update: dict, reference: dict, codec: str, exact_prefixes=()):
    """(float32 changes of the compressed tensors, exact tensors), in ``update``'s order."""
    changes, exact = {}, {}
    for name, value in update.items():
        value = np.asarray(value)
        if codec == "none" or is_exact(name, value, reference, exact_prefixes):
            exact[name] = value
        else:
            # the text: the change is float64(update) - float64(reference), exact in float64
            changes[name] = value.astype(np.float64) - np.asarray(reference[name]).astype(np.float64)
    return changes, exact


def encode_update(update: dict, reference: dict, codec: str, block: int = 256,
                  keep: float | None = None, rng=None, exact_prefixes=()) -> Encoded:
    """An agent's update as a frame: ``change = float32(update - reference)``."""
    changes, exact = split_update(update, reference, codec, exact_prefixes)
    return encode_changes(changes, exact, codec, block, keep, rng)


# --------------------------------------------------------------------------------------
# 4. The decoder
# --------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(header) -> tuple[str, int | None, bool, int, list, list]:
    """Structure and ranges of a codec header; ``malformed`` otherwise (empty tensors and
    the range of ``kept``: GAP 10; ``none`` and empty streams: GAP 18).

    Unknown keys are ignored (GAP 19); ``kept``/``index`` in a dense codec's entry, a
    missing field, or a name starting with ``codec:`` are malformed (GAP 19, GAP 20)."""
    if not isinstance(header, dict):
        raise CodecError("malformed", "the codec header is not an object")
    for key in ("codec", "block", "tensors", "exact"):
        if key not in header:
            raise CodecError("malformed", f"header lacks {key!r}")
    codec = header["codec"]
    if not isinstance(codec, str) or codec not in CODECS:
        raise CodecError("malformed", f"unknown codec {codec!r}")
    bits, topk = CODECS[codec]
    block = header["block"]
    if not _is_int(block) or not BLOCK_MIN <= block <= BLOCK_MAX:
        raise CodecError("malformed", f"block {block!r} out of range")
    tensors, exact = header["tensors"], header["exact"]
    if not isinstance(tensors, list) or not isinstance(exact, list):
        raise CodecError("malformed", "tensors and exact must be arrays")
    if bits is None and tensors:
        raise CodecError("malformed", "codec none compresses no tensor")
    names = []
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise CodecError("malformed", "a tensor entry without a name")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CodecError("malformed", f"{t['name']}: shape {shape!r}")
        if "dtype" not in t:
            raise CodecError("malformed", f"{t['name']}: no dtype")
        if topk:
            n = math.prod(shape)
            kept = t.get("kept")
            if not _is_int(kept) or not 0 <= kept <= n:
                raise CodecError("malformed", f"{t['name']}: kept {kept!r} out of range")
            if t.get("index") not in ("bitmap", "gaps"):
                raise CodecError("malformed", f"{t['name']}: index {t.get('index')!r}")
        elif "kept" in t or "index" in t:
            raise CodecError("malformed", f"{t['name']}: kept/index without top-k")
        names.append(t["name"])
    if not all(isinstance(e, str) for e in exact):
        raise CodecError("malformed", "exact names must be strings")
    names += exact
    if len(set(names)) != len(names):
        raise CodecError("malformed", "a name appears twice")
    if any(nm.startswith(CODEC_PREFIX) for nm in names):
        raise CodecError("malformed", "a tensor named codec:...")
    return codec, bits, topk, block, tensors, exact


def _stream(arrays: dict, name: str, kind: str, itemsize: int) -> np.ndarray:
    a = np.asarray(arrays[name])
    if a.dtype.kind != kind or a.dtype.itemsize != itemsize or a.ndim != 1:
        raise CodecError("malformed", f"{name}: wrong dtype or not 1-D ({a.dtype}, {a.shape})")
    return a


@dataclass
class _Cursor:
    buf: bytes
    pos: int = 0

    def take(self, k: int, what: str) -> bytes:
        if self.pos + k > len(self.buf):
            raise CodecError("malformed", f"{what}: stream too short")
        out = self.buf[self.pos:self.pos + k]
        self.pos += k
        return out


def read_index(cur: _Cursor, kind: str, n: int, kept: int, name: str) -> np.ndarray:
    """Kept positions (ascending) of one tensor from the index stream."""
    if kind == "bitmap":
        part = np.frombuffer(cur.take(-(-n // 8), f"{name} index"), dtype=np.uint8)
        bits = np.unpackbits(part, bitorder="little")
        if bits[n:].any():
            raise CodecError("malformed", f"{name}: padding bit set in the bitmap")
        positions = np.flatnonzero(bits[:n])
        if positions.size != kept:
            raise CodecError("malformed", f"{name}: bitmap has {positions.size} bits, kept {kept}")
        return positions
    positions = np.empty(kept, dtype=np.int64)
    p = -1
    for j in range(kept):
        g, cur.pos = varint_decode(cur.buf, cur.pos, f"{name} index")
        p = p + g + 1
        if p >= n:
            raise CodecError("malformed", f"{name}: kept position {p} past n = {n}")
        positions[j] = p
    return positions


def decode_changes(header: dict, arrays: dict) -> tuple[dict, dict]:
    """Every check that needs no reference, then each compressed tensor's float32 change
    ``float32(float32(q) * step)`` (zeros at unsent positions) and its steps per value.

    Returns ``(changes, info)``: name -> flat float32 change; name -> dict(steps per sent
    value, positions or None, levels)."""
    codec, bits, topk, block, tensors, exact = check_header(header)
    expected = set(exact)
    if bits is not None:
        expected |= {PAYLOAD, SCALES} | ({INDEX} if topk else set())
    if set(arrays) != expected:
        raise CodecError("malformed", f"arrays {sorted(arrays)} are not {sorted(expected)}")
    if bits is None:
        return {}, {}
    payload = _stream(arrays, PAYLOAD, "u", 1)
    scales = _stream(arrays, SCALES, "f", 4).astype(np.float32)
    if ((scales < 0) | ~np.isfinite(scales)).any():  # the text: -0.0 is a step of zero, not below zero
        raise CodecError("malformed", "a negative, NaN or Inf step")
    pay = _Cursor(payload.tobytes())
    idx = _Cursor(_stream(arrays, INDEX, "u", 1).tobytes()) if topk else None
    s_pos = 0
    off = code_offset(bits)
    changes, info = {}, {}
    for t in tensors:
        name = t["name"]
        n = math.prod(t["shape"])
        if topk:
            m = t["kept"]
            positions = read_index(idx, t["index"], n, m, name)
        else:
            m, positions = n, None
        codes = unpack_codes(pay.take(payload_bytes(m, bits), f"{name} payload"), m, bits, name)
        nb = -(-m // block)
        if s_pos + nb > scales.size:
            raise CodecError("malformed", f"{name} scales: stream too short")
        steps = scales[s_pos:s_pos + nb]
        s_pos += nb
        q = codes.astype(np.int64) - off
        step_v = steps_per_value(steps, block, m)
        with np.errstate(over="ignore"):
            sent = q.astype(np.float32) * step_v  # one float32 multiplication
        flat = np.zeros(n, dtype=np.float32)
        if topk:
            flat[positions] = sent
        else:
            flat[:] = sent
        changes[name] = flat
        info[name] = {"step": step_v, "positions": positions, "levels": q}
    if pay.pos != len(pay.buf) or s_pos != scales.size or (topk and idx.pos != len(idx.buf)):
        raise CodecError("malformed", "a stream too long")
    return changes, info


def decode(header: dict, arrays: dict, reference: dict) -> dict:
    """The update (or task, or run values): ``float32(reference + change)`` per position
    for the compressed tensors, the exact tensors as they are (signed zeros: GAP 13).

    Order of refusals (GAP 12): every ``malformed`` check, then ``wrong_tensors`` /
    ``wrong_shape``, then ``non_finite``."""
    changes, _ = decode_changes(header, arrays)
    for t in header["tensors"]:
        name = t["name"]
        if name not in reference:
            raise CodecError("wrong_tensors", f"{name}: not in the reference")
        ref = np.asarray(reference[name])
        if t["dtype"] != "float32" or ref.dtype != np.float32 or list(ref.shape) != t["shape"]:
            raise CodecError("wrong_shape", f"{name}: {t['shape']} {t['dtype']} vs reference "
                                            f"{list(ref.shape)} {ref.dtype}")
    out = {}
    for t in header["tensors"]:
        name = t["name"]
        ref = np.asarray(reference[name], dtype=np.float32).reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):
            value = ref + changes[name]  # one float32 addition
        if not np.isfinite(value).all():
            raise CodecError("non_finite", f"{name}: a decoded value past float32's range")
        out[name] = value.reshape(t["shape"])
    for name in header["exact"]:
        out[name] = np.asarray(arrays[name])
    return out


# --------------------------------------------------------------------------------------
# 5. Error feedback (on the device)
# --------------------------------------------------------------------------------------

class ErrorFeedback:
    """EF-SGD (GAP 25, GAP 26; the text now): encode ``target = change + residual`` (the float64
    change plus the float32 residual), keep ``residual = float32(target - (decode(frame,
    reference) - reference))``. Reset (to zeros) when the compressed tensors' names or shapes change."""

    def __init__(self):
        self.residual: dict[str, np.ndarray] = {}

    def encode(self, update: dict, reference: dict, codec: str, block: int = 256,
               keep: float | None = None, rng=None, exact_prefixes=()) -> Encoded:
        changes, exact = split_update(update, reference, codec, exact_prefixes)
        shapes = {k: v.shape for k, v in changes.items()}
        if shapes != {k: v.shape for k, v in self.residual.items()}:
            self.residual = {k: np.zeros(s, dtype=np.float32) for k, s in shapes.items()}
        target = {k: v + self.residual[k] for k, v in changes.items()}  # float64
        enc = encode_changes(target, exact, codec, block, keep, rng)
        decoded = decode(enc.header, enc.arrays, reference)
        self.residual = {
            k: (target[k] - (decoded[k].astype(np.float64) - np.asarray(reference[k]).astype(np.float64)))
            .astype(np.float32) for k in target}
        return enc


# --------------------------------------------------------------------------------------
# 6. Task deltas (since 1.7)
# --------------------------------------------------------------------------------------

def stream_rng(seed: int, round_: int, tag: int) -> np.random.Generator:
    """``numpy.random.default_rng([seed, round, tag])`` (GAP 2: the text names the list,
    not the constructor)."""
    return np.random.default_rng([seed, round_, tag])


def round_state(previous: dict, new: dict, codec: str, block: int, seed: int, round_: int,
                exact_prefixes=()) -> tuple[dict, Encoded]:
    """The coordinator's rounding of a round's new global state onto the grid of its change
    from ``previous`` (the state the round's tasks carried).  Returns the adopted
    (decoded) state and the frame whose streams every task delta of the next round reuses.
    """
    if codec not in ("q8", "q4"):
        raise ValueError("compression.downlink is q8 or q4")
    enc = encode_update(new, previous, codec, block, None,
                        stream_rng(seed, round_, TASK_DELTA_STREAM), exact_prefixes)
    return decode(enc.header, enc.arrays, previous), enc


def task_delta_frame(rounding: Encoded, task: dict) -> tuple[dict, dict]:
    """A task delta's ``downlink.codec`` header and body for one agent: the rounding's
    compressed tensors that the task carries (their stream parts, in the rounding's order),
    every other task tensor exact (GAP 21)."""
    parts = [p for p in rounding.parts if p.name in task]
    names = {p.name for p in parts}
    exact = {k: v for k, v in task.items() if k not in names}
    enc = assemble(rounding.header["codec"], rounding.header["block"], parts, exact)
    return enc.header, enc.arrays


def tensors_digest(tensors: dict) -> str:
    """(GAP 22) SHA-256 over the tensors in the order of their names' UTF-8 bytes; per tensor:
    name, 0, numpy dtype string (little-endian), 0, shape joined by ',', 0, C-order
    little-endian values."""
    h = hashlib.sha256()
    for name in sorted(tensors, key=lambda s: s.encode("utf-8")):
        a = np.asarray(tensors[name])
        le = a.dtype.newbyteorder("<")
        h.update(name.encode("utf-8") + b"\0")
        h.update(le.str.encode("ascii") + b"\0")
        h.update(",".join(str(d) for d in a.shape).encode("ascii") + b"\0")
        h.update(np.ascontiguousarray(a, dtype=le).tobytes())
    return h.hexdigest()


def apply_task_delta(base_task: dict, downlink: dict, body: dict) -> dict:
    """The agent: decode onto its base task's tensors, take the exact ones, check the
    digest; ``no_base`` for anything it cannot apply."""
    try:
        tensors = decode(downlink["codec"], body, base_task)
    except CodecError as e:
        raise DeltaRefused("no_base", str(e)) from e
    if tensors_digest(tensors) != downlink["digest"]:
        raise DeltaRefused("no_base", "digest differs")
    return tensors


# --------------------------------------------------------------------------------------
# 7. Release deltas (since 1.7)
# --------------------------------------------------------------------------------------

def check_runs(runs, size: int) -> list[tuple[int, int]]:
    """``[offset, count]`` pairs, at most 65 536, increasing and non-overlapping, inside
    an artifact of ``size`` bytes (the text: count >= 0, adjacent runs allowed)."""
    if not isinstance(runs, list) or len(runs) > RELEASE_MAX_RUNS:
        raise DeltaRefused("release", "runs")
    out, end = [], 0
    for r in runs:
        if (not isinstance(r, list) or len(r) != 2 or not all(_is_int(v) for v in r)
                or r[0] < end or r[1] < 0 or r[0] + 4 * r[1] > size):
            raise DeltaRefused("release", f"run {r!r} does not fit")
        out.append((r[0], r[1]))
        end = r[0] + 4 * r[1]
    return out


def run_values(artifact: bytes, offset: int, count: int) -> np.ndarray:
    return np.frombuffer(artifact, dtype="<f4", count=count, offset=offset).astype(np.float32)


def apply_release_delta(base: bytes, delta: dict, arrays: dict, sha256: str) -> bytes:
    """A head agent rebuilding a release from its installed artifact ``base``."""
    if hashlib.sha256(base).hexdigest() != delta["base_sha256"]:
        raise DeltaRefused("release", "installed artifact is not the base")
    runs = check_runs(delta["runs"], len(base))
    header = delta["codec"]
    if not isinstance(header, dict) or header.get("codec") not in ("q8", "q4") or header.get("exact") != []:
        raise DeltaRefused("release", "delta.codec must be q8 or q4 without exact tensors")
    want = [(f"run-{i}", [c]) for i, (_, c) in enumerate(runs)]
    got = [(t.get("name"), t.get("shape")) for t in header.get("tensors", []) if isinstance(t, dict)]
    if got != want:
        raise DeltaRefused("release", "tensors are not run-0 ... run-<k-1> shaped [count]")
    reference = {f"run-{i}": run_values(base, o, c) for i, (o, c) in enumerate(runs)}
    try:
        decoded = decode(header, arrays, reference)
    except CodecError as e:
        raise DeltaRefused("release", str(e)) from e
    out = bytearray(base)
    for i, (o, c) in enumerate(runs):
        out[o:o + 4 * c] = decoded[f"run-{i}"].astype("<f4").tobytes()
    out = bytes(out)
    if hashlib.sha256(out).hexdigest() != sha256:
        raise DeltaRefused("release", "the result hashes otherwise")
    return out


def make_release(previous: bytes | None, export: bytes, runs, codec: str, block: int,
                 seed: int, round_: int) -> tuple[bytes, dict | None, dict]:
    """The coordinator: the artifact it releases, the ``delta`` (without ``base``) and the
    delta body; ``(export, None, {})`` when the release goes whole."""
    if previous is None or codec == "none" or len(previous) != len(export):
        return export, None, {}
    runs = check_runs([list(r) for r in runs], len(export))
    mask = np.ones(len(export), dtype=bool)
    for o, c in runs:
        mask[o:o + 4 * c] = False
    pv, ev = np.frombuffer(previous, np.uint8), np.frombuffer(export, np.uint8)
    if (pv[mask] != ev[mask]).any():  # differs outside the weights: whole
        return export, None, {}
    names = [f"run-{i}" for i in range(len(runs))]
    base_v = {nm: run_values(previous, o, c) for nm, (o, c) in zip(names, runs)}
    new_v = {nm: run_values(export, o, c) for nm, (o, c) in zip(names, runs)}
    rng = stream_rng(seed, round_, RELEASE_DELTA_STREAM)
    with np.errstate(over="ignore", invalid="ignore"):
        changes = {nm: (new_v[nm] - base_v[nm]).astype(np.float32) for nm in names}
    enc = encode_changes(changes, {}, codec, block, None, rng)
    decoded = decode(enc.header, enc.arrays, base_v)
    out = bytearray(previous)
    for nm, (o, c) in zip(names, runs):
        out[o:o + 4 * c] = decoded[nm].astype("<f4").tobytes()
    delta = {"base_sha256": hashlib.sha256(previous).hexdigest(),
             "runs": [[o, c] for o, c in runs], "codec": enc.header}
    return bytes(out), delta, enc.arrays


# --------------------------------------------------------------------------------------
# 8. A minimal safetensors body (PROTOCOL §6)
# --------------------------------------------------------------------------------------

ST_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "I32": "<i4",
             "U8": "|u1", "BOOL": "|b1"}
ST_CODES = {np.dtype(v).str: k for k, v in ST_DTYPES.items()}


def dump_body(arrays: dict) -> bytes:
    """8-byte LE header length, JSON header padded with spaces to a multiple of 8, data
    little-endian C order (tensors in name order; the order carries no meaning)."""
    head, data, off = {}, [], 0
    for name in sorted(arrays):
        a = np.asarray(arrays[name])
        le = a.dtype.newbyteorder("<")
        raw = np.ascontiguousarray(a, dtype=le).tobytes()
        head[name] = {"dtype": ST_CODES[le.str], "shape": list(a.shape),
                      "data_offsets": [off, off + len(raw)]}
        data.append(raw)
        off += len(raw)
    js = json.dumps(head, separators=(",", ":")).encode("utf-8")
    js += b" " * (-len(js) % 8)
    return len(js).to_bytes(8, "little") + js + b"".join(data)


def load_body(blob: bytes) -> dict:
    n = int.from_bytes(blob[:8], "little")
    head = json.loads(blob[8:8 + n].decode("utf-8"))
    head.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, e in head.items():
        b, end = e["data_offsets"]
        dt = np.dtype(ST_DTYPES[e["dtype"]])
        out[name] = np.frombuffer(data[b:end], dtype=dt).reshape(e["shape"]).copy()
    return out
