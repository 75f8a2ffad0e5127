"""The test vectors of a secure round (docs/PROTOCOL.md §19, "Worked example"), computed by
the project's own implementation (:mod:`edgepfl.secagg`, :mod:`edgepfl.aggregation.secure`).

A second implementation reproduces every line from the inputs the example states; the
document's block is this module's output, checked by ``tests/unit/core/test_secagg_vectors.py``
so the two never drift. Every input is derived from a label by SHA-256, so the example
needs no randomness::

    python -m edgepfl.protocol.secagg_vectors          # the block, as docs/PROTOCOL.md holds it

The round: federation ``demo``, round 3, session ``00112233445566778899aabbccddeeff``; four
trainers ``agent-a`` … ``agent-d`` (degree 3, everyone each other's neighbour, threshold 2);
``agent-c`` dies after its shares went out, so the other three are the survivors and its
mask key is rebuilt from two of their shares.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

__all__ = ["FEDERATION", "IDS", "ROUND", "SESSION", "lines", "main"]

FEDERATION = "demo"
ROUND = 3
SESSION = "00112233445566778899aabbccddeeff"
IDS = ("agent-a", "agent-b", "agent-c", "agent-d")
DROPPED = "agent-c"
THRESHOLD = 2
#: the task's weight cap, and each trainer's num_train (so its weight is min of the two)
WEIGHT_CAP = 200
NUM_TRAIN = {"agent-a": 100, "agent-b": 60, "agent-c": 250, "agent-d": 40}
#: the ids of a larger round, for the ring of a sparse neighbour graph
RING_IDS = tuple(f"dev-{i}" for i in range(8))
RING_DEGREE = 4


def derived(label: str, length: int = 32) -> bytes:
    """The example's input named ``label``: the first ``length`` bytes of SHA-256(label)."""
    return hashlib.sha256(label.encode()).digest()[:length]


def reference() -> dict[str, np.ndarray]:
    """The task's shared tensors (x₀) of the example."""
    return {"bias": np.array([0.5, -0.25], np.float32),
            "num_batches_tracked": np.array(7, np.int64),
            "weight": np.array([[1.0, -2.0], [0.125, 3.0]], np.float32)}


def trained(agent: str) -> dict[str, np.ndarray]:
    """What ``agent`` trained from x₀: a small change of each float (float32), two batches more."""
    x0 = reference()
    step = np.frombuffer(derived(f"edgepfl vector change {agent}", 6), np.uint8).astype(np.float32)
    change = (step - np.float32(128)) / np.float32(1024)
    return {"bias": x0["bias"] + change[:2],
            "num_batches_tracked": x0["num_batches_tracked"] + 2,
            "weight": x0["weight"] + change[2:].reshape(2, 2)}


def _hex(data: bytes | np.ndarray) -> str:
    return (data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()).hex()


def lines() -> Iterator[str]:
    """The example's vectors, one ``name = value`` a line (bytes in hex; ring vectors as the hex
    of their little-endian 8-byte words)."""
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    from edgepfl.aggregation.exact import _ExactSum
    from edgepfl.aggregation.secure import grid_contribution, ring_vector
    from edgepfl.secagg import (
        RING_BITS,
        EncryptedShare,
        Masker,
        RoundKeys,
        _agree,
        _gf_mul,
        _share_aad,
        neighbour_graph,
        pairwise_seed,
        prg,
        reconstruct_mask_key,
        reconstruct_seed,
        session_context,
        share_key,
        unmask,
    )

    context = session_context(FEDERATION, ROUND, SESSION)
    yield f"context = {_hex(context)}"
    ring = neighbour_graph(RING_IDS, RING_DEGREE, bytes.fromhex(SESSION))
    order = sorted(RING_IDS, key=lambda a: hashlib.sha256(bytes.fromhex(SESSION) + a.encode()).digest())
    yield f"ring order of {', '.join(RING_IDS)} = {' '.join(order)}"
    yield f"neighbours of dev-0 at degree {RING_DEGREE} = {' '.join(ring['dev-0'])}"

    keys = {a: RoundKeys(derived(f"edgepfl vector mask {a}"), derived(f"edgepfl vector share {a}")) for a in IDS}
    seeds = {a: derived(f"edgepfl vector seed {a}", 16) for a in IDS}
    for a in IDS:
        yield f"{a} mask_private = {_hex(keys[a].mask_private)}"
        yield f"{a} mask_public = {_hex(keys[a].mask_public)}"
        yield f"{a} share_private = {_hex(keys[a].share_private)}"
        yield f"{a} share_public = {_hex(keys[a].share_public)}"
        yield f"{a} self seed b = {_hex(seeds[a])}"

    a, b = IDS[0], IDS[1]
    pair = pairwise_seed(keys[a].mask_private, keys[b].mask_public, context)
    yield f"X25519 {a}-{b} mask agreement = {_hex(_agree(keys[a].mask_private, keys[b].mask_public))}"
    yield f"s {a} {b} = {_hex(pair)}"
    yield f"PRG(s {a} {b}) first 4 words = {_hex(prg(pair, 4, RING_BITS, context))}"
    yield f"PRG(b {a}) first 4 words = {_hex(prg(seeds[a], 4, RING_BITS, context + b'self'))}"

    # Shamir shares of a's secrets with the example's coefficients: f(x) = secret + c·x (threshold 2)
    secrets = {"seed": seeds[a], "key low": keys[a].mask_private[:16], "key high": keys[a].mask_private[16:]}
    shares: dict[str, dict[int, bytes]] = {}
    for name, secret in secrets.items():
        c = derived(f"edgepfl vector coefficient {a} {name}", 16)
        yield f"{a} coefficient of {name} = {_hex(c)}"
        shares[name] = {i: (int.from_bytes(secret, "big") ^ _gf_mul(int.from_bytes(c, "big"), i)).to_bytes(16, "big")
                        for i in (1, 2, 3)}
    neighbours = [n for n in IDS if n != a]
    for index, n in enumerate(neighbours, start=1):
        plain = index.to_bytes(2, "big") + shares["seed"][index] + shares["key low"][index] + shares["key high"][index]
        key = share_key(_agree(keys[a].share_private, keys[n].share_public), context, a, n)
        sealed = ChaCha20Poly1305(key).encrypt(bytes(12), plain, _share_aad(context, a, n))
        yield f"share {a} to {n} plaintext = {_hex(plain)}"
        if index == 1:
            yield f"share key {a} to {n} = {_hex(key)}"
            yield f"share key {n} to {a} = {_hex(share_key(_agree(keys[n].share_private, keys[a].share_public), context, n, a))}"
            yield f"share {a} to {n} associated data = {_hex(_share_aad(context, a, n))}"
        yield f"share {a} to {n} sealed = {_hex(sealed)}"
        opened = Masker(n, keys[n], {}, {}, 1, RING_BITS, context).open_share(EncryptedShare(a, n, sealed),
                                                                              keys[a].share_public)
        assert opened == (index, shares["seed"][index], shares["key low"][index] + shares["key high"][index])
    assert reconstruct_seed([(2, shares["seed"][2]), (3, shares["seed"][3])], THRESHOLD) == seeds[a]

    x0 = reference()
    exact = _ExactSum(x0)
    for name in ("bias", "weight"):
        yield f"grid scale of {name} = 2^{int(np.log2(exact.scale[name]))}"
    vectors, masked = {}, {}
    for agent in IDS:
        weight = min(NUM_TRAIN[agent], WEIGHT_CAP)
        x = trained(agent)
        yield f"{agent} weight = {weight}"
        yield f"{agent} trained bias = {_hex(x['bias'])}"
        yield f"{agent} trained weight = {_hex(x['weight'])}"
        vectors[agent] = ring_vector(grid_contribution(x, x0, weight), x0)
        yield f"{agent} contribution v = {_hex(vectors[agent])}"
        masker = Masker(agent, keys[agent], {n: keys[n].mask_public for n in IDS if n != agent},
                        {n: keys[n].share_public for n in IDS if n != agent}, THRESHOLD, RING_BITS, context,
                        self_seed=seeds[agent])
        masked[agent] = masker.masked(vectors[agent])
        yield f"{agent} masked y = {_hex(masked[agent])}"

    survivors = [n for n in IDS if n != DROPPED]
    total = np.zeros(len(vectors[a]), "<u8")
    for agent in survivors:
        total = total + masked[agent]
    yield f"sum of the survivors' masked vectors = {_hex(total)}"
    # the dropped agent's mask key from the shares two survivors reveal: its neighbours in sorted order
    # hold the indices 1, 2, 3 (agent-a, agent-b, agent-d), each share both halves of the key
    graph = {n: [m for m in IDS if m != n] for n in IDS}
    revealed = [(i, _split(keys[DROPPED].mask_private, i)) for i in (1, 2)]
    for (i, share), holder in zip(revealed, graph[DROPPED]):
        yield f"{holder} reveals {DROPPED} mask key share (index {i}) = {_hex(share)}"
    lost = reconstruct_mask_key(revealed, THRESHOLD)
    assert lost == keys[DROPPED].mask_private
    result = unmask(total, survivors, graph, {n: keys[n].mask_public for n in IDS},
                    {n: seeds[n] for n in survivors}, {DROPPED: lost}, RING_BITS, context)
    expected = sum((vectors[n] for n in survivors), np.zeros(len(total), "<u8"))
    assert np.array_equal(result, expected)
    yield f"unmasked sum (int64) = {' '.join(str(v) for v in result.view('<i8'))}"


def _split(secret: bytes, index: int) -> bytes:
    """Shares at ``index`` of both 16-byte halves of a mask key, with the example's coefficients."""
    from edgepfl.secagg import _gf_mul

    out = b""
    for name, half in (("key low", secret[:16]), ("key high", secret[16:])):
        c = int.from_bytes(derived(f"edgepfl vector coefficient {DROPPED} {name}", 16), "big")
        out += (int.from_bytes(half, "big") ^ _gf_mul(c, index)).to_bytes(16, "big")
    return out


def main() -> None:
    """Print the block docs/PROTOCOL.md §19 holds."""
    for line in lines():
        print(line)


if __name__ == "__main__":
    main()
