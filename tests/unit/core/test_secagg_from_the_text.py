"""The second secure-aggregation implementation (tests/foreign_agent/secagg.py, written from
docs/PROTOCOL.md §19 alone, by a helper that read nothing else of the project) reproduces
every line of §19.5's test vectors from the inputs the text states, and a round of its own
with a third dropping out unmasks to the plain sum. ``test_secagg_vectors.py`` checks the same
block against the project's implementation, so the two agree through the document.

The block is read from docs/PROTOCOL.md, or from the document named by SECAGG_PROTOCOL_MD.
"""

from __future__ import annotations

import hashlib
import math
import os
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from tests.foreign_agent import secagg

BEGIN = "<!-- secagg vectors: begin -->"
END = "<!-- secagg vectors: end -->"


def _document() -> Path:
    env = os.environ.get("SECAGG_PROTOCOL_MD")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "docs" / "PROTOCOL.md"


def _parse_vectors(text: str) -> dict[str, str]:
    start = text.index(BEGIN) + len(BEGIN)
    stop = text.index(END, start)
    out: dict[str, str] = {}
    for line in text[start:stop].splitlines():
        line = line.strip()
        if not line or line.startswith("```"):
            continue
        name, sep, value = line.partition(" = ")
        assert sep, f"not a `name = value` line: {line!r}"
        assert name not in out, f"duplicate vector {name!r}"
        out[name] = value.strip()
    return out


VECTORS = _parse_vectors(_document().read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------
# §19.5: every input derived from its label
# ---------------------------------------------------------------------------

FEDERATION = "demo"
ROUND = 3
SESSION = "00112233445566778899aabbccddeeff"
AGENTS = ["agent-a", "agent-b", "agent-c", "agent-d"]
DEGREE = 3
THRESHOLD = 2
NUM_TRAIN = {"agent-a": 100, "agent-b": 60, "agent-c": 250, "agent-d": 40}
WEIGHT_CAP = 200
SURVIVORS = ["agent-a", "agent-b", "agent-d"]
DROPPED = "agent-c"
WHICH = ["seed", "key low", "key high"]
DEVS = [f"dev-{k}" for k in range(8)]


def sha(label: str, agent: str, extra: str = "") -> bytes:
    return hashlib.sha256(label.encode() + agent.encode() + extra.encode()).digest()


def mask_private(agent: str) -> bytes:
    return sha("edgepfl vector mask ", agent)


def share_private(agent: str) -> bytes:
    return sha("edgepfl vector share ", agent)


def self_seed(agent: str) -> bytes:
    return sha("edgepfl vector seed ", agent)[:16]


def coefficient(agent: str, which: str) -> bytes:
    return sha("edgepfl vector coefficient ", agent, " " + which)[:16]


def x0() -> dict[str, np.ndarray]:
    return {
        "bias": np.array([0.5, -0.25], dtype=np.float32),
        "num_batches_tracked": np.array(7, dtype=np.int64),
        "weight": np.array([[1, -2], [0.125, 3]], dtype=np.float32),
    }


def trained(agent: str) -> dict[str, np.ndarray]:
    g = sha("edgepfl vector change ", agent)[:6]
    base = x0()
    change = (np.frombuffer(g, dtype=np.uint8).astype(np.float64) - 128.0) / 1024.0
    return {
        "bias": (base["bias"] + change[:2].astype(np.float32)).astype(np.float32),
        "num_batches_tracked": base["num_batches_tracked"] + 2,
        "weight": (base["weight"] + change[2:6].reshape(2, 2).astype(np.float32)).astype(np.float32),
    }


def ring_hex(v: np.ndarray) -> str:
    return np.ascontiguousarray(v, dtype="<u8").tobytes().hex()


def f32_hex(a: np.ndarray) -> str:
    return np.ascontiguousarray(a, dtype="<f4").reshape(-1).tobytes().hex()


def power_of_two(s: float) -> str:
    m, e = math.frexp(s)
    assert m == 0.5
    return f"2^{e - 1}"


@cache
def computed() -> dict[str, str]:
    out: dict[str, str] = {}
    ctx = secagg.context(FEDERATION, ROUND, SESSION)
    out["context"] = ctx.hex()

    ring = secagg._ring_order(DEVS, SESSION)
    out[f"ring order of {', '.join(DEVS)}"] = " ".join(ring)
    out["neighbours of dev-0 at degree 4"] = " ".join(secagg.neighbours(DEVS, 4, SESSION)["dev-0"])

    graph = secagg.neighbours(AGENTS, DEGREE, SESSION)
    assert all(graph[a] == [b for b in AGENTS if b != a] for a in AGENTS)  # degree 3: everyone
    assert DEGREE // 2 + 1 == THRESHOLD

    parts = {a: secagg.Participant(a, mask_private(a), share_private(a), ctx, self_seed(a)) for a in AGENTS}
    for a in AGENTS:
        out[f"{a} mask_private"] = mask_private(a).hex()
        out[f"{a} mask_public"] = parts[a].mask_public.hex()
        assert secagg.x25519_public(mask_private(a)) == parts[a].mask_public
        out[f"{a} share_private"] = share_private(a).hex()
        out[f"{a} share_public"] = parts[a].share_public.hex()
        out[f"{a} self seed b"] = self_seed(a).hex()

    a, b = "agent-a", "agent-b"
    mask_pub = {x: parts[x].mask_public for x in AGENTS}
    share_pub = {x: parts[x].share_public for x in AGENTS}
    out["X25519 agent-a-agent-b mask agreement"] = secagg.x25519(mask_private(a), mask_pub[b]).hex()
    s_ab = secagg.pair_seed(mask_private(a), mask_pub[b], ctx)
    assert s_ab == secagg.pair_seed(mask_private(b), mask_pub[a], ctx)  # the same at both ends
    out["s agent-a agent-b"] = s_ab.hex()
    out["PRG(s agent-a agent-b) first 4 words"] = ring_hex(secagg.prg(s_ab, 4, ctx, b""))
    out["PRG(b agent-a) first 4 words"] = ring_hex(secagg.prg(self_seed(a), 4, ctx, b"self"))
    for which in WHICH:
        out[f"agent-a coefficient of {which}"] = coefficient(a, which).hex()

    # shares: every agent seals to its neighbours; recipients open
    sealed: dict[str, dict[str, bytes]] = {}
    for x in AGENTS:
        roster = {y: (mask_pub[y], share_pub[y]) for y in graph[x]}
        coeffs = {w: [coefficient(x, w)] for w in WHICH}
        sealed[x] = parts[x].sealed_shares(roster, THRESHOLD, coeffs)
        assert sorted(sealed[x]) == graph[x]
    opened = {(x, y): parts[y].open_share(x, share_pub[x], sealed[x][y]) for x in AGENTS for y in graph[x]}

    for y in graph[a]:
        index, seed_share, key_share = opened[(a, y)]
        plaintext = index.to_bytes(2, "big") + seed_share + key_share
        # the plaintext also equals the text's layout built from split() directly
        k = graph[a].index(y) + 1
        assert index == k
        assert seed_share == dict(secagg.split(self_seed(a), THRESHOLD, 3, [coefficient(a, "seed")]))[k]
        assert key_share[:16] == dict(secagg.split(mask_private(a)[:16], THRESHOLD, 3,
                                                   [coefficient(a, "key low")]))[k]
        assert key_share[16:] == dict(secagg.split(mask_private(a)[16:], THRESHOLD, 3,
                                                   [coefficient(a, "key high")]))[k]
        out[f"share agent-a to {y} plaintext"] = plaintext.hex()
        out[f"share agent-a to {y} sealed"] = sealed[a][y].hex()
        key = secagg.share_key(share_private(a), share_pub[y], ctx, a, y)
        assert secagg.open_sealed(key, ctx, a, y, sealed[a][y]) == opened[(a, y)]
        assert secagg.seal(key, ctx, a, y, plaintext) == sealed[a][y]

    out["share key agent-a to agent-b"] = secagg.share_key(share_private(a), share_pub[b], ctx, a, b).hex()
    out["share key agent-b to agent-a"] = secagg.share_key(share_private(b), share_pub[a], ctx, b, a).hex()
    assert (secagg.share_key(share_private(b), share_pub[a], ctx, a, b).hex()
            == out["share key agent-a to agent-b"])  # the recipient derives the same key
    out["share agent-a to agent-b associated data"] = (ctx + b"\x00" + a.encode() + b"\x00" + b.encode()).hex()

    base = x0()
    for name in ("bias", "weight"):
        out[f"grid scale of {name}"] = power_of_two(secagg._grid_scale(base[name])[1])

    masked: dict[str, np.ndarray] = {}
    contributions: dict[str, np.ndarray] = {}
    for x in AGENTS:
        w = secagg._weight(NUM_TRAIN[x], WEIGHT_CAP)
        out[f"{x} weight"] = str(w)
        t = trained(x)
        out[f"{x} trained bias"] = f32_hex(t["bias"])
        out[f"{x} trained weight"] = f32_hex(t["weight"])
        v = secagg.contribution(t, base, w)
        contributions[x] = v
        out[f"{x} contribution v"] = ring_hex(v)
        # masked with exactly the neighbours whose shares its task carried: all four sent shares
        masked[x] = parts[x].masked(v, {y: mask_pub[y] for y in graph[x]})
        out[f"{x} masked y"] = ring_hex(masked[x])

    total = np.zeros_like(masked[a])
    for x in SURVIVORS:
        total += masked[x]
    out["sum of the survivors' masked vectors"] = ring_hex(total)

    # reveal: agent-c's mask key from a (index 1) and b (index 2)
    reveals = []
    for x in ("agent-a", "agent-b"):
        index, _, key_share = opened[(DROPPED, x)]
        out[f"{x} reveals agent-c mask key share (index {index})"] = key_share.hex()
        reveals.append((index, key_share))
    low = secagg.combine([(i, k[:16]) for i, k in reveals], THRESHOLD)
    high = secagg.combine([(i, k[16:]) for i, k in reveals], THRESHOLD)
    assert low + high == mask_private(DROPPED)

    # survivors' seeds rebuilt from the surviving neighbours' shares
    seeds = {}
    for i in SURVIVORS:
        shares = [(opened[(i, y)][0], opened[(i, y)][1]) for y in graph[i] if y in SURVIVORS]
        seeds[i] = secagg.combine(shares, THRESHOLD)
        assert seeds[i] == self_seed(i)

    result = secagg.unmask(total, SURVIVORS, graph, mask_pub, seeds, {DROPPED: low + high}, ctx)
    plain = np.zeros_like(result)
    for x in SURVIVORS:
        plain += contributions[x]
    assert np.array_equal(result, plain)
    out["unmasked sum (int64)"] = " ".join(str(int(z)) for z in result.view(np.int64))
    return out


# ---------------------------------------------------------------------------
# vector tests
# ---------------------------------------------------------------------------

def test_every_vector_line_is_reproduced():
    assert set(VECTORS) == set(computed()), (
        f"in the document only: {sorted(set(VECTORS) - set(computed()))}; "
        f"computed only: {sorted(set(computed()) - set(VECTORS))}")


@pytest.mark.parametrize("name", list(VECTORS))
def test_vector(name):
    got = computed()
    assert name in got, f"no computation for {name!r}"
    assert got[name] == VECTORS[name]


# ---------------------------------------------------------------------------
# properties and round trips
# ---------------------------------------------------------------------------

def test_edge_directions_have_different_keys():
    ctx = secagg.context("fed", 1, os.urandom(16).hex())
    ia, ib = os.urandom(32), os.urandom(32)
    pa, pb = secagg.x25519_public(ia), secagg.x25519_public(ib)
    ab = secagg.share_key(ia, pb, ctx, "i", "j")
    ba = secagg.share_key(ib, pa, ctx, "j", "i")
    assert ab != ba
    assert ab == secagg.share_key(ib, pa, ctx, "i", "j")
    # a share sealed i → j does not open as j → i
    ct = secagg.seal(ab, ctx, "i", "j", bytes(50))
    assert len(ct) == 66
    with pytest.raises(ValueError):
        secagg.open_sealed(ba, ctx, "j", "i", ct)
    with pytest.raises(ValueError):
        secagg.open_sealed(ab, ctx, "j", "i", ct)
    assert secagg.open_sealed(ab, ctx, "i", "j", ct) == (0, bytes(16), bytes(32))


def test_combine_needs_threshold_shares():
    secret = os.urandom(16)
    shares = secagg.split(secret, 3, 5)
    assert secagg.combine(shares[2:], 3) == secret
    assert secagg.combine([shares[4], shares[0], shares[2]], 3) == secret
    with pytest.raises(ValueError):
        secagg.combine(shares[:2], 3)
    with pytest.raises(ValueError):
        secagg.combine([shares[0], shares[0], shares[1]], 3)  # distinct indices only


def test_field():
    for _ in range(20):
        a = int.from_bytes(os.urandom(16), "big") or 1
        assert secagg.gf_mul(a, secagg.gf_inv(a)) == 1
        assert secagg.gf_mul(a, 1) == a
    # x^127 · x = x^128 = x^7 + x^2 + x + 1
    assert secagg.gf_mul(1 << 127, 2) == 0x87
    with pytest.raises(ValueError):
        secagg.gf_inv(0)


def test_default_degree():
    assert secagg.default_degree(6) == 5
    assert secagg.default_degree(50) == 49  # no d < N qualifies at p = 1/3: everyone
    p = 1 / 3

    def chance(n: int, d: int) -> float:
        return n * sum(math.comb(d, i) * (1 - p) ** i * p ** (d - i) for i in range(d // 2 + 1))

    for n in (200, 1000, 10000):
        d = secagg.default_degree(n)
        assert d % 2 == 0 and 4 <= d < n - 1
        assert chance(n, d) <= 1e-3
        assert d == 4 or chance(n, d - 2) > 1e-3


def test_x25519_low_order_point_is_an_error():
    with pytest.raises(ValueError):
        secagg.x25519(os.urandom(32), bytes(32))


def _base_tensors(rng):
    return {
        "a": rng.standard_normal(5).astype(np.float32),
        "b/skip": rng.standard_normal(3).astype(np.float32),  # not shared: has a '/'
        "c": rng.integers(0, 100, size=(2, 3)).astype(np.int64),
        "w": (rng.standard_normal((3, 4)) * 4).astype(np.float32),
    }


def _trained(base, rng):
    new = {k: v.copy() for k, v in base.items()}
    new["a"] = (base["a"] + rng.standard_normal(5).astype(np.float32) * 0.1).astype(np.float32)
    new["b/skip"] = rng.standard_normal(3).astype(np.float32)
    new["c"] = base["c"] + rng.integers(0, 5, size=(2, 3))
    new["w"] = (base["w"] + rng.standard_normal((3, 4)).astype(np.float32) * 0.01).astype(np.float32)
    return new


def test_round_trip_six_agents_one_drops():
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "big"))
    session = os.urandom(16).hex()
    ctx = secagg.context("fleet", 12, session)
    ids = [f"agent-{k}" for k in range(6)]
    degree = 4
    threshold = degree // 2 + 1
    graph = secagg.neighbours(ids, degree, session)
    assert all(len(graph[i]) == degree and i not in graph[i] for i in ids)
    assert all(i in graph[j] for i in ids for j in graph[i])

    parts = {i: secagg.Participant(i, os.urandom(32), os.urandom(32), ctx) for i in ids}
    mask_pub = {i: parts[i].mask_public for i in ids}
    share_pub = {i: parts[i].share_public for i in ids}
    sealed = {i: parts[i].sealed_shares({j: (mask_pub[j], share_pub[j]) for j in graph[i]}, threshold)
              for i in ids}
    assert all(len(ct) == 66 for s in sealed.values() for ct in s.values())
    dropped = ids[int(rng.integers(0, 6))]
    survivors = [i for i in ids if i != dropped]

    # each survivor opens what its neighbours sealed to it
    opened = {(j, i): parts[i].open_share(j, share_pub[j], sealed[j][i]) for i in survivors for j in graph[i]}
    assert all(sum(1 for j in graph[i] if j in survivors) >= threshold for i in survivors)

    base = _base_tensors(rng)
    contributions, total = {}, None
    for i in ids:
        change = _trained(base, rng)
        v = secagg.contribution(change, base, int(rng.integers(1, 200)))
        assert v.dtype == np.dtype("<u8") and v.size == 5 + 6 + 12
        contributions[i] = v
        if i in survivors:
            y = parts[i].masked(v, {j: mask_pub[j] for j in graph[i]})
            assert not np.array_equal(y, v)
            total = y.copy() if total is None else total + y

    seeds = {}
    for i in survivors:
        shares = [(opened[(i, j)][0], opened[(i, j)][1]) for j in graph[i] if j in survivors]
        seeds[i] = secagg.combine(shares, threshold)
    key_shares = [(opened[(dropped, i)][0], opened[(dropped, i)][2]) for i in graph[dropped]]
    low = secagg.combine([(k, s[:16]) for k, s in key_shares], threshold)
    high = secagg.combine([(k, s[16:]) for k, s in key_shares], threshold)

    result = secagg.unmask(total, survivors, graph, mask_pub, seeds, {dropped: low + high}, ctx)
    plain = np.zeros_like(result)
    for i in survivors:
        plain += contributions[i]
    assert np.array_equal(result, plain)
    assert np.array_equal(result.view(np.int64), sum(contributions[i].view(np.int64) for i in survivors))


def test_roster_refusals():
    ctx = secagg.context("f", 0, "00" * 16)
    p = secagg.Participant("me", os.urandom(32), os.urandom(32), ctx)
    other = {k: (secagg.x25519_public(os.urandom(32)), secagg.x25519_public(os.urandom(32))) for k in "abcd"}
    with pytest.raises(ValueError):
        p.sealed_shares({**other, "me": other["a"]}, 3)
    with pytest.raises(ValueError):
        p.sealed_shares(other, 2)  # 2 of 4 is not a strict majority
    assert len(p.sealed_shares(other, 3)) == 4


def test_a_batchnorm_variance_lies_on_the_same_grid_in_both_implementations():
    """§19.3 since 1.17: a running variance (a ``<p>running_var`` beside a float ``<p>running_mean``
    of its shape) has 2^15 · max(1, max |x₀|) of range, every other float tensor 64 · max(1, max |x₀|).
    The worked example has no BatchNorm layer, so the text's contribution is compared with the
    project's directly: a variance 300 times its layer's largest (inside its range, past the old
    one) and a mean moved past its own range (clamped the same way by both)."""
    from edgepfl.aggregation import grid_contribution, ring_vector

    rng = np.random.default_rng(3)
    x0 = {"bn.running_mean": rng.normal(0, 1, 4).astype(np.float32),
          "bn.running_var": rng.uniform(0.5, 2.0, 4).astype(np.float32),
          "bn.num_batches_tracked": np.array(5, np.int64),
          "fc.weight": rng.normal(0, 1, (3, 4)).astype(np.float32),
          # not a BatchNorm variance: no running_mean beside it, so the ordinary range
          "other.running_var": rng.uniform(0.5, 2.0, 3).astype(np.float32),
          # nor this: its prefix does not end in "." ("x" + "running_mean" is no BatchNorm layer's)
          "xrunning_mean": rng.normal(0, 1, 2).astype(np.float32),
          "xrunning_var": rng.uniform(0.5, 2.0, 2).astype(np.float32)}
    x = {k: (v + 1).astype(v.dtype) if v.dtype.kind == "f" else v + 3 for k, v in x0.items()}
    x["bn.running_var"][1] = 300 * x0["bn.running_var"].max()
    x["other.running_var"][0] = 300 * x0["other.running_var"].max()  # past 64 x: clamped into it
    x["xrunning_var"][0] = 300 * x0["xrunning_var"].max()
    x["bn.running_mean"][2] = 1e4  # past its range: clamped
    text = secagg.contribution(x, x0, 17)
    ours = ring_vector(grid_contribution(x, x0, 17), x0).view("<u8")
    assert np.array_equal(text, ours)
    offset = 1 + 4  # sorted order: bn.num_batches_tracked (0-d, one element), bn.running_mean (4), bn.running_var
    _, scale = secagg._grid_scale(x0["bn.running_var"].astype(np.float64), variance=True)
    kept = text.view("<i8")[offset + 1] / (17 * scale) + float(x0["bn.running_var"][1])
    assert kept == pytest.approx(300 * float(x0["bn.running_var"].max()), rel=1e-6)  # not clamped
