"""Secure aggregation's masking (edgepfl/secagg.py): the unmasked sum is the plaintext sum,
bit for bit, with or without dropouts; what one agent sends reveals nothing by itself; too
few shares reconstruct nothing; a share opens only for its recipient in its round."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.secagg import (
    Masker,
    RoundKeys,
    SecAggError,
    default_degree,
    neighbour_graph,
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


def test_an_agent_that_dropped_beside_survivors_must_be_recovered_before_unmasking():
    ids, graph, keys, inputs, maskers = round_of(6, 32)
    survivors = ids[1:]
    total = sum((maskers[a].masked(inputs[a]) for a in survivors), start=np.zeros(257, dtype=np.uint32))
    seeds, _ = recover(ids, graph, keys, maskers, set(survivors))
    with pytest.raises(SecAggError, match="no mask key"):
        unmask(total, survivors, graph, {a: keys[a].mask_public for a in ids}, seeds, {}, 32, CONTEXT)
