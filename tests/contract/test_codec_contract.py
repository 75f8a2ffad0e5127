"""Contract suite: every codec of the table (:data:`edgepfl.codec_stages.CODECS`), present and
future, through the same checks.

A codec round-trips any finite update within the error bound its stages state (below,
:data:`STATED_BOUNDS`), sends the tensors it does not compress bit for bit, refuses what it
cannot encode, and refuses every malformed frame with a reason; the five codecs of protocol
1.6 write the same bytes as the code before the table (:data:`GOLDEN`). The table is the one
list of codec names: the wire's types, the run config and the docs agree with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import typing
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from edgepfl.codec_stages import CODECS, DELTA_CODECS, STREAMS, Quantize, Stage, TopK, is_sparse, streams_of
from edgepfl.codecs import (
    INDEX,
    PAYLOAD,
    SCALES,
    CodecError,
    CodecSpec,
    Encoded,
    ErrorFeedback,
    decode,
    dequantize,
    encode,
    exact_names,
)
from edgepfl.protocol.codec import tensors_digest

ROOT = Path(__file__).resolve().parents[2]
NAMES = list(CODECS)


# --------------------------------------------------------------------------- the table
def _literal_names(model: type, field: str) -> tuple:
    annotation = model.model_fields[field].annotation
    while typing.get_origin(annotation) is not typing.Literal:  # list[...], ... | None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return typing.get_args(annotation)


def test_the_wire_types_and_the_config_read_their_names_from_the_table():
    from edgepfl.config import CompressionSpec
    from edgepfl.protocol.codec import CODEC_NAMES, CodecHeader, UplinkSpec
    from edgepfl.protocol.messages import Capabilities

    assert CODEC_NAMES == tuple(CODECS)
    for model, field in ((CodecHeader, "codec"), (UplinkSpec, "codec"), (Capabilities, "codecs"),
                         (CompressionSpec, "uplink")):
        assert _literal_names(model, field) == tuple(CODECS), (model.__name__, field)
    assert _literal_names(Capabilities, "release_codecs") == DELTA_CODECS
    assert _literal_names(CompressionSpec, "release_delta") == _literal_names(CompressionSpec, "downlink") == (
        "none", *DELTA_CODECS)
    assert DELTA_CODECS and all(CODECS[name] and not is_sparse(name) for name in DELTA_CODECS)


def test_the_compression_doc_lists_every_codec_of_the_table():
    text = (ROOT / "docs" / "COMPRESSION.md").read_text()
    section = text.split("\n## Codecs\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `([^`]+)` \|", section, re.M) == NAMES


# --------------------------------------------------------------------------- stated bounds
#: per stage class, what it promises a tensor's values decode to: given the values it is
#: handed (float64, flat) and the parameters, the decoded value's centre and how far from it
#: each may land; ``inner`` states the stages after it for the values it passes on
Bound = tuple[np.ndarray, np.ndarray]


def quantize_bound(stage: Quantize, values: np.ndarray, spec: CodecSpec, inner: Callable[[np.ndarray], Bound]) -> Bound:
    """Each value within one step of itself; a block's step is its largest magnitude over
    the levels, rounded up to float32 (a subnormal step by up to 2**-149), and decoding
    rounds ``level * step`` to float32 once."""
    blocks = -(-values.size // spec.block)
    padded = np.zeros(blocks * spec.block)
    padded[: values.size] = np.abs(values)
    largest = np.repeat(padded.reshape(blocks, spec.block).max(axis=1), spec.block)[: values.size]
    step = largest / stage.levels * (1 + 2**-23) + 2.0**-149
    return values, step * (1 + stage.levels * 2**-23)


def top_k_bound(stage: TopK, values: np.ndarray, spec: CodecSpec, inner: Callable[[np.ndarray], Bound]) -> Bound:
    """The ``keep`` share of largest magnitudes (at least one; ties: the earlier position)
    as the stages after it decode them, and exactly no change everywhere else."""
    assert spec.keep is not None
    k = max(1, math.ceil(spec.keep * values.size)) if values.size else 0
    kept = np.sort(np.argsort(-np.abs(values), kind="stable")[:k])  # passed on in position order
    centre, spread = np.zeros(values.size), np.zeros(values.size)
    centre[kept], spread[kept] = inner(values[kept])
    return centre, spread


STATED_BOUNDS: dict[type[Stage], Callable] = {Quantize: quantize_bound, TopK: top_k_bound}


def stated_bound(stages: tuple[Stage, ...], values: np.ndarray, spec: CodecSpec) -> Bound:
    if not stages:
        return values, np.zeros(values.size)
    first, rest = stages[0], stages[1:]
    return STATED_BOUNDS[type(first)](first, values, spec, lambda passed: stated_bound(rest, passed, spec))


def test_every_stage_of_the_table_states_its_bound():
    used = {type(stage) for stages in CODECS.values() for stage in stages}
    assert used <= set(STATED_BOUNDS), f"state the error bound of {sorted(c.__name__ for c in used - set(STATED_BOUNDS))}"


# --------------------------------------------------------------------------- round trip
finite32 = st.one_of(
    st.just(0.0),
    st.floats(-(2.0**-126), 2.0**-126, width=32),  # subnormal and tiny
    st.floats(-1024, 1024, width=32),
    st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False),
)
EXACT_DTYPES = (np.float64, np.float16, np.int64, np.int32, np.uint8)


@st.composite
def updates(draw) -> tuple[dict, dict, set]:
    """(update, reference, marked exact): one to four float32 tensors of up to three
    dimensions of 0 to 9 values (unchanged, all zeros or random), a tensor of another dtype,
    a running statistic, a tensor the reference has not, and maybe one marked exact."""
    update, reference = {}, {}
    for i in range(draw(st.integers(1, 4))):
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9))
        ref = draw(hnp.arrays(np.float32, shape, elements=finite32))
        kind = draw(st.sampled_from(["random", "unchanged", "zeros"]))
        if kind == "random":
            new = draw(hnp.arrays(np.float32, shape, elements=finite32))
        else:
            new = ref.copy() if kind == "unchanged" else np.zeros(shape, np.float32)
        update[f"layer{i}.weight"], reference[f"layer{i}.weight"] = new, ref
    dtype = np.dtype(draw(st.sampled_from(EXACT_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=5))
    if dtype.kind == "f":
        other = draw(hnp.arrays(dtype, shape, elements=st.floats(-1e4, 1e4, width=16)))
    else:
        other = draw(hnp.arrays(dtype, shape))
    update["layer.other"], reference["layer.other"] = other, np.zeros(shape, dtype)
    update["bn.running_mean"] = draw(hnp.arrays(np.float32, (3,), elements=finite32))
    reference["bn.running_mean"] = np.zeros(3, np.float32)
    update["stat/x"] = draw(hnp.arrays(np.float32, (2,), elements=finite32))
    marked = {draw(st.sampled_from(sorted(update)))} if draw(st.booleans()) else set()
    return update, reference, marked


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(drawn=updates(), block=st.sampled_from([1, 3, 8, 256]), keep=st.sampled_from([0.01, 0.3, 0.9]),
       seed=st.integers(0, 2**32 - 1))
def test_every_codec_round_trips_within_its_stated_bound(name, drawn, block, keep, seed):
    update, reference, marked = drawn
    spec = CodecSpec.from_name(name, block=block, keep=keep)
    encoded = encode(update, reference, spec, np.random.default_rng(seed), exact=marked)
    received = Encoded.from_arrays(json.loads(json.dumps(encoded.header_fields())), encoded.arrays())
    decoded = decode(received, reference)
    assert decoded.keys() == update.keys()
    exact = set(update) if not CODECS[name] else exact_names(update, reference, marked)
    assert set(received.header.exact) == exact
    for tensor in exact:  # bit for bit, in their own dtype
        assert decoded[tensor].dtype == update[tensor].dtype and decoded[tensor].shape == update[tensor].shape
        assert decoded[tensor].tobytes() == np.asarray(update[tensor]).tobytes(), tensor
    changes = dequantize(received)
    assert changes.keys() == set(update) - exact
    for tensor, change in changes.items():
        true = update[tensor].astype(np.float64) - reference[tensor]
        centre, spread = stated_bound(CODECS[name], true.reshape(-1), spec)
        assert change.dtype == np.float32 and change.shape == true.shape
        assert (np.abs(change.reshape(-1).astype(np.float64) - centre) <= spread).all(), tensor
        assert decoded[tensor].dtype == np.float32 and np.isfinite(decoded[tensor]).all()
        assert decoded[tensor].tobytes() == (reference[tensor] + change).tobytes(), tensor  # one float32 addition


@pytest.mark.parametrize("name", NAMES)
def test_every_codec_refuses_what_it_cannot_encode(name):
    spec = CodecSpec.from_name(name, block=4, keep=0.5)
    reference = {"w": np.zeros(6, np.float32), "n": np.array(1, np.int64)}
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(ValueError, match=r"'w' holds NaN or Inf"):
            encode({**reference, "w": np.full(6, bad, np.float32)}, reference, spec, np.random.default_rng(0))
        with pytest.raises(ValueError, match=r"'w' holds NaN or Inf"):
            ErrorFeedback().encode({**reference, "w": np.full(6, bad, np.float32)}, reference, spec,
                                   np.random.default_rng(0))
    for other in (np.zeros(5, np.float32), np.zeros(6, np.float64)):
        with pytest.raises(ValueError, match="the update is"):
            encode({**reference, "w": other}, reference, spec, np.random.default_rng(0))
    with pytest.raises(ValueError, match="codec's own"):
        encode({**reference, "codec:x": np.zeros(2, np.float32)}, reference, spec, np.random.default_rng(0))


def test_a_spec_takes_keep_exactly_with_a_sparse_codec():
    for name in NAMES:
        assert CodecSpec.from_name(name, keep=0.05).keep == (0.05 if is_sparse(name) else None)
        with pytest.raises(ValueError, match="keep goes with a top-k codec"):
            CodecSpec(name=name, keep=None if is_sparse(name) else 0.05)
    with pytest.raises(ValueError, match="unknown codec 'q2'"):
        CodecSpec.from_name("q2")


# --------------------------------------------------------------------------- the bytes of protocol 1.6
#: (block, keep) of the golden cases: one value per step, an odd block, the default block
#: (top-k: gap indexes) and a small block (top-k: bitmaps and gaps)
GOLDEN_SETTINGS = ((1, 0.5), (7, 0.3), (256, 0.01), (16, 0.1))
#: :func:`golden_digest` as the codecs computed it before they were a table of stages (the
#: single-module edgepfl/codecs.py): the wire of protocol 1.6 stays what it was
GOLDEN = {
    "none": ("6e3f752911404ec6087fa3a58b73222a46af5478e83cffe0c3ae8f616ee72f3f",
             "04530b5c72dc9c3cb1296506419477d7e7b1cf1ddb0c5763c0d450eaed6318a0",
             "465f2c1575e24a9fb5c4c0489d0bd701461bc87d0265eb9051716c3ebb2ceb6f",
             "b2db0eb2cc8a6b11949c952d78eaa36fa5a23bcd6a1f171838990b7e2241e88c"),
    "q8": ("7ee235314686b90f253e95e1deccffda1a4f4de16cd319aad1d5b1a5246ca070",
           "de790b4e1c95a97820a9e7ed83b270775aa6f745c9045231eed558c041a88aa2",
           "9b1cee0768fde7f5e93687f7e1b088336b54a6495612c9a5ab5a73fea376b15d",
           "a32163ab8fddfd523130ce7b0214c7f35efeb1d508e4acb82b3d8dae3ccf52d9"),
    "q4": ("31d2e6de023499e80e3a9d8554f9448dbda99a0ab8b9f38520b2bb3378501473",
           "115f2a88b51510b3ef372210324beb204d510e29f1dfdbcf08ad3f91c84791f8",
           "89e9797802440240faaa04e7b5bbd9ec8d508682643fda3ecef733c2e8fa994f",
           "ccf928292f69c46621585c1f7f7b465b3f127bfd0752e670e15935738e92a1cb"),
    "topk+q8": ("88146e3a93cbdcb625be0a3ca5aa6ec4fa9cd28d2a009ecadf339e9c6232aefe",
                "18281b5a10a0021c4991b7173a77ceeb00c97522355148ad42a6f98c08155e1b",
                "08bf5d4c95d45b5a9eb1e5b868e77a460d1907e04da760c3d4dd6f4d660e4944",
                "66101eb7bebef2773a43e7feaeae45c0234fa2f90af161e4b2f8877f4e69eb97"),
    "topk+q4": ("51f741c6a335bc96d8bb76ebc60132cd02c73fcdc35f4040f92568e10deb7e6b",
                "9ff4075ab837c8c1599fb8e4405c7d0dc1f2c66ada067b620815f83d539f9cb3",
                "e765cfcb903c37b321b2dcc8b33b60699ba3dd4e454bf6cd714b26c9c366bee8",
                "f39567beee5142f5ca13b5cd687864af20c23d982a6c33e0fff65badecbcac7b"),
}


def golden_digest(codec: str, block: int, keep: float) -> str:
    """sha256 of everything ``codec`` writes and reads for a fixed-seed update: the frame
    (the header's compact JSON, each array's name, dtype, shape and bytes in the frame's
    order, :meth:`Encoded.sizes`), its decoded update and changes, and three rounds of error
    feedback (each frame, then the residual)."""
    rng = np.random.default_rng([block, 2024])
    shapes = {"a": (3, 5), "b": (1000,), "c": (), "d": (0,), "e": (2, 3, 4), "f": (37,), "g": (3000,)}
    reference = {name: rng.normal(0, 1, shape).astype(np.float32) for name, shape in shapes.items()}
    reference["bn.running_mean"] = rng.normal(0, 1, 8).astype(np.float32)
    reference["bn.num_batches_tracked"] = np.array(7, np.int64)
    reference["scale"] = rng.normal(0, 1, 5)  # float64: sent exact
    update = {name: (value + rng.normal(0, 0.05, value.shape)).astype(value.dtype) if value.dtype.kind == "f"
              else value + 1 for name, value in reference.items()}
    update["f"][[3, 30]] = [0.0, 40.0]  # a zero and an outlier in one block
    update["stat/x"] = rng.normal(0, 1, 6).astype(np.float32)  # no reference: sent exact
    spec = CodecSpec.from_name(codec, block=block, keep=keep)
    digest = hashlib.sha256()

    def add_frame(encoded: Encoded) -> None:
        digest.update(json.dumps(encoded.header_fields(), separators=(",", ":")).encode())
        for name, value in encoded.arrays().items():
            value = np.asarray(value)
            digest.update(f"{name}|{value.dtype.str}|{list(value.shape)}|".encode() + value.tobytes())
        sizes = encoded.sizes()
        digest.update(json.dumps([sorted(sizes.per_tensor.items()), sizes.header]).encode())

    encoded = encode(update, reference, spec, np.random.default_rng(block), exact=["a"])
    add_frame(encoded)
    received = Encoded.from_arrays(json.loads(json.dumps(encoded.header_fields())), encoded.arrays())
    digest.update(tensors_digest(decode(received, reference)).encode())
    digest.update(tensors_digest(dequantize(received)).encode())
    feedback = ErrorFeedback()
    for round_ in range(3):
        moved = {name: value + np.float32(0.01 * round_) if value.dtype == np.float32 else value
                 for name, value in reference.items()}
        add_frame(feedback.encode(update, moved, spec, np.random.default_rng(round_)))
    digest.update(tensors_digest(feedback.state_dict()).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_the_codecs_of_protocol_1_6_write_the_bytes_they_always_wrote(name):
    assert name in CODECS  # the wire set is closed: no name of 1.6 leaves the table
    got = tuple(golden_digest(name, block, keep) for block, keep in GOLDEN_SETTINGS)
    assert got == GOLDEN[name]


# --------------------------------------------------------------------------- malformed frames, any codec
def any_frame(name: str) -> tuple[dict, dict, dict]:
    """A frame of ``name`` with five compressed tensors (an odd count, a matrix, a single
    value, none, a zero change) and two exact ones."""
    rng = np.random.default_rng(31)
    reference = {"w": rng.normal(0, 1, 37).astype(np.float32), "m": rng.normal(0, 1, (4, 6)).astype(np.float32),
                 "s": np.float32(1.5), "e": np.zeros(0, np.float32), "z": np.ones(9, np.float32),
                 "n": np.array(3, np.int64), "h": np.ones(3, np.float16)}
    update = {k: (v + rng.normal(0, 0.1, np.shape(v))).astype(v.dtype) if k in "wmsh" else v + 1 if k == "n" else v
              for k, v in reference.items()}
    encoded = encode(update, reference, CodecSpec.from_name(name, block=5, keep=0.3), np.random.default_rng(0))
    return encoded.header_fields(), dict(encoded.arrays()), reference


def stream_mutations(name: str) -> dict[str, Callable[[dict, dict], tuple[dict, dict]]]:
    """Every way to spoil the body of a ``name`` frame that needs no knowledge of a stage."""
    out: dict[str, Callable[[dict, dict], tuple[dict, dict]]] = {}
    for stream, dtype in streams_of(name).items():
        wrong = np.float64 if dtype != np.float64 else np.uint8
        out.update({
            f"{stream} missing": lambda h, a, s=stream: (h, {k: v for k, v in a.items() if k != s}),
            f"{stream} empty": lambda h, a, s=stream: (h, {**a, s: a[s][:0]}),
            f"{stream} one short": lambda h, a, s=stream: (h, {**a, s: a[s][:-1]}),
            f"{stream} half": lambda h, a, s=stream: (h, {**a, s: a[s][: a[s].size // 2]}),
            f"{stream} one more": lambda h, a, s=stream: (h, {**a, s: np.append(a[s], a[s][-1:])}),
            f"{stream} twice": lambda h, a, s=stream: (h, {**a, s: np.concatenate([a[s], a[s]])}),
            f"{stream} dtype": lambda h, a, s=stream, d=wrong: (h, {**a, s: a[s].astype(d)}),
            f"{stream} 2-D": lambda h, a, s=stream: (h, {**a, s: a[s].reshape(1, -1)}),
        })
        if np.dtype(dtype).kind == "f":
            for bad in (np.nan, np.inf, -np.inf, -1.0):
                out[f"{stream} holds {bad}"] = lambda h, a, s=stream, b=bad: (h, {**a, s: np.where(
                    np.arange(a[s].size) == 1, b, a[s]).astype(a[s].dtype)})
    for stream, dtype in STREAMS.items():
        if stream not in streams_of(name):
            out[f"{stream} added"] = lambda h, a, s=stream, d=dtype: (h, {**a, s: np.zeros(3, d)})
    out["a stray array"] = lambda h, a: (h, {**a, "stray": np.zeros(1, np.float32)})
    out["an exact tensor missing"] = lambda h, a: (h, {k: v for k, v in a.items() if k != "n"})
    return out


def header_mutations(name: str) -> dict[str, Callable[[dict, dict], tuple[dict, dict]]]:
    """Every way to spoil the header of a ``name`` frame that needs no knowledge of a stage."""
    def tensor(h: dict, **fields) -> dict:
        first = {**h["tensors"][0], **fields}
        return {**h, "tensors": [{k: v for k, v in first.items() if v is not None}, *h["tensors"][1:]]}

    out: dict[str, Callable[[dict, dict], tuple[dict, dict]]] = {
        "unknown codec": lambda h, a: ({**h, "codec": "q2"}, a),
        "block 0": lambda h, a: ({**h, "block": 0}, a),
        "block past 2**20": lambda h, a: ({**h, "block": 2**20 + 1}, a),
        "unknown field": lambda h, a: ({**h, "level": 3}, a),
        "an exact tensor named twice": lambda h, a: ({**h, "exact": [*h["exact"], h["exact"][0]]}, a),
        "a reserved name": lambda h, a: ({**h, "exact": [*h["exact"], "codec:x"]}, {**a, "codec:x": a["n"]}),
    }
    for other in CODECS:  # another codec's label on this codec's frame
        if other != name:
            out[f"labelled {other}"] = lambda h, a, o=other: ({**h, "codec": o}, a)
    if CODECS[name]:
        out.update({
            "a tensor named twice": lambda h, a: ({**h, "tensors": [h["tensors"][0], *h["tensors"]]}, a),
            "a tensor missing": lambda h, a: ({**h, "tensors": h["tensors"][1:]}, a),
            "a negative dimension": lambda h, a: (tensor(h, shape=[-37]), a),
            "nine dimensions": lambda h, a: (tensor(h, shape=[1] * 9), a),
            "another dtype": lambda h, a: (tensor(h, dtype="float16"), a),
            "kept flipped": lambda h, a: (tensor(h, kept=None if is_sparse(name) else 3), a),
            "index flipped": lambda h, a: (tensor(h, index=None if is_sparse(name) else "bitmap"), a),
        })
    if is_sparse(name):
        out["kept past the tensor"] = lambda h, a: (tensor(h, kept=38), a)
        out["kept one less"] = lambda h, a: (tensor(h, kept=h["tensors"][0]["kept"] - 1), a)
        out["the other index form"] = lambda h, a: (tensor(h, index={"bitmap": "gaps", "gaps": "bitmap"}[
            h["tensors"][0]["index"]]), a)
    return out


def _cases(mutations: Callable[[str], dict]) -> list:
    return [pytest.param(name, case, id=f"{name}: {case}") for name in NAMES for case in sorted(mutations(name))]


@pytest.mark.parametrize(("name", "case"), _cases(stream_mutations) + _cases(header_mutations))
def test_every_codec_refuses_a_malformed_frame_with_reason_malformed(name, case):
    header, arrays, reference = any_frame(name)
    decode(Encoded.from_arrays(header, arrays), reference)  # unspoilt: fine
    mutate = {**stream_mutations(name), **header_mutations(name)}[case]
    header, arrays = mutate(header, arrays)
    with pytest.raises(CodecError) as caught:
        decode(Encoded.from_arrays(header, arrays), reference)
    assert caught.value.reason == "malformed", caught.value


@pytest.mark.parametrize("name", [name for name in NAMES if CODECS[name]])
def test_every_codec_refuses_a_frame_for_another_model(name):
    header, arrays, reference = any_frame(name)
    refusals = [
        ("wrong_tensors", {k: v for k, v in reference.items() if k != "w"}),
        ("wrong_shape", {**reference, "w": np.zeros(36, np.float32)}),
        ("wrong_shape", {**reference, "w": np.zeros((37, 1), np.float32)}),
        ("wrong_shape", {**reference, "w": reference["w"].astype(np.float64)}),
    ]
    for reason, other in refusals:
        with pytest.raises(CodecError) as caught:
            decode(Encoded.from_arrays(header, arrays), other)
        assert caught.value.reason == reason, caught.value


# --------------------------------------------------------------------------- malformed frames, each stage
def frame(name: str, values: int = 37, block: int = 16) -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(17)
    reference = {"w": rng.normal(0, 1, values).astype(np.float32), "n": np.array(3, np.int64)}
    update = {"w": (reference["w"] + rng.normal(0, 0.1, values)).astype(np.float32), "n": np.array(4, np.int64)}
    encoded = encode(update, reference, CodecSpec.from_name(name, block=block, keep=0.5), np.random.default_rng(0))
    return encoded.header_fields(), dict(encoded.arrays()), reference


def _with(arrays, name, value):
    return {**arrays, name: value}


MALFORMED = {
    "payload short": ("q8", lambda h, a: (h, _with(a, PAYLOAD, a[PAYLOAD][:-1])), "ends early"),
    "payload long": ("q8", lambda h, a: (h, _with(a, PAYLOAD, np.append(a[PAYLOAD], np.uint8(128)))), "longer"),
    "code 0": ("q8", lambda h, a: (h, _with(a, PAYLOAD, np.where(np.arange(37) == 5, 0, a[PAYLOAD]).astype(np.uint8))),
               "code 0 is no level"),
    "padding nibble": ("q4", lambda h, a: (h, _with(a, PAYLOAD, np.append(a[PAYLOAD][:-1], a[PAYLOAD][-1] | 0x10))),
                       "padding nibble"),
    "NaN step": ("q4", lambda h, a: (h, _with(a, SCALES, np.append(a[SCALES][:-1], np.float32(np.nan)))), "step"),
    "negative step": ("q8", lambda h, a: (h, _with(a, SCALES, -a[SCALES])), "step is negative"),
    "bitmap count": ("topk+q8", lambda h, a: (h, _with(a, INDEX, a[INDEX] ^ np.uint8(1))), "bitmap marks"),
    "bitmap padding": ("topk+q8", lambda h, a: (h, _with(a, INDEX, np.append(a[INDEX][:-1], a[INDEX][-1] | 0x80))),
                       "padding bits"),
    "kept too many": ("topk+q8", lambda h, a: ({**h, "tensors": [{**h["tensors"][0], "kept": 38}]}, a), "kept 38 of 37"),
    "unknown codec": ("q8", lambda h, a: ({**h, "codec": "q2"}, a), "codec"),
    "missing stream": ("q8", lambda h, a: (h, {k: v for k, v in a.items() if k != SCALES}), "not the header's"),
    "stream dtype": ("q8", lambda h, a: (h, _with(a, SCALES, a[SCALES].astype(np.float64))), "not a flat float32"),
    "dense kept": ("q8", lambda h, a: ({**h, "tensors": [{**h["tensors"][0], "kept": 3}]}, a), "kept and index"),
    "negative dimension": ("q8", lambda h, a: ({**h, "tensors": [{**h["tensors"][0], "shape": [-37]}]}, a),
                           "greater than or equal to 0"),
    "reserved name": ("q8", lambda h, a: ({**h, "exact": ["codec:x"]}, {**a, "codec:x": a["n"]}), "codec:"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_frame_is_refused_with_its_reason(case):
    name, mutate, message = MALFORMED[case]
    header, arrays, reference = frame(name)
    decode(Encoded.from_arrays(header, arrays), reference)  # unmutated: fine
    header, arrays = mutate(header, arrays)
    with pytest.raises(CodecError, match=message) as caught:
        decode(Encoded.from_arrays(header, arrays), reference)
    assert caught.value.reason == "malformed"


def gap_frame() -> tuple[dict, dict, dict]:
    """A top-k frame whose index is gap varints: 3 of 3000 values kept."""
    reference = {"w": np.zeros(3000, np.float32)}
    update = {"w": np.zeros(3000, np.float32)}
    update["w"][[5, 300, 2999]] = [1.0, -2.0, 3.0]
    spec = CodecSpec.from_name("topk+q8", keep=0.001)
    encoded = encode(update, reference, spec, np.random.default_rng(0))
    assert encoded.header.tensors[0].index == "gaps"
    assert encoded.index.tolist() == [5, 166, 2, 138, 21]  # gaps 5, 294 (0xA6 0x02), 2698 (0x8A 0x15)
    return encoded.header_fields(), dict(encoded.arrays()), reference


@pytest.mark.parametrize(("index", "message"), [
    ([5, 166, 2, 138], "ends early"),
    ([5, 166, 2, 138, 21, 0], "longer"),
    ([5, 166, 2, 139, 21], "past the tensor"),
    ([5, 166, 130, 0, 138, 21], "minimal LEB128"),
])
def test_a_malformed_gap_index_is_refused(index, message):
    header, arrays, reference = gap_frame()
    assert np.flatnonzero(decode(Encoded.from_arrays(header, arrays), reference)["w"]).tolist() == [5, 300, 2999]
    with pytest.raises(CodecError, match=message):
        decode(Encoded.from_arrays(header, _with(arrays, INDEX, np.array(index, np.uint8))), reference)


def test_a_frame_for_another_model_or_past_float32_is_refused():
    header, arrays, reference = frame("q8")
    with pytest.raises(CodecError, match=r"compresses \['w'\], which the reference has not") as caught:
        decode(Encoded.from_arrays(header, arrays), {"n": reference["n"]})
    assert caught.value.reason == "wrong_tensors"
    with pytest.raises(CodecError, match="reference is float32") as caught:
        decode(Encoded.from_arrays(header, arrays), {**reference, "w": np.zeros(36, np.float32)})
    assert caught.value.reason == "wrong_shape"
    vast = {**header, "tensors": [{**header["tensors"][0], "shape": [2**31, 2**31]}]}  # refused before allocating
    with pytest.raises(CodecError, match="reference is float32") as caught:
        decode(Encoded.from_arrays(vast, arrays), reference)
    assert caught.value.reason == "wrong_shape"
    huge = _with(arrays, SCALES, np.full_like(arrays[SCALES], 3e36))
    with pytest.raises(CodecError, match="past float32's range") as caught:
        decode(Encoded.from_arrays(header, huge), reference)
    assert caught.value.reason == "non_finite"
