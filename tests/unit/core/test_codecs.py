"""Update codecs: each value within one step of its change, unbiased rounding, exact
tensors bit for bit, error feedback that loses nothing over rounds, bit-identical
aggregation in any arrival order, and the byte ratios docs/COMPRESSION.md records. Every codec's
round trip and refusal of malformed frames: tests/contract/test_codec_contract.py."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from edgepfl.aggregation import AggregationSpec, Mean
from edgepfl.codec_stages import Quantize
from edgepfl.codecs import (
    CODEC_NAMES,
    INDEX,
    PAYLOAD,
    SCALES,
    CodecSpec,
    Encoded,
    ErrorFeedback,
    decode,
    dequantize,
    encode,
    exact_names,
)

LOSSY = [name for name in CODEC_NAMES if name != "none"]

#: the default model's shared state: SmallCNN (32 and 64 channels, BatchNorm, feature 128)
#: on 28x28 grey images, and its 10-class linear head
CNN_SHAPES: dict[str, tuple[int, ...]] = {
    "encoder.conv.0.weight": (32, 1, 5, 5), "encoder.conv.0.bias": (32,),
    "encoder.conv.1.weight": (32,), "encoder.conv.1.bias": (32,),
    "encoder.conv.1.running_mean": (32,), "encoder.conv.1.running_var": (32,),
    "encoder.conv.4.weight": (64, 32, 5, 5), "encoder.conv.4.bias": (64,),
    "encoder.conv.5.weight": (64,), "encoder.conv.5.bias": (64,),
    "encoder.conv.5.running_mean": (64,), "encoder.conv.5.running_var": (64,),
    "encoder.fc.0.weight": (128, 1024), "encoder.fc.0.bias": (128,),
    "head.weight": (10, 128), "head.bias": (10,),
}


#: the same layers, narrower: for tests that aggregate many updates
NARROW_SHAPES = {**CNN_SHAPES, "encoder.conv.4.weight": (64, 4, 3, 3), "encoder.fc.0.weight": (128, 40)}


def cnn_state(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]] = CNN_SHAPES) -> dict[str, np.ndarray]:
    state = {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in shapes.items()}
    for layer in ("encoder.conv.1.", "encoder.conv.5."):
        state[layer + "running_var"] = np.abs(state[layer + "running_var"]) + np.float32(0.5)
        state[layer + "num_batches_tracked"] = np.array(600, np.int64)
    return state


def trained(reference: dict[str, np.ndarray], rng: np.random.Generator, spread: float = 0.01) -> dict[str, np.ndarray]:
    """An update one round of local training might send: every float moved a little."""
    out = {}
    for name, value in reference.items():
        if value.dtype.kind == "f":
            moved = value + rng.normal(0, spread, value.shape)
            out[name] = (np.abs(moved) if name.endswith("running_var") else moved).astype(value.dtype)
        else:
            out[name] = value + 12
    return out


def sent_steps(encoded: Encoded) -> dict[str, np.ndarray]:
    """Per compressed tensor, the step of each value it sent (in the order sent)."""
    out, at = {}, 0
    for tensor in encoded.header.tensors:
        values = math.prod(tensor.shape) if tensor.kept is None else tensor.kept
        blocks = -(-values // encoded.header.block)
        out[tensor.name] = np.repeat(encoded.scales[at: at + blocks].astype(np.float64), encoded.header.block)[:values]
        at += blocks
    return out


def kept_positions(change: np.ndarray, keep: float) -> np.ndarray:
    flat = change.reshape(-1)
    k = max(1, math.ceil(keep * flat.size)) if flat.size else 0
    return np.sort(np.argsort(-np.abs(flat), kind="stable")[:k])


def assert_within_one_step(encoded: Encoded, update, reference, keep: float | None) -> None:
    """Each sent value decodes within one step of its change (plus float32's rounding of
    ``level * step``); top-k's unsent values decode to exactly no change."""
    changes, steps = dequantize(encoded), sent_steps(encoded)
    for name, got in changes.items():
        true = (np.asarray(update[name], np.float64) - reference[name]).reshape(-1)
        got = got.astype(np.float64).reshape(-1)
        sent = np.arange(true.size) if keep is None else kept_positions(true, keep)
        assert (np.abs(got[sent] - true[sent]) <= steps[name] * (1 + 2**-20)).all(), name
        unsent = np.setdiff1d(np.arange(true.size), sent)
        assert (got[unsent] == 0).all(), name


# --------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("name", LOSSY)
def test_each_value_decodes_within_one_step_of_its_change(name):
    rng = np.random.default_rng(3)
    reference = cnn_state(rng)
    update = trained(reference, rng)
    spec = CodecSpec.from_name(name, block=64)
    encoded = encode(update, reference, spec, np.random.default_rng(4))
    assert_within_one_step(encoded, update, reference, spec.keep)
    levels = next(stage.levels for stage in spec.stages if isinstance(stage, Quantize))
    steps = sent_steps(encoded)
    for tensor in encoded.header.tensors:  # a step is the block's largest magnitude / levels, rounded up
        true = (update[tensor.name].astype(np.float64) - reference[tensor.name]).reshape(-1)
        if spec.keep is not None:
            true = true[kept_positions(true, spec.keep)]
        padded = np.zeros(steps[tensor.name].size + -true.size % spec.block)
        padded[: true.size] = np.abs(true)
        largest = np.repeat(padded.reshape(-1, spec.block).max(axis=1), spec.block)[: true.size]
        assert (steps[tensor.name] * levels >= largest).all()
        assert (steps[tensor.name] * levels <= largest * (1 + 2**-22)).all()


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_stochastic_rounding_is_unbiased(name):
    """The mean of 400 encodes (fixed seeds) is within six standard errors of the change
    everywhere: a level is at most one step from the value, so the rounding's standard
    deviation is at most step / 2 and the mean's at most step / 40. Rounding to the
    nearest level instead is off by up to half a step, the same way every time."""
    rng = np.random.default_rng(5)
    reference = {"w": rng.normal(0, 1, 1000).astype(np.float32)}
    update = {"w": (reference["w"] + rng.normal(0, 0.05, 1000)).astype(np.float32)}
    spec = CodecSpec.from_name(name, block=100)
    draws = [encode(update, reference, spec, np.random.default_rng(seed)) for seed in range(400)]
    mean = np.mean([dequantize(e)["w"].astype(np.float64) for e in draws], axis=0)
    true = update["w"].astype(np.float64) - reference["w"]
    step = sent_steps(draws[0])["w"]
    assert (np.abs(mean - true) <= 6 * step / (2 * math.sqrt(len(draws))) + 1e-9).all()


def test_the_same_seed_encodes_the_same_bytes_and_another_seed_does_not():
    rng = np.random.default_rng(6)
    reference = cnn_state(rng)
    update = trained(reference, rng)
    spec = CodecSpec.from_name("topk+q4")
    first, again = (encode(update, reference, spec, np.random.default_rng(7)) for _ in range(2))
    other = encode(update, reference, spec, np.random.default_rng(8))
    assert first.header == again.header
    assert all(first.arrays()[k].tobytes() == again.arrays()[k].tobytes() for k in first.arrays())
    assert first.payload.tobytes() != other.payload.tobytes()


# --------------------------------------------------------------------------- exact tensors
def test_statistics_integers_other_floats_unreferenced_and_marked_tensors_go_bit_for_bit():
    rng = np.random.default_rng(9)
    reference = cnn_state(rng)
    reference["encoder.scale"] = rng.normal(0, 1, 7)  # float64: never compressed
    update = trained(reference, rng)
    update["stat/prototypes"] = rng.normal(0, 1, (10, 128)).astype(np.float32)  # no reference: no change to take
    odd = np.array([-0.0, 1e-45, 3.0e38, -2.5e-39, 1 / 3] * 6 + [0.0, 7.0], np.float32)
    update["encoder.conv.1.running_mean"] = odd
    marked = {"head.bias"}
    encoded = encode(update, reference, CodecSpec.from_name("q4"), np.random.default_rng(10), exact=marked)
    decoded = decode(Encoded.from_arrays(encoded.header_fields(), encoded.arrays()), reference)
    want = {"encoder.conv.1.running_mean", "encoder.conv.1.running_var", "encoder.conv.1.num_batches_tracked",
            "encoder.conv.5.running_mean", "encoder.conv.5.running_var", "encoder.conv.5.num_batches_tracked",
            "encoder.scale", "head.bias", "stat/prototypes"}
    assert set(encoded.header.exact) == want == exact_names(update, reference, marked)
    assert not want & {t.name for t in encoded.header.tensors}
    assert list(encoded.header.exact) == [name for name in update if name in want]  # the update's order: reproducible
    for name in want:
        assert decoded[name].dtype == update[name].dtype
        assert decoded[name].tobytes() == update[name].tobytes(), name


def test_codec_none_sends_every_tensor_as_it_is():
    rng = np.random.default_rng(11)
    reference = cnn_state(rng)
    update = trained(reference, rng)
    encoded = encode(update, reference, CodecSpec.from_name("none"), np.random.default_rng(0))
    assert set(encoded.arrays()) == set(update) and not encoded.header.tensors
    decoded = decode(encoded, reference)
    assert all(decoded[k].tobytes() == update[k].tobytes() for k in update)


@pytest.mark.parametrize("where", ["update", "reference"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_with_the_tensors_name(where, bad):
    rng = np.random.default_rng(12)
    reference = cnn_state(rng)
    update = trained(reference, rng)
    target = update if where == "update" else reference
    target["head.weight"] = target["head.weight"].copy()
    target["head.weight"][3, 4] = bad
    with pytest.raises(ValueError, match=r"'head\.weight' holds NaN or Inf"):
        encode(update, reference, CodecSpec.from_name("q8"), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"'head\.weight' holds NaN or Inf"):
        ErrorFeedback().encode(update, reference, CodecSpec.from_name("q8"), np.random.default_rng(0))


# --------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize("name", ["q8", "q4"])
def test_error_feedback_keeps_the_sum_of_decoded_changes_within_one_step(name):
    """Over 40 rounds, each from a new reference, the decoded changes add up to the true
    ones to within the last round's step; without feedback the rounding errors add up."""
    rng = np.random.default_rng(13)
    spec = CodecSpec.from_name(name, block=32)
    reference = {"w": rng.normal(0, 1, 500).astype(np.float32)}
    feedback = ErrorFeedback()
    true_sum = np.zeros(500)
    sent_sum = np.zeros(500)
    plain_sum = np.zeros(500)
    for round_ in range(40):
        update = {"w": (reference["w"] + rng.normal(0, 0.01, 500)).astype(np.float32)}
        encoded = feedback.encode(update, reference, spec, np.random.default_rng(round_))
        true_sum += update["w"].astype(np.float64) - reference["w"]
        sent_sum += decode(encoded, reference)["w"].astype(np.float64) - reference["w"]
        plain = encode(update, reference, spec, np.random.default_rng(round_))
        plain_sum += decode(plain, reference)["w"].astype(np.float64) - reference["w"]
        reference = {"w": (reference["w"] + rng.normal(0, 0.02, 500)).astype(np.float32)}
    last_step = sent_steps(encoded)["w"]
    assert (np.abs(true_sum - sent_sum) <= last_step * (1 + 1e-4)).all()
    np.testing.assert_allclose(true_sum - sent_sum, feedback.residual["w"], rtol=0, atol=1e-6 * last_step.max())
    assert np.abs(true_sum - plain_sum).max() > 2 * last_step.max()


def test_error_feedback_sends_what_top_k_left_out_in_later_rounds():
    """Top-k alone never sends 90 % of a steady change; with feedback, what is left out
    waits in the residual and the sum sent trails the true sum by that residual only."""
    rng = np.random.default_rng(14)
    spec = CodecSpec.from_name("topk+q8", block=64, keep=0.1)
    reference = {"w": rng.normal(0, 1, 400).astype(np.float32)}
    drift = rng.normal(0, 0.01, 400)
    feedback = ErrorFeedback()
    true_sum, sent_sum, plain_sum = np.zeros(400), np.zeros(400), np.zeros(400)
    for round_ in range(60):
        update = {"w": (reference["w"] + drift).astype(np.float32)}
        encoded = feedback.encode(update, reference, spec, np.random.default_rng(round_))
        true_sum += update["w"].astype(np.float64) - reference["w"]
        sent_sum += decode(encoded, reference)["w"].astype(np.float64) - reference["w"]
        plain_sum += decode(encode(update, reference, spec, np.random.default_rng(round_)), reference)["w"] - reference["w"]
    np.testing.assert_allclose(true_sum - sent_sum, feedback.residual["w"], rtol=0, atol=1e-6)
    with_feedback, without = np.linalg.norm(true_sum - sent_sum), np.linalg.norm(true_sum - plain_sum)
    assert with_feedback < 0.1 * without


def test_error_feedback_state_survives_a_restart():
    rng = np.random.default_rng(15)
    reference = cnn_state(rng)
    spec = CodecSpec.from_name("q4")
    before = ErrorFeedback()
    for round_ in range(3):
        before.encode(trained(reference, rng), reference, spec, np.random.default_rng(round_))
    state = before.state_dict()
    assert set(state) == {t for t in CNN_SHAPES if t not in exact_names(reference, reference)}
    assert all(v.dtype == np.float32 and v.any() for v in state.values())
    after = ErrorFeedback()
    after.load_state_dict(state)
    update = trained(reference, rng)
    one, two = (fb.encode(update, reference, spec, np.random.default_rng(99)) for fb in (before, after))
    assert one.payload.tobytes() == two.payload.tobytes() and one.scales.tobytes() == two.scales.tobytes()
    with pytest.raises(ValueError, match="'head.bias' holds NaN or Inf"):
        after.load_state_dict({**state, "head.bias": np.full(10, np.nan, np.float32)})


def test_error_feedback_resets_when_the_model_changes():
    rng = np.random.default_rng(16)
    spec = CodecSpec.from_name("q4")
    feedback = ErrorFeedback()
    small = {"w": rng.normal(0, 1, 50).astype(np.float32)}
    feedback.encode({"w": small["w"] + np.float32(0.3)}, small, spec, np.random.default_rng(0))
    assert feedback.residual["w"].any()
    other = {"w": rng.normal(0, 1, (5, 5)).astype(np.float32)}
    update = {"w": (other["w"] + rng.normal(0, 0.1, (5, 5))).astype(np.float32)}
    got = feedback.encode(update, other, spec, np.random.default_rng(1))
    fresh = ErrorFeedback().encode(update, other, spec, np.random.default_rng(1))
    assert got.payload.tobytes() == fresh.payload.tobytes()
    assert feedback.residual["w"].shape == (5, 5)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_the_arrays_travel_in_todays_envelope(name):
    """The streams' dtypes and names are ones an edgepfl frame carries: the body decodes
    to the same update (the header will ride in the update's meta with protocol 1.6)."""
    from edgepfl.protocol import MessageType, UpdateMeta
    from edgepfl.protocol import decode as decode_frame
    from edgepfl.protocol import encode as encode_frame

    rng = np.random.default_rng(22)
    reference = cnn_state(rng, NARROW_SHAPES)
    encoded = encode(trained(reference, rng), reference, CodecSpec.from_name(name), np.random.default_rng(0))
    meta = UpdateMeta(task_id="a" * 32, kind="train", num_train=600, num_test=200, eval_correct=150)
    frame = encode_frame(MessageType.UPDATE, federation="f", sender="agent-00", round=3, meta=meta,
                         tensors=encoded.arrays())
    received = decode_frame(frame).tensors
    got = decode(Encoded.from_arrays(json.loads(json.dumps(encoded.header_fields())), received), reference)
    want = decode(encoded, reference)
    assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)


# --------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("name", LOSSY)
def test_decoded_updates_aggregate_to_the_same_bits_in_any_arrival_order(name):
    """Six agents' frames, decoded afresh for each of 20 arrival orders, under the plain
    mean and the default rule with its update bound."""
    rng = np.random.default_rng(18)
    reference = cnn_state(rng, NARROW_SHAPES)
    spec = CodecSpec.from_name(name)
    frames = []
    for agent in range(6):
        encoded = ErrorFeedback().encode(trained(reference, rng), reference, spec, np.random.default_rng(agent))
        frames.append((encoded.header_fields(), encoded.arrays()))
    weights = [600, 35, 1200, 7, 600, 90]
    for rule in (Mean, lambda: AggregationSpec(max_weight_ratio=None).build()):
        results = []
        for order in list(itertools.permutations(range(6)))[::36]:  # 20 distinct orders
            aggregator = rule()
            aggregator.begin(reference)
            for i in order:
                aggregator.add(decode(Encoded.from_arrays(*frames[i]), reference), weights[i])
            results.append(aggregator.result())
        for result in results[1:]:
            for key in reference:
                assert result[key].dtype == reference[key].dtype
                assert result[key].tobytes() == results[0][key].tobytes(), (name, key)


# --------------------------------------------------------------------------- bytes
def test_sizes_count_every_byte_of_the_streams_and_the_header():
    rng = np.random.default_rng(19)
    reference = cnn_state(rng)
    update = trained(reference, rng)
    for name in CODEC_NAMES:
        encoded = encode(update, reference, CodecSpec.from_name(name), np.random.default_rng(0))
        sizes = encoded.sizes()
        assert sizes.encoded == sum(a.nbytes for a in encoded.arrays().values()) + len(
            json.dumps(encoded.header_fields(), separators=(",", ":")))
        assert sizes.uncompressed == sum(v.nbytes for v in update.values())
    one = {"w": np.zeros(999, np.float32)}
    moved = {"w": np.ones(999, np.float32)}
    for name, payload in (("q8", 999), ("q4", 500)):  # 4 blocks of 256: 16 bytes of steps
        sizes = encode(moved, one, CodecSpec.from_name(name), np.random.default_rng(0)).sizes()
        assert sizes.per_tensor["w"] == (payload + 16, 3996)


@pytest.mark.parametrize(("keep", "form"), [(0.5, "bitmap"), (0.2, "bitmap"), (0.05, "gaps"), (0.01, "gaps")])
def test_top_k_writes_the_smaller_index(keep, form):
    rng = np.random.default_rng(20)
    reference = {"w": np.zeros(20000, np.float32)}
    update = {"w": rng.normal(0, 1, 20000).astype(np.float32)}
    encoded = encode(update, reference, CodecSpec.from_name("topk+q8", keep=keep), np.random.default_rng(0))
    gaps = np.diff(kept_positions(update["w"], keep), prepend=-1) - 1
    varint_bytes = int(sum(max(1, math.ceil(int(g).bit_length() / 7)) for g in gaps))
    assert encoded.header.tensors[0].index == form
    assert encoded.index.size == min(20000 // 8, varint_bytes)


@pytest.mark.parametrize(("name", "most"), [("q8", 0.26), ("q4", 0.15)])
def test_the_default_cnns_update_compresses_to_at_most_0_26_with_q8_and_0_15_with_q4(name, most):
    rng = np.random.default_rng(21)
    reference = cnn_state(rng)
    sizes = encode(trained(reference, rng), reference, CodecSpec.from_name(name), np.random.default_rng(0)).sizes()
    assert sizes.ratio <= most


def test_spec_names_and_their_parameters():
    assert [CodecSpec.from_name(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)
    assert CodecSpec.from_name("topk+q4", keep=0.05) == CodecSpec(name="topk+q4", keep=0.05)
    assert CodecSpec.from_name("q8", keep=0.05).keep is None
    with pytest.raises(ValueError, match="unknown codec 'q2'"):
        CodecSpec.from_name("q2")
    with pytest.raises(ValueError, match="keep goes with a top-k codec"):
        CodecSpec(name="none", keep=0.1)


# --------------------------------------------------------------------------- docs/COMPRESSION.md
def test_the_worked_examples_of_the_compression_doc():
    """The bytes docs/COMPRESSION.md shows, from the same encoder and seed, and decoded
    from those literal bytes to the values it shows."""
    reference = {"w": np.array([0.5, -0.25, 0, 1, 2], np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
    update = {"w": np.array([1.375, -0.6875, 0, 1.125, 1.9375], np.float32),
              "bn.num_batches_tracked": np.array(5, np.int64)}
    encoded = encode(update, reference, CodecSpec(name="q4", block=4), np.random.default_rng(0))
    header = {"codec": "q4", "block": 4, "tensors": [{"name": "w", "shape": [5], "dtype": "float32"}],
              "exact": ["bn.num_batches_tracked"]}
    assert encoded.header_fields() == header and encoded.sizes().header == 114
    assert encoded.payload.tobytes().hex(" ") == "5f 98 01"
    assert encoded.scales.tobytes().hex(" ") == "00 00 00 3e 25 49 12 3c"
    literal = {PAYLOAD: np.frombuffer(bytes.fromhex("5f9801"), np.uint8),
               SCALES: np.frombuffer(bytes.fromhex("00 00 00 3e 25 49 12 3c"), "<f4"),
               "bn.num_batches_tracked": np.array(5, np.int64)}
    decoded = decode(Encoded.from_arrays(header, literal), reference)
    assert decoded["w"].tolist() == [1.375, -0.625, 0, 1.125, 1.9375]

    reference = {"v": np.zeros((2, 8), np.float32)}
    change = np.array([[0.01, -3.0, 0.2, 0, 0, 0.5, 0, 0], [0, 0, 0, 1.5, 0, 0, -0.75, 0.02]], np.float32)
    encoded = encode({"v": change}, reference, CodecSpec(name="topk+q8", keep=0.25), np.random.default_rng(0))
    assert encoded.header.tensors[0].index == "bitmap"
    assert [encoded.arrays()[k].tobytes().hex(" ") for k in (PAYLOAD, SCALES, INDEX)] == [
        "01 95 c0 61", "07 83 c1 3c", "22 48"]
    got = dequantize(encoded)["v"].reshape(-1)
    assert np.flatnonzero(got).tolist() == [1, 5, 11, 14]
    np.testing.assert_allclose(got[[1, 5, 11, 14]], [-3.0000002, 0.496063, 1.511811, -0.7322835], rtol=1e-6)
