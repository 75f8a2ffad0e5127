"""Release deltas (edgepfl/release_delta.py, protocol 1.7): a release rebuilt from the previous
one plus its quantized weight changes, on real ONNX encoders exported by the exporter and run
by onnxruntime."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgepfl.codecs import CodecError, CodecSpec, Encoded, dequantize  # noqa: E402
from edgepfl.config import ModelSpec  # noqa: E402
from edgepfl.export.heads import make_session  # noqa: E402
from edgepfl.export.onnx_export import INPUT_NAME, OUTPUT_NAME, encoder_to_onnx  # noqa: E402
from edgepfl.methods import create_method  # noqa: E402
from edgepfl.release_delta import apply_release_delta, make_release_delta, weight_runs  # noqa: E402

SHAPE = (1, 28, 28)


def encoder(arch: str = "cnn", shape: tuple[int, ...] = SHAPE, seed: int = 0):
    torch.manual_seed(seed)
    method = create_method("fedavg")
    return method.encoder_module(method.build_model(ModelSpec(arch=arch), shape, 10)).eval()


def trained(module, spread: float, seed: int):
    """``module`` after a step of "training": every weight moved a little."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * spread * (p.abs().mean() + 1e-3))
    return module


def run_values(artifact: bytes, runs) -> np.ndarray:
    return np.concatenate([np.frombuffer(artifact, "<f4", count, offset) for offset, count in runs])


def features(artifact: bytes, x: np.ndarray) -> np.ndarray:
    return make_session(artifact).run([OUTPUT_NAME], {INPUT_NAME: x})[0]


@pytest.fixture(scope="module")
def two_exports() -> tuple[bytes, bytes]:
    module = encoder()
    base = encoder_to_onnx(module, SHAPE)
    return base, encoder_to_onnx(trained(module, 0.05, seed=1), SHAPE)


@pytest.mark.parametrize("codec, most", [("q4", 0.15), ("q8", 0.26)])
def test_a_delta_is_a_fraction_of_the_encoder_and_rebuilds_the_released_bytes(two_exports, codec, most):
    base, exported = two_exports
    parts = make_release_delta(base, exported, CodecSpec.from_name(codec), np.random.default_rng(0))
    assert parts is not None
    assert parts.encoded.sizes().encoded < most * len(exported)
    rebuilt = apply_release_delta(base, parts.runs, parts.encoded)
    assert hashlib.sha256(rebuilt).digest() == hashlib.sha256(parts.artifact).digest()
    # the runs are the float32 weights: everything else is the base's, byte for byte
    mask = np.ones(len(base), bool)
    for offset, count in parts.runs:
        mask[offset: offset + 4 * count] = False
    assert np.array_equal(np.frombuffer(parts.artifact, np.uint8)[mask], np.frombuffer(base, np.uint8)[mask])
    # every float32 initializer of the graph (BatchNorm folded into its convolution included)
    import onnx

    graph = onnx.load_from_string(exported).graph
    weights = [onnx.numpy_helper.to_array(t) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    assert [count for _, count in parts.runs] == [w.size for w in weights]


def test_the_released_encoder_is_within_one_step_of_the_exported_one(two_exports):
    base, exported = two_exports
    parts = make_release_delta(base, exported, CodecSpec.from_name("q4", block=64), np.random.default_rng(0))
    assert parts is not None
    released, wanted = run_values(parts.artifact, parts.runs), run_values(exported, parts.runs)
    # one float32 step per block of 64 values, blocks counted per run
    steps = np.concatenate([np.repeat(parts.encoded.scales[start: start + -(-count // 64)], 64)[:count]
                            for start, count in _block_starts(parts.runs, 64)])
    assert steps.size == released.size
    assert np.all(np.abs(released.astype(np.float64) - wanted) <= steps + 2 * np.spacing(np.abs(wanted)))
    # and onnxruntime computes nearly the same features from it
    x = np.random.default_rng(2).standard_normal((8, *SHAPE)).astype(np.float32)
    drift = np.abs(features(parts.artifact, x) - features(exported, x)).max()
    change = np.abs(features(exported, x) - features(base, x)).max()
    assert drift < 0.25 * change


def _block_starts(runs, block):
    start = 0
    for _, count in runs:
        yield start, count
        start += -(-count // block)


def test_the_error_does_not_add_up_over_releases():
    """Each delta is taken from the release before (not from the exported encoder), so after
    twelve releases a release is as close to its model as after one."""
    module = encoder()
    released = encoder_to_onnx(module, SHAPE)
    runs = weight_runs(released)
    assert runs is not None
    rng = np.random.default_rng(3)
    gaps = []
    for k in range(12):
        exported = encoder_to_onnx(trained(module, 0.02, seed=10 + k), SHAPE)
        parts = make_release_delta(released, exported, CodecSpec.from_name("q4"), rng)
        assert parts is not None
        released = parts.artifact
        change = max(np.abs(v).max() for v in dequantize(parts.encoded).values())
        gaps.append(np.abs(run_values(released, runs) - run_values(exported, runs)).max() / change)
    assert max(gaps) <= 0.15, gaps  # within a step (a seventh of the largest change at most), never growing


def test_no_delta_between_different_graphs(two_exports):
    base, _ = two_exports
    spec, rng = CodecSpec.from_name("q4"), np.random.default_rng(0)
    assert make_release_delta(base, encoder_to_onnx(encoder("mlp"), SHAPE), spec, rng) is None
    other_input = encoder_to_onnx(encoder("cnn", (3, 28, 28)), (3, 28, 28))
    assert make_release_delta(base, other_input, spec, rng) is None
    # same weights and length, one byte outside the weights changed (a renamed graph)
    assert base.count(b"main_graph") == 1
    assert make_release_delta(base, base.replace(b"main_graph", b"main_grapi"), spec, rng) is None
    assert make_release_delta(base, base, CodecSpec.from_name("topk+q8"), rng) is None  # not a delta's codec
    assert weight_runs(b"not an onnx file") is None


def test_a_delta_that_does_not_fit_its_base_is_refused(two_exports):
    base, exported = two_exports
    parts = make_release_delta(base, exported, CodecSpec.from_name("q4"), np.random.default_rng(0))
    assert parts is not None
    runs = list(parts.runs)
    for bad in ([*runs[:-1], (len(base) - 4, runs[-1][1])],  # past the end
                [runs[1], runs[0], *runs[2:]],  # out of order
                [(runs[0][0], runs[0][1] + 1), *runs[1:]]):  # overlapping the next
        with pytest.raises(CodecError):
            apply_release_delta(base, bad, parts.encoded)
    with pytest.raises(CodecError):
        apply_release_delta(base, runs[:-1], parts.encoded)  # a tensor without a run
    header = parts.encoded.header.model_copy(update={"tensors": (
        parts.encoded.header.tensors[0].model_copy(update={"name": "encoder.weight"}), *parts.encoded.header.tensors[1:])})
    renamed = Encoded(header, parts.encoded.streams, {})
    with pytest.raises(CodecError, match="run-0"):
        apply_release_delta(base, runs, renamed)


def test_the_worked_example_of_compression_md():
    """docs/COMPRESSION.md, "Release deltas": two values, q4, one step of 0.25."""
    import struct

    base = bytes(4) + struct.pack("<ff", 0.5, -1.0) + bytes(4)
    encoded = Encoded.from_arrays({"codec": "q4", "block": 256, "tensors": [{"name": "run-0", "shape": [2]}]},
                                  {"codec:payload": np.array([0x6B], np.uint8),
                                   "codec:scales": np.array([0.25], np.float32)})
    rebuilt = apply_release_delta(base, [(4, 2)], encoded)
    assert rebuilt[4:12] == bytes.fromhex("0000a03f0000c0bf") and rebuilt[:4] + rebuilt[12:] == bytes(8)
    assert struct.unpack("<ff", rebuilt[4:12]) == (1.25, -1.5)
