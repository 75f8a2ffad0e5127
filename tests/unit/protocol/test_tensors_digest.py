"""A task delta's digest (edgepfl.protocol.codec.tensors_digest) is what docs/COMPRESSION.md,
"Task deltas", says it is: recomputed here from the text with hashlib alone."""

from __future__ import annotations

import hashlib

import numpy as np

from edgepfl.protocol.codec import tensors_digest


def from_the_text(tensors: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors, key=lambda n: n.encode("utf-8")):
        value = tensors[name]
        dtype = {"float32": "<f4", "int64": "<i8", "uint8": "|u1"}[str(value.dtype)]
        shape = ",".join(str(d) for d in value.shape)
        digest.update(name.encode("utf-8") + b"\0" + dtype.encode() + b"\0" + shape.encode() + b"\0")
        digest.update(value.astype(value.dtype.newbyteorder("<")).tobytes(order="C"))
    return digest.hexdigest()


def test_the_digest_is_the_documented_one_and_ignores_the_tensors_order():
    tensors = {"encoder.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
               "bn.num_batches_tracked": np.array(7, dtype=np.int64),
               "Zeta": np.array([1, 2], dtype=np.uint8),
               "server/µ": np.array([0.5], dtype=np.float32)}
    assert tensors_digest(tensors) == from_the_text(tensors)
    assert tensors_digest(dict(reversed(tensors.items()))) == tensors_digest(tensors)
    # a big-endian or Fortran-ordered copy of the same values digests alike: the values count, not the layout
    same = {**tensors, "encoder.weight": np.asfortranarray(tensors["encoder.weight"].astype(">f4"))}
    assert tensors_digest(same) == tensors_digest(tensors)


def test_a_changed_value_name_dtype_or_shape_changes_the_digest():
    base = {"w": np.zeros((2, 3), np.float32)}
    digest = tensors_digest(base)
    for other in ({"w": np.full((2, 3), 1e-30, np.float32)}, {"v": base["w"]}, {"w": base["w"].reshape(3, 2)},
                  {"w": base["w"].astype(np.float64)}, {**base, "x": np.zeros(0, np.float32)}):
        assert tensors_digest(other) != digest
