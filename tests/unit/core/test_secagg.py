"""Secure aggregation's masking (edgepfl/secagg.py): the unmasked sum is the plaintext sum,
bit for bit, with or without dropouts; what one agent sends reveals nothing by itself; too
few shares reconstruct nothing; a share opens only for its recipient in its round; the
batched Shamir reconstruction is PyCryptodome's ``Shamir.combine``, bit for bit."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
from Crypto.Protocol.SecretSharing import Shamir, _Element
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepfl.secagg import (
    EncryptedShare,
    Masker,
    RoundKeys,
    SecAggError,
    _gf_inverse,
    _gf_mul,
    _lagrange_at_zero,
    default_degree,
    neighbour_graph,
    reconstruct_many,
    reconstruct_mask_key,
    reconstruct_seed,
    unmask,
)

CONTEXT = b"fed\0round-7\0session"


def round_of(n: int, bits: int, degree: int | None = None, length: int = 257, seed: int = 0):
    ids = [f"agent-{i:03d}" for i in range(n)]
    graph = neighbour_graph(ids, default_degree(n) if degree is None else degree, b"round seed")
    keys = {a: RoundKeys.generate() for a in ids}
    dtype = np.uint32 if bits == 32 else np.uint64
    rng = np.random.default_rng(seed)
    inputs = {a: rng.integers(0, np.iinfo(dtype).max, size=length, dtype=dtype, endpoint=True) for a in ids}
    maskers = {a: Masker(a, keys[a], {b: keys[b].mask_public for b in graph[a]},
                         {b: keys[b].share_public for b in graph[a]}, threshold=len(graph[a]) // 2 + 1, bits=bits,
                         context=CONTEXT) for a in ids}
    return ids, graph, keys, inputs, maskers


def recover(ids, graph, keys, maskers, survivors):
    """What the coordinator collects from the survivors: each survivor's neighbours' shares of
    its self seed, each dropped agent's neighbours' shares of its mask key."""
    shares = {a: maskers[a].shares_for() for a in ids}  # sent before anyone dropped out
    held: dict[str, dict[str, tuple[int, bytes, bytes]]] = {a: {} for a in ids}  # owner -> holder -> opened share
    for sender, out in shares.items():
        for share in out:
            if share.recipient in survivors:
                held[sender][share.recipient] = maskers[share.recipient].open_share(share, keys[sender].share_public)
    seeds = {a: reconstruct_seed([(i, s) for i, s, _ in held[a].values()], maskers[a].threshold) for a in survivors}
    dropped = {a: reconstruct_mask_key([(i, k) for i, _, k in held[a].values()], maskers[a].threshold)
               for a in ids if a not in survivors and any(b in survivors for b in graph[a])}
    return seeds, dropped


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("n, dropouts", [(6, 0), (30, 0), (30, 10)])
def test_the_unmasked_sum_is_the_plaintext_sum_exactly_also_when_a_third_drop_out(bits, n, dropouts):
    ids, graph, keys, inputs, maskers = round_of(n, bits)
    rng = np.random.default_rng(1)
    dropped = set(rng.choice(ids, size=dropouts, replace=False)) if dropouts else set()
    survivors = [a for a in ids if a not in dropped]
    total = sum((maskers[a].masked(inputs[a]) for a in survivors), start=np.zeros(257, dtype=inputs[ids[0]].dtype))
    seeds, keys_of_dropped = recover(ids, graph, keys, maskers, set(survivors))
    result = unmask(total, survivors, graph, {a: keys[a].mask_public for a in ids}, seeds, keys_of_dropped, bits,
                    CONTEXT)
    expected = sum((inputs[a] for a in survivors), start=np.zeros(257, dtype=inputs[ids[0]].dtype))
    np.testing.assert_array_equal(result, expected)  # modulo 2**bits, bit for bit


def test_the_neighbour_graph_is_sparse_in_large_rounds_and_keeps_a_majority_through_a_third_dropping_out():
    assert default_degree(30) == 29 and default_degree(1000) < 250 and default_degree(10_000) < 250
    ids = [f"a{i:04d}" for i in range(1000)]
    graph = neighbour_graph(ids, default_degree(1000), b"seed")
    assert {len(v) for v in graph.values()} == {default_degree(1000)}
    rng = np.random.default_rng(0)
    for _ in range(5):  # a third of them gone: every agent keeps a majority of its neighbours
        gone = set(rng.choice(ids, size=333, replace=False))
        assert min(sum(b not in gone for b in graph[a]) for a in ids) >= default_degree(1000) // 2 + 1


def test_one_masked_input_does_not_show_its_input_and_the_graph_is_symmetric_and_reproducible():
    ids, graph, keys, inputs, maskers = round_of(12, 32, degree=4)
    assert graph == neighbour_graph(ids, 4, b"round seed") and graph != neighbour_graph(ids, 4, b"another")
    assert all(a in graph[b] for a in ids for b in graph[a]) and {len(v) for v in graph.values()} == {4}
    zeros = np.zeros(257, dtype=np.uint32)
    masked = maskers[ids[0]].masked(zeros)
    # an all-zero input leaves as something that looks like noise: about half its bits set
    assert 0.45 < np.unpackbits(masked.view(np.uint8)).mean() < 0.55
    np.testing.assert_array_equal(maskers[ids[0]].masked(zeros) - masked, zeros)  # deterministic within the round


def test_fewer_shares_than_the_threshold_reconstruct_nothing_and_shares_open_only_for_their_recipient():
    ids, graph, keys, inputs, maskers = round_of(8, 64, degree=6)
    owner = ids[0]
    shares = maskers[owner].shares_for()
    opened = [maskers[s.recipient].open_share(s, keys[owner].share_public) for s in shares]
    t = maskers[owner].threshold
    assert reconstruct_seed([(i, s) for i, s, _ in opened[:t]], t) == maskers[owner].self_seed
    assert reconstruct_mask_key([(i, k) for i, _, k in opened[-t:]], t) == keys[owner].mask_private
    with pytest.raises(SecAggError, match="needed"):
        reconstruct_seed([(i, s) for i, s, _ in opened[:t - 1]], t)
    thief = next(a for a in ids if a not in (owner, shares[0].recipient))
    with pytest.raises(SecAggError):
        maskers[thief].open_share(shares[0], keys[owner].share_public)  # addressed to someone else
    other_round = Masker(shares[0].recipient, keys[shares[0].recipient], {}, {}, 1, 64, b"another round")
    with pytest.raises(SecAggError, match="does not open"):
        other_round.open_share(shares[0], keys[owner].share_public)


def test_the_two_directions_of_an_edge_are_sealed_under_two_keys_so_their_ciphertexts_xor_to_noise():
    """Both ends of an edge derive the same X25519 agreement and seal with the zero nonce: under
    one key per edge (protocol 1.9-1.13) the coordinator, which relays both ciphertexts, read
    the XOR of the two plaintexts, and with one side's revealed share the other side's share —
    of a survivor's mask key once its neighbour dropped out. Each direction's key is its own."""
    ids, graph, keys, inputs, maskers = round_of(3, 64, degree=2)
    a, b = ids[0], ids[1]
    a_to_b = next(s for s in maskers[a].shares_for() if s.recipient == b)
    b_to_a = next(s for s in maskers[b].shares_for() if s.recipient == a)
    plain_ab = _plain(maskers[b].open_share(a_to_b, keys[a].share_public))
    plain_ba = _plain(maskers[a].open_share(b_to_a, keys[b].share_public))
    xor = lambda x, y: bytes(i ^ j for i, j in zip(x, y))  # noqa: E731
    assert len(a_to_b.ciphertext) == len(b_to_a.ciphertext) == len(plain_ab) + 16  # the Poly1305 tag
    assert xor(a_to_b.ciphertext[:50], b_to_a.ciphertext[:50]) != xor(plain_ab, plain_ba)
    # and a share's key opens nothing sealed the other way, even with the other way's associated data
    with pytest.raises(SecAggError, match="does not open"):
        maskers[a].open_share(EncryptedShare(b, a, a_to_b.ciphertext), keys[b].share_public)


def _plain(opened: tuple[int, bytes, bytes]) -> bytes:
    """The plaintext of an opened share: 2-byte index, seed share, mask key share (PROTOCOL.md §19)."""
    index, seed, key = opened
    return index.to_bytes(2, "big") + seed + key


def test_an_agent_that_dropped_beside_survivors_must_be_recovered_before_unmasking():
    ids, graph, keys, inputs, maskers = round_of(6, 32)
    survivors = ids[1:]
    total = sum((maskers[a].masked(inputs[a]) for a in survivors), start=np.zeros(257, dtype=np.uint32))
    seeds, _ = recover(ids, graph, keys, maskers, set(survivors))
    with pytest.raises(SecAggError, match="no mask key"):
        unmask(total, survivors, graph, {a: keys[a].mask_public for a in ids}, seeds, {}, 32, CONTEXT)


elements = st.integers(min_value=0, max_value=2**128 - 1)


@settings(max_examples=200, deadline=None)
@given(elements, elements)
def test_the_field_arithmetic_is_pycryptodomes(a, b):
    assert _gf_mul(a, b) == int(_Element(a) * _Element(b))
    if a:
        assert _gf_inverse(a) == int(_Element(a).inverse())
        assert _gf_mul(a, _gf_inverse(a)) == 1


@st.composite
def share_sets(draw, max_threshold: int = 8):
    """A threshold and shares at distinct indices in a random order, at least ``threshold`` of
    them: either made by ``Shamir.split`` from a random secret (the secret returned too), or
    arbitrary 16-byte values at indices up to 2**16 (what any ``t`` points interpolate to)."""
    threshold = draw(st.integers(1, max_threshold))
    if draw(st.booleans()):
        secret = draw(st.binary(min_size=16, max_size=16))
        shares = Shamir.split(threshold, threshold + draw(st.integers(0, 6)), secret)
        chosen = draw(st.lists(st.sampled_from(shares), min_size=threshold, max_size=len(shares), unique=True))
        return threshold, chosen, secret
    indices = draw(st.lists(st.integers(1, 2**16 - 1), min_size=threshold, max_size=threshold + 4, unique=True))
    return threshold, [(i, draw(st.binary(min_size=16, max_size=16))) for i in indices], None


@settings(max_examples=300, deadline=None)
@given(share_sets())
def test_reconstruction_is_shamir_combine_bit_for_bit_on_random_secrets_thresholds_and_indices(case):
    threshold, shares, secret = case
    expected = Shamir.combine(shares[:threshold])
    assert reconstruct_seed(shares, threshold) == expected
    if secret is not None:
        assert expected == secret
    # a key is two secrets shared at the same indices
    other = [(i, os.urandom(16)) for i, _ in shares]
    key = reconstruct_mask_key([(i, s + o) for (i, s), (_, o) in zip(shares, other)], threshold)
    assert key == expected + Shamir.combine(other[:threshold])


def test_reconstruction_is_shamir_combine_at_the_thresholds_of_large_rounds():
    rng = random.Random(7)
    for threshold, holders in [(50, 99), (100, 198)]:  # 100 agents (everyone a neighbour); 1,000 agents
        indices = rng.sample(range(1, holders + 1), threshold)
        shares = [(i, rng.randbytes(16)) for i in indices]
        assert reconstruct_seed(shares, threshold) == Shamir.combine(shares)
    secret = rng.randbytes(16)
    shares = Shamir.split(20, 40, secret)
    assert reconstruct_seed(rng.sample(shares, 25), 20) == secret


@settings(max_examples=50, deadline=None)
@given(st.lists(share_sets(max_threshold=5), min_size=1, max_size=6), st.data())
def test_a_batch_is_each_secret_reconstructed_alone(cases, data):
    """Groups of one threshold, some of them at the same indices (one set of coefficients)."""
    threshold = min(t for t, _, _ in cases)
    groups = [shares for _, shares, _ in cases]
    groups += [[(i, os.urandom(16)) for i, _ in shares] for shares in data.draw(st.lists(st.sampled_from(groups)))]
    assert reconstruct_many(groups, threshold) == [reconstruct_seed(g, threshold) for g in groups]
    keys = [[(i, s + os.urandom(16)) for i, s in g] for g in groups]
    assert reconstruct_many(keys, threshold, length=32) == [reconstruct_mask_key(g, threshold) for g in keys]
    assert reconstruct_many(iter(keys), threshold, length=32) == [
        Shamir.combine([(i, s[:16]) for i, s in g[:threshold]]) + Shamir.combine([(i, s[16:]) for i, s in g[:threshold]])
        for g in keys]


def test_reconstruction_refuses_too_few_shares_bad_lengths_and_bad_indices():
    shares = Shamir.split(3, 5, b"sixteen byte key")
    with pytest.raises(SecAggError, match="2 shares, 3 needed"):
        reconstruct_seed(shares[:2] + [shares[1]], 3)  # a repeated index counts once
    with pytest.raises(SecAggError, match="2 shares, 3 needed"):
        reconstruct_many([shares, shares[:2]], 3)
    assert reconstruct_seed(shares[:3] + [(9, b"short")], 3) == b"sixteen byte key"  # shares past the threshold unused
    with pytest.raises(SecAggError, match="not 32"):
        reconstruct_mask_key(shares, 3)
    with pytest.raises(SecAggError, match="distinct, from 1"):
        reconstruct_seed([(0, shares[0][1])] + shares[1:], 3)
    with pytest.raises(SecAggError, match="at least one share"):
        reconstruct_seed(shares, 0)
    with pytest.raises(SecAggError, match="blocks of 16"):
        reconstruct_many([shares], 3, length=24)
    _lagrange_at_zero.cache_clear()
    reconstruct_seed(shares[:3], 3)
    reconstruct_seed(shares[2::-1], 3)  # the same indices in another order: the same coefficients
    assert _lagrange_at_zero.cache_info().misses == 1


def test_the_one_revealed_share_off_the_polynomial_is_found_and_two_or_too_few_are_not_guessed():
    """A secret's shares lie on one polynomial of degree threshold - 1: with two or more shares
    beyond the threshold a single wrong one is the one whose removal leaves the rest on one
    polynomial; with one beyond, a wrong share shows but not which; two wrong ones are not told
    apart. The rest rebuild the secret."""
    from Crypto.Protocol.SecretSharing import Shamir

    from edgepfl.secagg import SecAggError, disagreeing_share, reconstruct_mask_key, reconstruct_seed

    secret = os.urandom(16)
    shares = Shamir.split(3, 6, secret)
    assert disagreeing_share(shares, 3) is None
    for k in range(6):
        lied = list(shares)
        lied[k] = (lied[k][0], os.urandom(16))
        assert disagreeing_share(lied, 3) == lied[k][0]
        assert reconstruct_seed([s for s in lied if s[0] != lied[k][0]], 3) == secret
        assert disagreeing_share(lied[:3], 3) is None  # nothing to check three against
    lied = list(shares)
    lied[1] = (lied[1][0], os.urandom(16))
    with pytest.raises(SecAggError, match="no single one"):
        disagreeing_share(lied[:4], 3)
    lied[4] = (lied[4][0], os.urandom(16))
    with pytest.raises(SecAggError, match="no single one"):
        disagreeing_share(lied, 3)
    # a mask key: two 16-byte halves, either of which may be the lie
    key = os.urandom(32)
    halves = [Shamir.split(3, 6, key[:16]), Shamir.split(3, 6, key[16:])]
    joined = [(i, a + b) for (i, a), (_, b) in zip(*halves)]
    joined[2] = (joined[2][0], joined[2][1][:16] + os.urandom(16))
    assert disagreeing_share(joined, 3, 32) == joined[2][0]
    assert reconstruct_mask_key([s for s in joined if s[0] != joined[2][0]], 3) == key
