"""Release deltas (protocol 1.7): the next encoder release sent as the change of its weights
from the release a head agent has installed, so that a device re-downloads a quarter or
less of an encoder after each round of training, and still installs exactly the artifact
the coordinator signed.

An exported encoder is an ONNX file whose float32 initializers are stored as raw
little-endian bytes. Between two releases of one run the graph is the same; only those
bytes change. So a delta is:

* **runs**: the byte offset in the base artifact and the value count of every float32
  initializer's raw data (found on the coordinator with the ``onnx`` package; a device
  never parses ONNX);
* the changes of those values, **quantized** by a codec of :mod:`edgepfl.codecs` (one
  compressed tensor ``run-<i>`` per run, in run order).

Quantizing loses a little, so the coordinator does not release the encoder it exported
but the one a device rebuilds: ``float32(base + dequantized change)`` written over the
base's bytes (:func:`make_release_delta`). That artifact is the release — the full copy
retained at the broker carries the same bytes, and its sha256 is what the release's
signed meta names — so a device that applies the delta (:func:`apply_release_delta`) gets
a file whose hash it can check against the signed one. The next delta is taken from the
release, not from the exported encoder, so the quantization error does not add up over
releases: a release differs from the model it was exported from by at most one step of
its own delta. A device whose installed artifact is not the delta's base, or whose result
does not hash to the signed value, refuses it, and the coordinator sends it the full
release.

No delta is made (None) when the base and the new export differ anywhere outside the
float32 runs (another architecture, another exporter, or a graph change): then every
device gets the full release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .codecs import CodecError, CodecSpec, Encoded, decode, encode_changes
from .protocol.codec import DELTA_CODECS

__all__ = ["ReleaseDeltaParts", "apply_release_delta", "make_release_delta", "weight_runs"]

_FLOAT = 1  # onnx.TensorProto.FLOAT
_RAW_DATA_TAG = 0x4A  # TensorProto field 9 (raw_data), wire type 2 (length-delimited)


@dataclass(frozen=True)
class ReleaseDeltaParts:
    """A delta made by :func:`make_release_delta`."""

    #: the artifact to release: the base with the dequantized changes written over its runs
    artifact: bytes
    #: (byte offset, float32 count) of each run, in the order of the encoded tensors
    runs: tuple[tuple[int, int], ...]
    #: the runs' changes, tensor ``run-<i>`` for run ``i``
    encoded: Encoded


def weight_runs(artifact: bytes) -> tuple[tuple[int, int], ...] | None:
    """(byte offset, float32 count) of the raw data of each float32 initializer of an ONNX
    file, in file order; None when the file cannot be parsed or a raw data block cannot be
    located. Needs the ``onnx`` package (the coordinator's side)."""
    import onnx

    try:
        model = onnx.load_from_string(artifact)
    except Exception:  # onnx raises DecodeError and others for a file that is not ONNX
        return None
    runs: list[tuple[int, int]] = []
    cursor = 0
    for tensor in model.graph.initializer:
        raw = tensor.raw_data
        if tensor.data_type != _FLOAT or not raw:
            continue
        # the field as serialized: tag, length, bytes. Searched from the previous one on, since
        # initializers are written in order; the tag and length make a false match implausible
        needle = bytes([_RAW_DATA_TAG]) + _varint(len(raw)) + raw
        found = artifact.find(needle, cursor)
        if found < 0:
            return None
        offset = found + len(needle) - len(raw)
        runs.append((offset, len(raw) // 4))
        cursor = offset + len(raw)
    return tuple(runs)


def make_release_delta(base: bytes, exported: bytes, spec: CodecSpec, rng: np.random.Generator) -> ReleaseDeltaParts | None:
    """The delta from the installed release ``base`` to the newly ``exported`` encoder, and
    the artifact it stands for (module docstring); None when the two differ outside their
    float32 runs, or ``spec`` is not one of :data:`DELTA_CODECS`."""
    if spec.name not in DELTA_CODECS or len(base) != len(exported):
        return None
    runs = weight_runs(exported)
    if runs is None or weight_runs(base) != runs:
        return None
    if _outside_runs(base, runs) != _outside_runs(exported, runs):
        return None
    reference = _run_values(base, runs)
    target = _run_values(exported, runs)
    changes = {name: target[name].astype(np.float64) - value.astype(np.float64) for name, value in reference.items()}
    encoded = encode_changes(changes, {}, spec, rng)
    return ReleaseDeltaParts(_written(base, runs, decode(encoded, reference)), runs, encoded)


def apply_release_delta(base: bytes, runs: Sequence[tuple[int, int]], encoded: Encoded) -> bytes:
    """The artifact a delta stands for: ``float32(base + change)`` written over each run of
    ``base``. Raises :class:`~edgepfl.codecs.CodecError` when the runs do not fit ``base``
    (out of range, overlapping, out of order) or the encoded changes are not one per run
    of the run's length; whether the result is the release is its hash's to say."""
    end = 0
    for offset, count in runs:
        if offset < end or count < 0 or offset + 4 * count > len(base):
            raise CodecError("malformed", f"run ({offset}, {count}) does not fit a {len(base)}-byte base in order")
        end = offset + 4 * count
    names = [t.name for t in encoded.header.tensors]
    if names != [f"run-{i}" for i in range(len(runs))] or encoded.header.exact:
        raise CodecError("malformed", "a release delta compresses tensors run-0, run-1, … one per run, and no other")
    return _written(base, runs, decode(encoded, _run_values(base, runs)))


def _run_values(artifact: bytes, runs: Sequence[tuple[int, int]]) -> dict[str, np.ndarray]:
    return {f"run-{i}": np.frombuffer(artifact, dtype="<f4", count=count, offset=offset).astype(np.float32)
            for i, (offset, count) in enumerate(runs)}


def _written(base: bytes, runs: Sequence[tuple[int, int]], values: Mapping[str, np.ndarray]) -> bytes:
    out = bytearray(base)
    for i, (offset, count) in enumerate(runs):
        out[offset: offset + 4 * count] = np.ascontiguousarray(values[f"run-{i}"], dtype="<f4").tobytes()
    return bytes(out)


def _outside_runs(artifact: bytes, runs: Sequence[tuple[int, int]]) -> bytes:
    pieces, at = [], 0
    for offset, count in runs:
        pieces.append(artifact[at:offset])
        at = offset + 4 * count
    pieces.append(artifact[at:])
    return b"".join(pieces)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)
