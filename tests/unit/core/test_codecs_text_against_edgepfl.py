"""The codecs as docs/COMPRESSION.md specifies them, implemented from the text alone
(tests/foreign_agent/codecs_text.py: written by someone given only COMPRESSION.md and the
protocol's codec passages, numpy only), against edgepfl's own (edgepfl/codecs.py).

Whatever edgepfl encodes, the text's decoder reads back bit for bit; given the same random
stream, the text's encoder writes the very same header and streams edgepfl writes (the text
now fixes the change's precision, the step's rounding and the order of the rounding draws);
the task-delta digest is the same function; and a release delta edgepfl makes rebuilds,
through the text's decoder, into the artifact edgepfl released. The worked examples of the
text are reproduced by tests/unit/core/test_codecs_from_the_text.py.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from edgepfl import codecs as ours
from edgepfl.protocol.codec import tensors_digest
from edgepfl.release_delta import make_release_delta

from tests.foreign_agent import codecs_text as text

SHAPES = [(3, 5), (64,), (2, 3, 4), (1,), (130,), ()]


def _case(seed: int) -> tuple[dict, dict]:
    """A reference and an update of several tensors, with the kinds a model has: float32
    weights (moved by a few orders of magnitude), a BatchNorm statistic and counter (exact)."""
    rng = np.random.default_rng(seed)
    reference = {f"layer{i}.weight": (rng.normal(0, 10.0 ** rng.integers(-2, 3), s)).astype(np.float32)
                 for i, s in enumerate(SHAPES)}
    update = {k: (v + rng.normal(0, 0.01, v.shape) * (rng.random(v.shape) < 0.9)).astype(np.float32)
              for k, v in reference.items()}
    reference["bn.running_mean"] = rng.normal(0, 1, 4).astype(np.float32)
    update["bn.running_mean"] = (reference["bn.running_mean"] + 0.5).astype(np.float32)
    reference["bn.num_batches_tracked"] = update["bn.num_batches_tracked"] = np.asarray(7, np.int64)
    return reference, update


CODECS = [("q8", None), ("q4", None), ("topk+q8", 0.1), ("topk+q4", 0.3), ("topk+q4", 0.01)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("codec, keep", CODECS)
@pytest.mark.parametrize("block", [1, 4, 32, 256])
def test_the_texts_codec_reads_and_writes_the_frames_edgepfl_writes(seed, codec, keep, block):
    reference, update = _case(seed)
    spec = ours.CodecSpec.from_name(codec, block=block, keep=keep or 0.1)
    frame = ours.encode(update, reference, spec, np.random.default_rng([seed, 0xC0DEC]))
    header, arrays = frame.header_fields(), {k: np.asarray(v) for k, v in frame.arrays().items()}
    decoded = text.decode(header, arrays, reference)
    expected = ours.decode(frame, reference)
    assert decoded.keys() == expected.keys()
    for name in expected:
        assert decoded[name].dtype == expected[name].dtype and decoded[name].tobytes() == expected[name].tobytes(), name
    written = text.encode_update(update, reference, codec, block, keep, np.random.default_rng([seed, 0xC0DEC]))
    assert written.header == header
    assert written.arrays.keys() == arrays.keys()
    for name, value in arrays.items():
        assert np.asarray(written.arrays[name]).tobytes() == value.tobytes(), name


def test_the_task_delta_digest_is_one_function():
    rng = np.random.default_rng(5)
    tensors = {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float16),
               "n": np.asarray(5, np.int64), "mask": rng.random(6) < 0.5, "é/uni": np.zeros((0, 2), np.float64)}
    assert text.tensors_digest(tensors) == tensors_digest(tensors)
    tensors["w"] = tensors["w"].astype(">f4")  # big-endian values digest as the little-endian ones
    assert text.tensors_digest(tensors) == tensors_digest(tensors)


def test_a_release_delta_edgepfl_makes_rebuilds_through_the_texts_decoder():
    from tests.unit.core.test_release_delta import SHAPE, encoder, encoder_to_onnx, trained

    module = encoder()
    base = encoder_to_onnx(module, SHAPE)
    exported = encoder_to_onnx(trained(module, 0.05, seed=1), SHAPE)
    parts = make_release_delta(base, exported, ours.CodecSpec.from_name("q4"), np.random.default_rng(0))
    assert parts is not None
    delta = {"base_sha256": hashlib.sha256(base).hexdigest(), "runs": [list(r) for r in parts.runs],
             "codec": parts.encoded.header_fields()}
    arrays = {k: np.asarray(v) for k, v in parts.encoded.arrays().items()}
    rebuilt = text.apply_release_delta(base, delta, arrays, hashlib.sha256(parts.artifact).hexdigest())
    assert rebuilt == parts.artifact


def test_the_edge_cases_the_text_now_settles_decide_alike():
    """A step of -0.0 is a step of zero (not "below zero"); a top-k of an empty tensor keeps
    nothing; both decoders agree on each, bit for bit."""
    reference = {"w": np.asarray([0.5, -0.25, 0.0, 1.0, 2.0], np.float32), "e": np.zeros((0, 3), np.float32)}
    update = {"w": np.asarray([1.375, -0.6875, 0.0, 1.125, 1.9375], np.float32), "e": np.zeros((0, 3), np.float32)}
    frame = ours.encode(update, reference, ours.CodecSpec.from_name("topk+q4", block=4, keep=0.5),
                        np.random.default_rng(0))
    header = frame.header_fields()
    assert [t.get("kept") for t in header["tensors"]] == [3, 0]
    arrays = {k: np.asarray(v).copy() for k, v in frame.arrays().items()}
    arrays["codec:scales"][0] = np.float32(-0.0)
    expected = ours.decode(ours.Encoded.from_arrays(header, arrays), reference)
    decoded = text.decode(header, arrays, reference)
    for name in expected:
        assert decoded[name].tobytes() == expected[name].tobytes(), name
    assert (expected["w"] == reference["w"]).all()  # the -0.0 block moved nothing


@pytest.mark.parametrize("codec, keep", [("q4", None), ("topk+q8", 0.1)])
def test_error_feedback_as_the_text_says_it_writes_edgepfls_frames_round_after_round(codec, keep):
    reference, update = _case(3)
    mine, theirs = ours.ErrorFeedback(), text.ErrorFeedback()
    spec = ours.CodecSpec.from_name(codec, block=32, keep=keep or 0.1)
    for r in range(4):
        frame = mine.encode(update, reference, spec, np.random.default_rng([r, 0xC0DEC]))
        written = theirs.encode(update, reference, codec, 32, keep, np.random.default_rng([r, 0xC0DEC]))
        assert written.header == frame.header_fields()
        for name, value in frame.arrays().items():
            assert np.asarray(written.arrays[name]).tobytes() == np.asarray(value).tobytes(), (r, name)
        reference = ours.decode(frame, reference)  # the next round's state: what was sent, adopted
