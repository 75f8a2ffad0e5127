"""tests/foreign_agent/codecs_text.py (the codecs implemented from docs/COMPRESSION.md alone)
against the text's worked examples and the error bounds it states: written with it, from
the text. Plain pytest, numpy only."""

import hashlib
import json
import math

import numpy as np
import pytest

from tests.foreign_agent import codecs_text as ct


class FixedDraws:
    """Stands in for numpy.random.Generator: hands out the given uniforms in order.
    The worked examples give the drawn levels, not a seed, so the examples are reproduced
    with draws that pick those levels."""

    def __init__(self, draws):
        self.draws = list(draws)

    def random(self, size):
        out, self.draws = self.draws[:size], self.draws[size:]
        assert len(out) == size, "ran out of draws"
        return np.asarray(out, dtype=np.float64)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def f32_bits(x):
    return int(np.float32(x).view(np.uint32))


# ---------------------------------------------------------------------------------------
# Worked example 1: q4, block 4: five values and a counter
# ---------------------------------------------------------------------------------------

Q4_REF = {"w": f32([0.5, -0.25, 0, 1, 2]), "bn.num_batches_tracked": np.array(4, dtype=np.int64)}
Q4_UPD = {"w": f32([1.375, -0.6875, 0, 1.125, 1.9375]),
          "bn.num_batches_tracked": np.array(5, dtype=np.int64)}
Q4_HEADER = {"codec": "q4", "block": 4,
             "tensors": [{"name": "w", "shape": [5], "dtype": "float32"}],
             "exact": ["bn.num_batches_tracked"]}
# -3.5 goes up to -3 (u < 0.5); every other value keeps floor(s) or is an integer.
Q4_DRAWS = [0.5, 0.25, 0.5, 0.5, 0.5]


def q4_frame():
    return ct.encode_update(Q4_UPD, Q4_REF, "q4", block=4, rng=FixedDraws(Q4_DRAWS))


def test_q4_example_change_and_exact():
    changes, exact = ct.split_update(Q4_UPD, Q4_REF, "q4")
    assert changes["w"].tolist() == [0.875, -0.4375, 0, 0.125, -0.0625]
    assert list(exact) == ["bn.num_batches_tracked"]


def test_q4_example_header():
    enc = q4_frame()
    assert enc.header == Q4_HEADER
    assert len(enc.header_json().encode()) == 114  # "the header is 114 bytes of JSON"


def test_q4_example_steps_and_scaled_values():
    change = f32([0.875, -0.4375, 0, 0.125, -0.0625])
    steps = ct.block_steps(change, 4, 7)
    assert f32_bits(steps[0]) == 0x3E000000
    assert f32_bits(steps[1]) == 0x3C124925
    assert f"{steps[1]:.7g}" == "0.008928572"
    s = change.astype(np.float64) / ct.steps_per_value(steps, 4, 5).astype(np.float64)
    assert s[:4].tolist() == [7, -3.5, 0, 1]
    assert f"{s[4]:.8g}" == "-6.9999997"
    # "-4 was as likely": the fraction of -3.5 is exactly one half
    assert s[1] - math.floor(s[1]) == 0.5
    q_up = ct.stochastic_levels(change, ct.steps_per_value(steps, 4, 5), 7, np.array(Q4_DRAWS))
    assert q_up.tolist() == [7, -3, 0, 1, -7]
    q_down = ct.stochastic_levels(change, ct.steps_per_value(steps, 4, 5), 7,
                                  np.array([0.5, 0.75, 0.5, 0.5, 0.5]))
    assert q_down.tolist() == [7, -4, 0, 1, -7]


def test_q4_example_bytes():
    enc = q4_frame()
    assert enc.arrays[ct.PAYLOAD].tobytes() == bytes.fromhex("5f9801")
    assert enc.arrays[ct.SCALES].astype("<f4").tobytes() == bytes.fromhex("0000003e2549123c")
    assert enc.arrays["bn.num_batches_tracked"].astype("<i8").tobytes() == bytes.fromhex("0500000000000000")
    assert set(enc.arrays) == {ct.PAYLOAD, ct.SCALES, "bn.num_batches_tracked"}
    # codes 15, 5, 8, 9, 1
    pay = enc.arrays[ct.PAYLOAD].tobytes()
    assert ct.unpack_codes(pay, 5, 4, "w").tolist() == [15, 5, 8, 9, 1]
    # "11 bytes of streams for a 20-byte tensor"
    assert enc.arrays[ct.PAYLOAD].nbytes + enc.arrays[ct.SCALES].nbytes == 11


def test_q4_example_decoding():
    enc = q4_frame()
    changes, info = ct.decode_changes(enc.header, enc.arrays)
    assert changes["w"].tolist() == [0.875, -0.375, 0, 0.125, -0.0625]
    out = ct.decode(enc.header, enc.arrays, Q4_REF)
    assert out["w"].dtype == np.float32
    assert out["w"].tolist() == [1.375, -0.625, 0, 1.125, 1.9375]
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 5


def test_q4_example_decoding_from_the_bytes_as_printed():
    arrays = {ct.PAYLOAD: np.frombuffer(bytes.fromhex("5f9801"), np.uint8),
              ct.SCALES: np.frombuffer(bytes.fromhex("0000003e2549123c"), "<f4"),
              "bn.num_batches_tracked": np.frombuffer(bytes.fromhex("0500000000000000"), "<i8").reshape(())}
    out = ct.decode(json.loads(json.dumps(Q4_HEADER)), arrays, Q4_REF)
    assert out["w"].tolist() == [1.375, -0.625, 0, 1.125, 1.9375]


def test_q4_example_through_a_safetensors_body():
    enc = q4_frame()
    body = ct.dump_body(enc.arrays)
    n = int.from_bytes(body[:8], "little")
    assert n % 8 == 0
    arrays = ct.load_body(body)
    assert ct.decode(enc.header, arrays, Q4_REF)["w"].tolist() == [1.375, -0.625, 0, 1.125, 1.9375]


# ---------------------------------------------------------------------------------------
# Worked example 2: topk+q8, keep 0.25: a 2 x 8 tensor
# ---------------------------------------------------------------------------------------

TK_CHANGE = f32([[0.01, -3.0, 0.2, 0, 0, 0.5, 0, 0],
                 [0, 0, 0, 1.5, 0, 0, -0.75, 0.02]])
TK_HEADER_JSON = ('{"codec":"topk+q8","block":256,"tensors":[{"name":"v","shape":[2,8],'
                  '"dtype":"float32","kept":4,"index":"bitmap"}],"exact":[]}')
TK_DRAWS = [0.5, 0.5, 0.25, 0.125]  # levels -127, 21, 64, -31


def tk_frame():
    ref = {"v": np.zeros((2, 8), np.float32)}
    return ct.encode_update({"v": TK_CHANGE.copy()}, ref, "topk+q8", block=256, keep=0.25,
                            rng=FixedDraws(TK_DRAWS)), ref


def test_topk_example_header():
    enc, _ = tk_frame()
    assert enc.header_json() == TK_HEADER_JSON


def test_topk_example_kept_positions_and_steps():
    flat = TK_CHANGE.reshape(-1)
    assert ct.kept_count(16, 0.25) == 4
    pos = ct.top_k_positions(flat, 4)
    assert pos.tolist() == [1, 5, 11, 14]
    assert flat[pos].tolist() == [-3.0, 0.5, 1.5, -0.75]
    steps = ct.block_steps(flat[pos], 256, 127)
    assert steps.size == 1 and f32_bits(steps[0]) == 0x3CC18307
    assert f"{steps[0]:.8g}" == "0.023622049"
    s = flat[pos].astype(np.float64) / np.float64(steps[0])
    # printed as "-127, 21.17, 63.5, -31.75"
    assert [round(v, 2) for v in s.tolist()] == [-127.0, 21.17, 63.5, -31.75]
    q = ct.stochastic_levels(flat[pos], np.repeat(steps, 4), 127, np.array(TK_DRAWS))
    assert q.tolist() == [-127, 21, 64, -31]
    assert (q + 128).tolist() == [1, 149, 192, 97]


def test_topk_example_bytes():
    enc, _ = tk_frame()
    assert enc.arrays[ct.PAYLOAD].tobytes() == bytes.fromhex("0195c061")
    assert enc.arrays[ct.SCALES].astype("<f4").tobytes() == bytes.fromhex("0783c13c")
    assert enc.arrays[ct.INDEX].tobytes() == bytes.fromhex("2248")
    # the bitmap (2 bytes) beats four gaps (1, 3, 5, 2: 4 bytes)
    pos = np.array([1, 5, 11, 14])
    assert ct.gaps_of(pos) == [1, 3, 5, 2]
    assert len(ct.gaps_encode(pos)) == 4
    assert ct.choose_index(pos, 16) == ("bitmap", bytes.fromhex("2248"))


def test_topk_example_decoding():
    enc, ref = tk_frame()
    out = ct.decode(enc.header, enc.arrays, ref)["v"].reshape(-1)
    nz = np.flatnonzero(out)
    assert nz.tolist() == [1, 5, 11, 14]
    printed = ["-3.0000002", "0.496063", "1.511811", "-0.7322835"]
    got = out[nz]
    # bit-exact float32(q * step)
    step = np.float32(np.uint32(0x3CC18307).view(np.float32))
    assert [f32_bits(g) for g in got] == [f32_bits(np.float32(q) * step) for q in (-127, 21, 64, -31)]
    # as printed (the text prints 8, 6, 7 and 7 significant digits)
    assert f"{got[0]:.8g}" == printed[0]
    assert [f"{g:.7g}" for g in got[1:]] == printed[1:]
    assert (out[np.setdiff1d(np.arange(16), nz)] == 0).all()


# ---------------------------------------------------------------------------------------
# Worked example 3: Gaps: 3 of 3000
# ---------------------------------------------------------------------------------------

def test_gaps_example():
    pos = np.array([5, 300, 2999])
    assert ct.gaps_of(pos) == [5, 294, 2698]
    assert ct.varint_encode(5) == bytes.fromhex("05")
    assert ct.varint_encode(294) == bytes.fromhex("a602")
    assert ct.varint_encode(2698) == bytes.fromhex("8a15")
    assert ct.gaps_encode(pos) == bytes.fromhex("05a6028a15")
    assert len(ct.bitmap_encode(pos, 3000)) == 375
    assert ct.choose_index(pos, 3000) == ("gaps", bytes.fromhex("05a6028a15"))
    cur = ct._Cursor(bytes.fromhex("05a6028a15"))
    assert ct.read_index(cur, "gaps", 3000, 3, "t").tolist() == [5, 300, 2999]
    assert cur.pos == 5


def test_gaps_example_in_a_frame():
    change = np.zeros(3000, np.float32)
    change[[5, 300, 2999]] = [1.0, -2.0, 0.5]
    enc = ct.encode_update({"t": change}, {"t": np.zeros(3000, np.float32)}, "topk+q4",
                           block=256, keep=0.001, rng=np.random.default_rng(0))
    assert enc.header["tensors"][0]["kept"] == 3 and enc.header["tensors"][0]["index"] == "gaps"
    assert enc.arrays[ct.INDEX].tobytes() == bytes.fromhex("05a6028a15")


# ---------------------------------------------------------------------------------------
# Worked example 4: a release delta
# ---------------------------------------------------------------------------------------

def test_release_delta_example():
    base = b"HEAD" + bytes.fromhex("0000003f000080bf") + b"TAIL"
    assert len(base) == 16
    assert ct.run_values(base, 4, 2).tolist() == [0.5, -1.0]
    expected = b"HEAD" + bytes.fromhex("0000a03f0000c0bf") + b"TAIL"
    delta = {"base_sha256": hashlib.sha256(base).hexdigest(), "runs": [[4, 2]],
             "codec": {"codec": "q4", "block": 256,
                       "tensors": [{"name": "run-0", "shape": [2], "dtype": "float32"}],
                       "exact": []}}
    arrays = {ct.SCALES: np.frombuffer(bytes.fromhex("0000803e"), "<f4"),
              ct.PAYLOAD: np.frombuffer(bytes([0x6B]), np.uint8)}
    assert arrays[ct.SCALES].tolist() == [0.25]
    assert ct.unpack_codes(bytes([0x6B]), 2, 4, "run-0").tolist() == [11, 6]
    changes, _ = ct.decode_changes(delta["codec"], arrays)
    assert changes["run-0"].tolist() == [0.75, -0.5]
    out = ct.apply_release_delta(base, delta, arrays, hashlib.sha256(expected).hexdigest())
    assert out == expected
    assert ct.run_values(out, 4, 2).tolist() == [1.25, -1.5]
    # a wrong hash, a wrong base and runs that do not fit are refused
    with pytest.raises(ct.DeltaRefused):
        ct.apply_release_delta(base, delta, arrays, hashlib.sha256(base).hexdigest())
    with pytest.raises(ct.DeltaRefused):
        ct.apply_release_delta(expected, delta, arrays, hashlib.sha256(expected).hexdigest())
    bad = dict(delta, runs=[[12, 2]])
    with pytest.raises(ct.DeltaRefused):
        ct.apply_release_delta(base, bad, arrays, hashlib.sha256(expected).hexdigest())


# ---------------------------------------------------------------------------------------
# Round trips and the stated error bound
# ---------------------------------------------------------------------------------------

SHAPES = [(), (1,), (7,), (3, 5), (4, 4, 9), (1000,), (0,), (2, 0)]
BLOCKS = [1, 3, 4, 64, 256]
KEEPS = [0.01, 0.1, 0.25, 0.5, 0.99]


def _random_case(rng, shape):
    ref = rng.standard_normal(shape).astype(np.float32)
    change = (rng.standard_normal(shape) * rng.choice([1e-4, 1e-2, 1.0, 50.0])).astype(np.float32)
    if change.size > 3:
        change.reshape(-1)[rng.integers(0, change.size, 3)] = 0  # some zeros
    upd = (ref + change).astype(np.float32)
    return ref, upd


def _check_round_trip(codec, shape, block, keep, seed):
    rng = np.random.default_rng(seed)
    ref, upd = _random_case(rng, shape)
    enc = ct.encode_update({"x": upd}, {"x": ref}, codec, block=block, keep=keep,
                           rng=np.random.default_rng(seed + 1))
    x = (upd.astype(np.float64) - ref.astype(np.float64)).reshape(-1)  # the change the encoder sent (float64)
    bits, topk = ct.CODECS[codec]
    n = x.size
    entry = enc.header["tensors"][0]
    m = entry["kept"] if topk else n
    if topk:
        assert m == min(n, max(1, math.ceil(keep * n)))
    # stream sizes as the text lays them out
    assert enc.arrays[ct.PAYLOAD].size == (m if bits == 8 else -(-m // 2))
    assert enc.arrays[ct.SCALES].size == -(-m // block)
    if topk:
        isize = -(-n // 8) if entry["index"] == "bitmap" else enc.arrays[ct.INDEX].size
        assert enc.arrays[ct.INDEX].size == isize
    # the frame survives JSON and a safetensors body
    header = json.loads(enc.header_json())
    arrays = ct.load_body(ct.dump_body(enc.arrays))
    changes, info = ct.decode_changes(header, arrays)
    d = changes["x"]
    out = ct.decode(header, arrays, {"x": ref})["x"]
    assert out.shape == shape and out.dtype == np.float32
    # the update is float32(reference + change), one addition
    assert np.array_equal((ref.reshape(-1) + d).reshape(shape), out)
    sent = info["x"]["positions"] if topk else np.arange(n)
    step = info["x"]["step"].astype(np.float64)
    # every sent value within one step of its change, plus float32's rounding of q*step
    err = np.abs(d[sent].astype(np.float64) - x[sent].astype(np.float64))
    assert (err <= step + 0.5 * np.spacing(np.abs(d[sent])).astype(np.float64)).all()
    # level is floor(s) or floor(s)+1
    s = np.where(step > 0, x[sent].astype(np.float64) / np.where(step > 0, step, 1), 0)
    q = info["x"]["levels"]
    assert ((q == np.floor(s)) | (q == np.floor(s) + 1)).all()
    assert (np.abs(q) <= ct.levels_of(bits)).all()
    # the step is the block's largest sent magnitude / L rounded up to float32
    if m:
        L = ct.levels_of(bits)
        for b in range(-(-m // block)):
            a = float(np.abs(x[sent][b * block:(b + 1) * block]).max())
            st = np.float32(step[b * block])
            assert float(st) >= a / L and (st == 0 or float(np.nextafter(st, np.float32(0))) < a / L)
    # top-k: the kept are the largest magnitudes (ties: earlier), unsent decode to no change
    if topk:
        mask = np.ones(n, bool)
        mask[sent] = False
        assert (d[mask] == 0).all()
        assert np.array_equal(out.reshape(-1)[mask], ref.reshape(-1)[mask])
        if mask.any() and m:
            assert np.abs(x[sent]).min() >= np.abs(x[mask]).max()


@pytest.mark.parametrize("codec", ["q8", "q4"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_dense_round_trip(codec, shape, block):
    seed = 100 * ["q8", "q4"].index(codec) + 10 * SHAPES.index(shape) + BLOCKS.index(block)
    _check_round_trip(codec, shape, block, None, seed=seed)


@pytest.mark.parametrize("codec", ["topk+q8", "topk+q4"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", [1, 3, 256])
@pytest.mark.parametrize("keep", KEEPS)
def test_topk_round_trip(codec, shape, block, keep):
    _check_round_trip(codec, shape, block, keep, seed=7)


def test_several_tensors_share_the_streams_in_header_order():
    rng = np.random.default_rng(3)
    ref = {"a": rng.standard_normal(5).astype(np.float32),
           "b.weight": rng.standard_normal((3, 3)).astype(np.float32),
           "b.running_mean": np.zeros(3, np.float32),
           "c": np.zeros(2, np.float16),
           "head.weight": rng.standard_normal(4).astype(np.float32)}
    upd = {k: (v + np.asarray(0.1, v.dtype)).astype(v.dtype) for k, v in ref.items()}
    upd["stat/counts"] = np.arange(3, dtype=np.int64)
    enc = ct.encode_update(upd, ref, "topk+q4", block=2, keep=0.5,
                           rng=np.random.default_rng(0), exact_prefixes=["head"])
    assert [t["name"] for t in enc.header["tensors"]] == ["a", "b.weight"]
    assert enc.header["exact"] == ["b.running_mean", "c", "head.weight", "stat/counts"]
    out = ct.decode(enc.header, enc.arrays, ref)
    assert set(out) == set(upd)
    for k in enc.header["exact"]:
        assert out[k].dtype == upd[k].dtype and np.array_equal(out[k], upd[k])


def test_kept_count_is_the_float64_product():
    # GAP 9: ceil(keep * n) of the float64 product, so 0.07 * 100 = 7.000000000000001 keeps 8
    assert ct.kept_count(100, 0.07) == 8
    assert ct.kept_count(30, 0.1) == 3
    assert ct.kept_count(16, 0.25) == 4
    assert ct.kept_count(3, 0.01) == 1
    assert ct.kept_count(0, 0.5) == 0  # GAP 10: an empty tensor keeps nothing


def test_all_zero_change_and_ties():
    z = np.zeros(5, np.float32)
    enc = ct.encode_update({"z": z}, {"z": z}, "q8", block=2, rng=np.random.default_rng(0))
    assert enc.arrays[ct.SCALES].tolist() == [0, 0, 0]
    assert enc.arrays[ct.PAYLOAD].tolist() == [128] * 5
    enc = ct.encode_update({"z": z}, {"z": z}, "topk+q4", block=2, keep=0.01,
                           rng=np.random.default_rng(0))
    assert enc.header["tensors"][0]["kept"] == 1  # at least one, the earliest of the ties
    assert enc.arrays[ct.INDEX].tolist() == [1] and enc.arrays[ct.PAYLOAD].tolist() == [8]
    t = f32([1, -2, 2, -2, 1])
    assert ct.top_k_positions(t, 2).tolist() == [1, 2]


def test_stochastic_rounding_is_unbiased():
    x = f32([0.3, -0.77, 0.01, 1.0, -0.5, 0.123])
    rng = np.random.default_rng(12345)
    acc = np.zeros(6)
    N = 4000
    for _ in range(N):
        enc = ct.encode_changes({"x": x}, {}, "q4", block=6, rng=rng)
        acc += ct.decode_changes(enc.header, enc.arrays)[0]["x"]
    step = float(enc.arrays[ct.SCALES][0])
    # standard error of the mean <= step / (2 sqrt(N)); allow 5 of them
    assert np.abs(acc / N - x).max() < 5 * step / (2 * math.sqrt(N))


def test_same_seed_same_bytes():
    x = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    a = ct.encode_changes({"x": x}, {}, "q4", 64, rng=np.random.default_rng([1, 2, 3]))
    b = ct.encode_changes({"x": x}, {}, "q4", 64, rng=np.random.default_rng([1, 2, 3]))
    assert ct.dump_body(a.arrays) == ct.dump_body(b.arrays)


# ---------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------

def _reason(header, arrays, reference):
    with pytest.raises(ct.CodecError) as e:
        ct.decode(header, arrays, reference)
    return e.value.reason


def _q4():
    enc = q4_frame()
    return json.loads(json.dumps(enc.header)), dict(enc.arrays)


def test_refusals_malformed_header():
    for key, val in [("codec", "q16"), ("block", 0), ("block", 2 ** 20 + 1), ("block", True),
                     ("block", 4.0), ("tensors", {})]:
        h, a = _q4()
        h[key] = val
        assert _reason(h, a, Q4_REF) == "malformed", (key, val)
    h, a = _q4()
    h["tensors"][0]["shape"] = [-5]
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    h["tensors"][0]["kept"] = 5
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    h["exact"].append("w")
    assert _reason(h, a, Q4_REF) == "malformed"


def test_refusals_malformed_streams():
    h, a = _q4()
    a["extra"] = np.zeros(1, np.float32)
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    del a[ct.SCALES]
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    a[ct.SCALES] = a[ct.SCALES].astype(np.float64)
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    a[ct.PAYLOAD] = a[ct.PAYLOAD].reshape(1, 3)
    assert _reason(h, a, Q4_REF) == "malformed"
    for bad in (-0.125, np.nan, np.inf):
        h, a = _q4()
        a[ct.SCALES] = f32([bad, 0.0089])
        assert _reason(h, a, Q4_REF) == "malformed", bad
    h, a = _q4()  # -0.0 is a step of zero (the text): its block decodes to no change
    a[ct.SCALES] = f32([-0.0, 0.0089])
    changes, _ = ct.decode_changes(h, a)
    assert (changes["w"][:4] == 0).all()
    for pay in ("5f9811", "509801", "5f98", "5f980100", "5f9800"):
        h, a = _q4()
        a[ct.PAYLOAD] = np.frombuffer(bytes.fromhex(pay), np.uint8)
        assert _reason(h, a, Q4_REF) == "malformed", pay
    h, a = _q4()
    a[ct.SCALES] = a[ct.SCALES][:1]
    assert _reason(h, a, Q4_REF) == "malformed"
    h, a = _q4()
    a[ct.SCALES] = np.concatenate([a[ct.SCALES], f32([1])])
    assert _reason(h, a, Q4_REF) == "malformed"
    # 8 bits: code 0
    enc, ref = tk_frame()
    a = dict(enc.arrays)
    a[ct.PAYLOAD] = np.frombuffer(bytes.fromhex("0095c061"), np.uint8)
    assert _reason(enc.header, a, ref) == "malformed"


def test_refusals_malformed_index():
    enc, ref = tk_frame()
    for idx in ("2249", "22", "224800", "2208"):  # popcount, short, long, kept != bits
        a = dict(enc.arrays)
        a[ct.INDEX] = np.frombuffer(bytes.fromhex(idx), np.uint8)
        assert _reason(enc.header, a, ref) == "malformed", idx
    h = json.loads(json.dumps(enc.header))
    h["tensors"][0]["index"] = "gaps"
    # past n, over-long, too short, too long, non-minimal
    for idx in ("0103058002", "01030580808080800102", "010305ff", "0103050200", "0103058200"):
        a = dict(enc.arrays)
        a[ct.INDEX] = np.frombuffer(bytes.fromhex(idx), np.uint8)
        assert _reason(h, a, ref) == "malformed", idx
    a = dict(enc.arrays)
    a[ct.INDEX] = np.frombuffer(bytes.fromhex("01030502"), np.uint8)
    assert ct.decode(h, a, ref)["v"].reshape(-1).nonzero()[0].tolist() == [1, 5, 11, 14]
    a[ct.INDEX] = np.frombuffer(bytes.fromhex("01030509"), np.uint8)  # position 21 >= 16
    assert _reason(h, a, ref) == "malformed"
    # non-minimal and over-long varints
    with pytest.raises(ct.CodecError):
        ct.varint_decode(bytes.fromhex("8000"), 0, "t")
    with pytest.raises(ct.CodecError):
        ct.varint_decode(bytes.fromhex("808080808001"), 0, "t")
    assert ct.varint_decode(bytes.fromhex("ffffffff0f"), 0, "t") == (2 ** 32 - 1, 5)


def test_refusals_reference_and_values():
    h, a = _q4()
    assert _reason(h, a, {"bn.num_batches_tracked": Q4_REF["bn.num_batches_tracked"]}) == "wrong_tensors"
    assert _reason(h, a, {"w": f32([1, 2, 3, 4, 5, 6])}) == "wrong_shape"
    assert _reason(h, a, {"w": Q4_REF["w"].astype(np.float64)}) == "wrong_shape"
    a[ct.SCALES] = f32([1e38, 0.0089])  # 7 * 1e38 is past float32's range
    assert _reason(h, a, Q4_REF) == "non_finite"


# ---------------------------------------------------------------------------------------
# Error feedback
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("codec,keep", [("q8", None), ("q4", None), ("topk+q8", 0.1), ("topk+q4", 0.25)])
def test_error_feedback(codec, keep):
    rng = np.random.default_rng(5)
    ef = ct.ErrorFeedback()
    ref = rng.standard_normal(200).astype(np.float32)
    true_sum = np.zeros(200)
    dec_sum = np.zeros(200)
    draws = np.random.default_rng(6)
    for _ in range(20):
        change = (rng.standard_normal(200) * 0.01).astype(np.float32)
        upd = (ref + change).astype(np.float32)
        enc = ef.encode({"x": upd}, {"x": ref}, codec, block=32, keep=keep, rng=draws)
        dec = ct.decode(enc.header, enc.arrays, {"x": ref})["x"]
        true_sum += (upd - ref).astype(np.float64)
        dec_sum += (dec - ref).astype(np.float64)
        if keep is None:
            _, info = ct.decode_changes(enc.header, enc.arrays)
            step = info["x"]["step"]
            assert (np.abs(ef.residual["x"]) <= step * (1 + 1e-5) + 1e-7).all()
        ref = dec
    # the decoded changes add up to the true ones less the last residual
    assert np.allclose(dec_sum + ef.residual["x"], true_sum, atol=1e-5)
    # reset when the names or shapes change
    ef.encode({"y": f32([1.0])}, {"y": f32([0.0])}, codec, block=32, keep=keep, rng=draws)
    assert set(ef.residual) == {"y"}


# ---------------------------------------------------------------------------------------
# Task deltas
# ---------------------------------------------------------------------------------------

def test_tensors_digest_layout():
    t = {"b": np.arange(3, dtype=np.int64), "a": f32([[1, 2]]), "s": np.float32(2.5),
         "é": np.array([True]), "u": np.zeros(0, np.uint8)}
    h = hashlib.sha256()
    h.update(b"a\0<f4\x001,2\0" + f32([[1, 2]]).astype("<f4").tobytes())
    h.update(b"b\0<i8\x003\0" + np.arange(3).astype("<i8").tobytes())
    h.update(b"s\0<f4\0\0" + f32(2.5).astype("<f4").tobytes())
    h.update(b"u\0|u1\x000\0")
    h.update("é".encode() + b"\0|b1\x001\0\x01")
    assert ct.tensors_digest(t) == h.hexdigest()
    big = {"x": np.arange(3, dtype=">f4")}
    assert ct.tensors_digest(big) == ct.tensors_digest({"x": np.arange(3, dtype="<f4")})


def test_task_delta_round_trip():
    rng = np.random.default_rng(9)
    prev = {"enc.w": rng.standard_normal((4, 6)).astype(np.float32),
            "enc.bn.running_var": np.ones(4, np.float32),
            "enc.bn.num_batches_tracked": np.array(3, np.int64),
            "head.w": rng.standard_normal(5).astype(np.float32)}
    new = {k: (v + (rng.standard_normal(v.shape) * 0.01).astype(v.dtype)) if v.dtype == np.float32
           else v + 1 for k, v in prev.items()}
    adopted, rounding = ct.round_state(prev, new, "q4", 8, seed=0, round_=3)
    adopted2, _ = ct.round_state(prev, new, "q4", 8, seed=0, round_=3)
    assert all(np.array_equal(adopted[k], adopted2[k]) for k in adopted)  # reproducible
    # the BatchNorm statistics and integers are not rounded
    assert np.array_equal(adopted["enc.bn.running_var"], new["enc.bn.running_var"])
    assert int(adopted["enc.bn.num_batches_tracked"]) == 4
    # an agent whose task carries the encoder, a server extra and its own head
    base_task = {"enc.w": prev["enc.w"], "enc.bn.running_var": prev["enc.bn.running_var"],
                 "enc.bn.num_batches_tracked": prev["enc.bn.num_batches_tracked"],
                 "server/c": f32([1, 2])}
    task = {"enc.w": adopted["enc.w"], "enc.bn.running_var": adopted["enc.bn.running_var"],
            "enc.bn.num_batches_tracked": adopted["enc.bn.num_batches_tracked"],
            "server/c": f32([3, 4])}
    header, body = ct.task_delta_frame(rounding, task)
    assert [t["name"] for t in header["tensors"]] == ["enc.w"]
    downlink = {"base_round": 2, "codec": header, "digest": ct.tensors_digest(task)}
    got = ct.apply_task_delta(base_task, downlink, body)
    assert ct.tensors_digest(got) == ct.tensors_digest(task)
    for k in task:
        assert np.array_equal(got[k], task[k]) and got[k].dtype == task[k].dtype
    # a wrong base is refused with no_base
    wrong = dict(base_task, **{"enc.w": base_task["enc.w"] + np.float32(1e-3)})
    with pytest.raises(ct.DeltaRefused) as e:
        ct.apply_task_delta(wrong, downlink, body)
    assert e.value.reason == "no_base"


# ---------------------------------------------------------------------------------------
# Release deltas
# ---------------------------------------------------------------------------------------

def test_release_round_trip_over_releases():
    rng = np.random.default_rng(11)
    w1 = rng.standard_normal(37).astype("<f4")
    w2 = rng.standard_normal(5).astype("<f4")

    def artifact(a, b):
        return b"\x08\x01hdr" + a.tobytes() + b"mid" + b.tobytes() + b"end"

    runs = [[5, 37], [5 + 4 * 37 + 3, 5]]
    release = artifact(w1, w2)
    model1, model2 = w1.copy(), w2.copy()
    for r in range(12):
        model1 = (model1 + rng.standard_normal(37).astype("<f4") * np.float32(0.05)).astype("<f4")
        model2 = (model2 + rng.standard_normal(5).astype("<f4") * np.float32(0.05)).astype("<f4")
        export = artifact(model1, model2)
        out, delta, arrays = ct.make_release(release, export, runs, "q4", 256, seed=1, round_=r)
        again, _, _ = ct.make_release(release, export, runs, "q4", 256, seed=1, round_=r)
        assert again == out  # a rerun releases the same bytes
        assert delta is not None
        assert ct.apply_release_delta(release, delta, arrays, hashlib.sha256(out).hexdigest()) == out
        # within one step of the model it came from, not adding up over releases
        step = float(arrays[ct.SCALES][0])
        assert np.abs(ct.run_values(out, 5, 37) - model1).max() <= step * (1 + 1e-6)
        assert out[:5] == export[:5] and out[-3:] == export[-3:]
        release = out
    # another graph: whole
    other = b"\x08\x02hdr" + release[5:]
    assert ct.make_release(release, other, runs, "q4", 256, 1, 99)[1] is None


def test_error_feedback_bound_with_a_large_reference():
    # GAP 25: with a reference whose ulp exceeds the step, the residual is bounded by
    # one step plus half an ulp of the decoded value, not by one step
    rng = np.random.default_rng(21)
    ef = ct.ErrorFeedback()
    ref = (rng.standard_normal(500) * 1e4).astype(np.float32)
    draws = np.random.default_rng(22)
    exceeded = False
    for _ in range(5):
        upd = (ref + (rng.standard_normal(500) * 0.01).astype(np.float32)).astype(np.float32)
        enc = ef.encode({"x": upd}, {"x": ref}, "q8", block=32, rng=draws)
        _, info = ct.decode_changes(enc.header, enc.arrays)
        new = ct.decode(enc.header, enc.arrays, {"x": ref})["x"]
        step = info["x"]["step"].astype(np.float64)
        res = np.abs(ef.residual["x"]).astype(np.float64)
        assert (res <= step + 0.5 * np.spacing(np.abs(new)).astype(np.float64)).all()
        exceeded |= bool((res > step).any())
        ref = new
    assert exceeded
