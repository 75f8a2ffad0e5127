"""Secure aggregation of integer vectors: the coordinator learns the sum, never one input.

The masking scheme of SecAgg (Bonawitz et al., CCS 2017) on the sparse neighbour graph of
SecAgg+ (Bell et al., CCS 2020), over the ring of integers modulo ``2**bits`` (``bits`` 32
or 64; numpy's unsigned arithmetic wraps exactly so). Every primitive comes from
``cryptography`` or PyCryptodome: X25519 key agreement, HKDF-SHA256, the ChaCha20 keystream
as the mask generator, ChaCha20-Poly1305 for the shares in transit, and Shamir's secret
sharing (PyCryptodome, over GF(2^128), 16-byte secrets). One computation is redone here, for
speed: the coordinator's reconstruction is ``Shamir.combine``'s interpolation in
PyCryptodome's own field, batched, and gives its result bit for bit (:func:`reconstruct_many`).

One round, for the agents ``A`` sampled:

1. **Keys.** Each agent makes two fresh X25519 key pairs (:class:`RoundKeys`): one whose
   agreements seed the pairwise masks, one whose agreements encrypt the shares. The
   coordinator relays the public keys (signed by the agents' enrolled keys in the
   protocol, so it cannot substitute its own).
2. **Neighbours.** :func:`neighbour_graph` joins each agent to ``k`` others (a ring of a
   seeded permutation, ``k/2`` on each side; everyone when ``k ≥ |A| - 1``): an agent's
   cost grows with ``k``, which grows like ``log |A|`` (:func:`default_degree`), not with ``|A|``.
3. **Shares.** Each agent picks a self-mask seed ``b`` and splits ``b`` and its mask
   private key into Shamir shares, threshold ``t``, one per neighbour, each encrypted to
   that neighbour (:meth:`Masker.shares_for`).
4. **Masked input.** Its input ``x`` (integers, the caller's fixed-point encoding) leaves
   as ``y = x + PRG(b) + Σ_j ±PRG(s_ij)`` over its neighbours ``j``, ``+`` when its id
   sorts before ``j``'s (:meth:`Masker.masked`). The pairwise masks cancel in the sum.
5. **Unmasking.** The coordinator names who sent a masked input (the survivors). Each
   survivor's neighbours reveal their shares of its ``b``, each dropped agent's neighbours
   their shares of its mask key — never both for one agent — and
   :func:`unmask` removes what does not cancel: every survivor's ``PRG(b)``, and the
   pairwise masks between a dropped agent and its surviving neighbours. The result is the
   sum of the survivors' inputs modulo ``2**bits``, exactly.

An agent whose neighbours reveal fewer than ``t`` shares cannot be unmasked: the round
fails, it does not leak. The caller chooses ``t``; ``k // 2 + 1`` (a majority of the
neighbours, so that no two disjoint sets can each reconstruct) tolerates a third of the
agents dropping out when ``k`` is as :func:`default_degree` makes it (every agent keeps a
majority of its neighbours but with probability 10^-3).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "EncryptedShare", "Masker", "RoundKeys", "SecAggError", "SecureAggregationSpec", "default_degree", "neighbour_graph",
    "RING_BITS", "disagreeing_share", "keys_statement", "prg", "reconstruct_many", "reconstruct_mask_key",
    "reconstruct_seed",
    "session_context", "share_key", "unmask",
]

#: the ring a secure round of the protocol sums in (:func:`edgepfl.aggregation.ring_vector`)
RING_BITS = 64
#: the byte length of a self-mask seed and of each Shamir secret (PyCryptodome's Shamir shares 16 bytes)
SEED_BYTES = 16
_DTYPES: dict[int, np.dtype] = {32: np.dtype("<u4"), 64: np.dtype("<u8")}


class SecureAggregationSpec(BaseModel):
    """A run's ``secure_aggregation:`` section (docs/SECURITY.md, "Secure aggregation")."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    enabled: bool = Field(False, description="every training round is a secure one: the coordinator learns the sum of "
                                             "the shared parameters' changes, never one device's (protocol 1.9)")
    dropout: float = Field(1 / 3, gt=0, lt=0.5, description="the share of a round's agents it is built to lose "
                                                            "mid-round and still unmask the sum (sets the neighbours "
                                                            "per agent unless degree is set)")
    degree: int | None = Field(None, ge=2, le=1024, description="neighbours per agent (even); null: the smallest "
                                                                 "that survives dropout with probability 1 - 1e-3")
    step_timeout_s: float = Field(30.0, gt=0, description="how long each step of a secure round (keys, shares, "
                                                          "reveals) waits for the agents that owe an answer")
    group_size: int | None = Field(
        None, ge=3, le=4096,
        description="split every round's agents into groups of at least this many, each its own secure sum: the "
                    "coordinator learns each group's sum (not one device's), holds it to the bound every update is "
                    "held to in the clear, sets a group past it aside and, over the next rounds, regroups its members "
                    "apart until the one device behind it stands alone, then suspends it. A group whose members drop "
                    "out mid-round beyond its threshold's slack (3: any one of them; 10: more than four) is lost, not "
                    "the round; null: one group, the round's sum alone, except while tracing (suspect_group_size)")
    suspect_group_size: int | None = Field(
        5, ge=3, le=4096,
        description="with group_size null: once a round's sum was past the bounds, the next rounds are split into "
                    "groups of at least this many (when the round has two groups' worth) until the device behind it "
                    "is named, or for 16 rounds without another such sum; then one group again. Privacy is given up "
                    "only under attack; null: never split (a device that garbles its vector then stops every round "
                    "and is not named)")

    def groups(self, agents: list[str], seed: bytes, suspects: Sequence[set[str]] = ()) -> list[list[str]]:
        """The round's groups (each sorted): ``len(agents) // size`` groups dealt round robin, first
        every agent of each set in ``suspects`` (so that the agents of one set land in different
        groups), then the others in a ``seed``-keyed order; ``size`` is ``group_size``, or
        ``suspect_group_size`` while there are suspects. One group of every agent without a size or
        with fewer than two groups' worth."""
        size = self.group_size if self.group_size is not None or not suspects else self.suspect_group_size
        if size is None or len(agents) < 2 * size:
            return [sorted(agents)]
        count = len(agents) // size
        present = set(agents)
        spread = list(dict.fromkeys(a for found in suspects for a in sorted(found) if a in present))
        rest = sorted(present - set(spread), key=lambda a: hashlib.sha256(seed + a.encode()).digest())
        order = spread + rest
        return [sorted(order[i::count]) for i in range(count)]

    def degree_for(self, agents: int) -> int:
        """Neighbours per agent in a round of ``agents``: ``degree`` or :func:`default_degree`,
        everyone when that is fewer."""
        degree = self.degree if self.degree is not None else default_degree(agents, self.dropout)
        return min(degree, max(agents - 1, 0))


class SecAggError(ValueError):
    """Inputs that cannot be masked or unmasked: a wrong key, share or vector, too few shares."""


def session_context(federation: str, round: int, session: str) -> bytes:
    """What every key of a protocol round is derived with (both ends): nothing carries over
    to another federation, round or session."""
    return f"edgepfl secagg\0{federation}\0{round}\0{session}".encode()


def _dtype(bits: int) -> np.dtype:
    if bits not in _DTYPES:
        raise SecAggError(f"the ring is integers modulo 2**32 or 2**64, not 2**{bits}")
    return _DTYPES[bits]


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(secret)


def prg(seed: bytes, count: int, bits: int, context: bytes = b"") -> np.ndarray:
    """``count`` integers modulo ``2**bits`` from ``seed``: the ChaCha20 keystream under a key
    derived from ``seed`` and ``context`` (a fresh key for each use, so the zero nonce is safe)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    dtype = _dtype(bits)
    key = _hkdf(seed, b"edgepfl secagg v1 prg" + context)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(count * dtype.itemsize))
    return np.frombuffer(stream, dtype=dtype).copy()


def default_degree(agents: int, dropout: float = 1 / 3, failure: float = 1e-3) -> int:
    """Neighbours per agent so that, with a majority threshold (``degree // 2 + 1``) and each
    agent dropping out independently with probability ``dropout``, the chance that any agent
    of the round keeps fewer surviving neighbours than the threshold is at most ``failure``
    (a union bound over the binomial tail): the smallest such even degree, at most everyone.
    At a third dropping out: everyone up to 171 agents, 172 at 200, 198 at 1,000, 236 at
    10,000 — it grows like log N."""
    if agents <= 1:
        return 0
    keep = 1 - dropout
    for degree in range(4, agents, 2):
        threshold = degree // 2 + 1
        tail = sum(math.comb(degree, i) * keep ** i * dropout ** (degree - i) for i in range(threshold))
        if agents * tail <= failure:
            return degree
    return agents - 1


def neighbour_graph(agents: Iterable[str], degree: int, seed: bytes) -> dict[str, list[str]]:
    """Each agent's neighbours (sorted): a ring of the agents in a ``seed``-keyed order, each
    joined to ``degree // 2`` on either side; everyone when ``degree ≥ len(agents) - 1``.
    Symmetric, and the same for every party that knows the agents and the seed."""
    ids = sorted(set(agents))
    n = len(ids)
    if degree >= n - 1:
        return {a: [b for b in ids if b != a] for a in ids}
    if degree < 2 or degree % 2:
        raise SecAggError(f"a sparse neighbour graph needs an even degree of 2 or more, not {degree}")
    ring = sorted(ids, key=lambda a: hashlib.sha256(seed + a.encode()).digest())
    graph: dict[str, set[str]] = {a: set() for a in ids}
    for i, a in enumerate(ring):
        for step in range(1, degree // 2 + 1):
            b = ring[(i + step) % n]
            graph[a].add(b)
            graph[b].add(a)
    return {a: sorted(neighbours) for a, neighbours in graph.items()}


@dataclass
class RoundKeys:
    """An agent's two X25519 key pairs for one round: masks and share encryption."""

    mask_private: bytes
    share_private: bytes

    @classmethod
    def generate(cls) -> RoundKeys:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

        return cls(_raw_private(X25519PrivateKey.generate()), _raw_private(X25519PrivateKey.generate()))

    @property
    def mask_public(self) -> bytes:
        return _public(self.mask_private)

    @property
    def share_public(self) -> bytes:
        return _public(self.share_private)


def _raw_private(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())


def _public(private: bytes) -> bytes:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _agree(private: bytes, public: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    try:
        return X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:  # a low-order point, a key of the wrong length
        raise SecAggError(f"unusable X25519 public key: {exc}") from None


def pairwise_seed(my_mask_private: bytes, their_mask_public: bytes, context: bytes) -> bytes:
    """The seed both ends of an edge derive (X25519 is symmetric) for the mask between them."""
    return _hkdf(_agree(my_mask_private, their_mask_public), b"edgepfl secagg v1 pair" + context)


def share_key(agreement: bytes, context: bytes, sender: str, recipient: str) -> bytes:
    """The ChaCha20-Poly1305 key of the shares ``sender`` seals to ``recipient`` (protocol 1.14).

    The X25519 agreement is the same at both ends of an edge, so a key derived from it alone
    would seal the shares of both directions under one key and the zero nonce: the XOR of
    the two ciphertexts is the XOR of the two plaintexts, and whoever relays them (the
    coordinator) learns, from one side's reveal, the other side's share — a share of a
    survivor's mask key once its neighbour drops out (protocol 1.9-1.13 did that). Binding
    the key to the direction makes each key seal one message."""
    return _hkdf(agreement, b"edgepfl secagg v2 share" + _share_aad(context, sender, recipient))


def _share_aad(context: bytes, sender: str, recipient: str) -> bytes:
    """What a sealed share is bound to: the round's context and both ids, in the order of sending."""
    return context + b"\0" + sender.encode() + b"\0" + recipient.encode()


def keys_statement(context: bytes, agent: str, mask_public: bytes, share_public: bytes) -> bytes:
    """What an agent signs with its certified message-signing key to vouch for its two public keys
    of one session (protocol 1.14): a neighbour that checks it knows the keys the coordinator
    relays are the agent's own, for this federation, round and session."""
    return b"edgepfl secagg v2 keys\0" + context + b"\0" + agent.encode() + b"\0" + mask_public + share_public


def _sign(me: str, other: str) -> int:
    return 1 if me < other else -1


@dataclass(frozen=True)
class EncryptedShare:
    """Shares of one agent's secrets, for one neighbour: ChaCha20-Poly1305 under a key only the
    two of them derive, bound to the round's context and both ids."""

    sender: str
    recipient: str
    ciphertext: bytes


@dataclass
class Masker:
    """One agent's side of a round: ``me``, its ``keys``, its neighbours' public keys
    (``mask_publics``, ``share_publics``, by id), the ``threshold`` of its shares, the ring's
    ``bits`` and the round's ``context`` (federation, round, session: every key is derived
    with it, so nothing carries over to another round)."""

    me: str
    keys: RoundKeys
    mask_publics: Mapping[str, bytes]
    share_publics: Mapping[str, bytes]
    threshold: int
    bits: int
    context: bytes
    self_seed: bytes = field(default_factory=lambda: os.urandom(SEED_BYTES))

    @property
    def neighbours(self) -> list[str]:
        return sorted(set(self.mask_publics) - {self.me})

    def masked(self, x: np.ndarray) -> np.ndarray:
        """``x`` (integers modulo ``2**bits``) plus the self mask and the pairwise masks."""
        dtype = _dtype(self.bits)
        if x.dtype != dtype or x.ndim != 1:
            raise SecAggError(f"the input is a flat {dtype} vector, not {x.dtype} of shape {x.shape}")
        y = x + prg(self.self_seed, len(x), self.bits, self.context + b"self")
        for other in self.neighbours:
            mask = prg(pairwise_seed(self.keys.mask_private, self.mask_publics[other], self.context), len(x),
                       self.bits, self.context)
            y = y + mask if _sign(self.me, other) > 0 else y - mask
        return y

    def shares_for(self) -> list[EncryptedShare]:
        """Shamir shares (threshold :attr:`threshold`) of the self-mask seed and the mask private
        key, one per neighbour, each encrypted to it."""
        from Crypto.Protocol.SecretSharing import Shamir
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        neighbours = self.neighbours
        if not 1 <= self.threshold <= len(neighbours):
            raise SecAggError(f"threshold {self.threshold} with {len(neighbours)} neighbours")
        n = len(neighbours)
        secrets = [self.self_seed, self.keys.mask_private[:16], self.keys.mask_private[16:]]
        split = [Shamir.split(self.threshold, n, secret) for secret in secrets]
        out = []
        for position, other in enumerate(neighbours):
            index = split[0][position][0]
            plain = struct.pack(">H", index) + b"".join(parts[position][1] for parts in split)
            key = share_key(_agree(self.keys.share_private, self.share_publics[other]), self.context, self.me, other)
            aad = _share_aad(self.context, self.me, other)
            out.append(EncryptedShare(self.me, other, ChaCha20Poly1305(key).encrypt(bytes(12), plain, aad)))
        return out

    def open_share(self, share: EncryptedShare, sender_share_public: bytes) -> tuple[int, bytes, bytes]:
        """A neighbour's share addressed to this agent: (index, share of its self seed, share of
        its mask key as 32 bytes). SecAggError when it was not made for this agent in this round."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        if share.recipient != self.me:
            raise SecAggError(f"a share for {share.recipient}, not {self.me}")
        key = share_key(_agree(self.keys.share_private, sender_share_public), self.context, share.sender, self.me)
        aad = _share_aad(self.context, share.sender, self.me)
        try:
            plain = ChaCha20Poly1305(key).decrypt(bytes(12), share.ciphertext, aad)
        except InvalidTag:
            raise SecAggError(f"the share from {share.sender} does not open: another round, key or recipient") from None
        if len(plain) != 2 + 3 * SEED_BYTES:
            raise SecAggError(f"the share from {share.sender} has {len(plain)} bytes")
        index = struct.unpack(">H", plain[:2])[0]
        return index, plain[2:18], plain[18:50]


# Reconstruction. PyCryptodome's Shamir.combine interpolates one secret at a time with its own
# GF(2^128) arithmetic, written to run in constant time in pure Python: 0.1-0.7 s per secret at
# 50-100 shares, which made unmasking a 100-agent round take 17 s. The interpolation at 0 is
# linear in the shares, secret = sum_j c_j * y_j, and the coefficients c_j depend only on the
# indices, which every secret of one agent shares (its self seed, both halves of its mask key),
# as do agents whose surviving neighbours hold the same indices. So the coefficients are computed
# once per index set (and cached: indices are public, nothing secret is kept) and each secret
# costs k products. The field is PyCryptodome's exactly (its _Element: bit i of an int is the
# coefficient of x^i, modulo x^128 + x^7 + x^2 + x + 1), so the result is Shamir.combine's bit
# for bit (tests/unit/core/test_secagg.py checks both against it). This arithmetic does not run
# in constant time: the coordinator is the party that is meant to learn these secrets.
_GF_MODULUS = (1 << 128) | 0x87
_GF_MASK = (1 << 128) - 1


def _gf_reduce(z: int) -> int:
    """``z`` (a polynomial over GF(2) of any degree) modulo x^128 + x^7 + x^2 + x + 1."""
    while z >> 128:
        high = z >> 128
        z = (z & _GF_MASK) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
    return z


def _clmul(a: int, b: int) -> int:
    """The product of two polynomials over GF(2), unreduced (carry-less multiplication)."""
    if b > a:
        a, b = b, a
    # four bits of b at a time: 32 steps for a full element instead of 128
    table = [0, a, a << 1, 0, a << 2, 0, 0, 0, a << 3, 0, 0, 0, 0, 0, 0, 0]
    for i in (3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15):
        high = 1 << (i.bit_length() - 1)
        table[i] = table[high] ^ table[i ^ high]
    z = 0
    shift = 0
    while b:
        z ^= table[b & 15] << shift
        b >>= 4
        shift += 4
    return z


def _gf_mul(a: int, b: int) -> int:
    return _gf_reduce(_clmul(a, b))


def _gf_inverse(a: int) -> int:
    """``a``'s inverse in the field: the extended Euclidean algorithm for polynomials over GF(2)
    (Hankerson, Menezes, Vanstone, *Guide to Elliptic Curve Cryptography*, algorithm 2.48)."""
    if not 0 < a < 1 << 128:
        raise SecAggError("only a nonzero field element has an inverse")
    u, v, g1, g2 = a, _GF_MODULUS, 1, 0
    while u != 1:
        j = u.bit_length() - v.bit_length()
        if j < 0:
            u, v, g1, g2 = v, u, g2, g1
            j = -j
        u ^= v << j
        g1 ^= g2 << j
    return g1


@functools.lru_cache(maxsize=1024)
def _lagrange_at_zero(indices: tuple[int, ...]) -> tuple[int, ...]:
    """The coefficients ``c_j`` of the polynomial through points at ``indices`` evaluated at 0:
    ``c_j = prod_{m != j} x_m / (x_j + x_m)``, as Shamir.combine computes them per secret.
    Callers pass the indices sorted, so that one set is one cache entry in whatever order its
    shares arrived."""
    if len(set(indices)) != len(indices) or not all(0 < x < 1 << 128 for x in indices):
        raise SecAggError(f"share indices must be distinct, from 1 to 2**128 - 1: {indices}")
    # c_j = N / E_j with N = prod_m x_m and E_j = x_j * prod_{m != j} (x_j + x_m). The factors
    # x_j + x_m are as short as the indices (at most 16 bits from Masker.shares_for), so E_j is
    # built by shifts and XORs of those few bits, unreduced until it grows past 256 bits.
    bits: dict[int, tuple[int, ...]] = {}
    denominators = []
    for xj in indices:
        acc = xj
        for xm in indices:
            if xm == xj:
                continue
            d = xj ^ xm
            positions = bits.get(d)
            if positions is None:
                positions = bits[d] = tuple(b for b in range(d.bit_length()) if d >> b & 1)
            z = 0
            for b in positions:
                z ^= acc << b
            acc = z if z >> 256 == 0 else _gf_reduce(z)
        denominators.append(_gf_reduce(acc))
    numerator = 1
    for x in indices:
        numerator = _gf_mul(numerator, x)
    # one inversion for all k (Montgomery's trick): prefix[j] = E_0 ... E_{j-1}, and walking back
    # from N / (E_0 ... E_{k-1}), t = N / (E_0 ... E_j) at step j, so c_j = t * prefix[j]
    prefix = [1]
    for e in denominators:
        prefix.append(_gf_mul(prefix[-1], e))
    t = _gf_mul(numerator, _gf_inverse(prefix[-1]))
    coefficients = [0] * len(indices)
    for j in range(len(indices) - 1, -1, -1):
        coefficients[j] = _gf_mul(t, prefix[j])
        t = _gf_mul(t, denominators[j])
    return tuple(coefficients)


def reconstruct_many(groups: Iterable[Iterable[tuple[int, bytes]]], threshold: int,
                     length: int = SEED_BYTES) -> list[bytes]:
    """The secret of each group of shares (index, ``length`` bytes), in order: each group's first
    ``threshold`` distinct indices (a repeated index keeps its place and its last share), each
    ``length``-byte share being ``length // 16`` shares of 16-byte secrets at that index (16 for a
    self seed, 32 for a mask key), reconstructed as PyCryptodome's ``Shamir.combine`` would from
    those shares, bit for bit. Lagrange coefficients are computed once per index set and cached,
    so the groups that share one (every agent's secrets, agents with the same revealers) cost a
    few products each. SecAggError when a group has fewer than ``threshold`` shares or a share
    used is not ``length`` bytes."""
    if threshold < 1:
        raise SecAggError(f"a threshold of {threshold}: at least one share is needed")
    if length < SEED_BYTES or length % SEED_BYTES:
        raise SecAggError(f"a share is one or more blocks of {SEED_BYTES} bytes, not {length}")
    out = []
    for group in groups:
        got = list({i: s for i, s in group}.items())
        if len(got) < threshold:
            raise SecAggError(f"{len(got)} shares, {threshold} needed")
        got = got[:threshold]
        if any(len(s) != length for _, s in got):
            raise SecAggError(f"a share of {sorted({len(s) for _, s in got})} bytes, not {length}")
        indices = sorted(i for i, _ in got)
        coefficient = dict(zip(indices, _lagrange_at_zero(tuple(indices))))
        secret = b""
        for start in range(0, length, SEED_BYTES):
            z = 0
            for i, share in got:
                z ^= _clmul(coefficient[i], int.from_bytes(share[start:start + SEED_BYTES], "big"))
            secret += _gf_reduce(z).to_bytes(SEED_BYTES, "big")
        out.append(secret)
    return out


def _windows_agree(got: list[tuple[int, bytes]], threshold: int, length: int) -> bool:
    """Whether the shares ``got`` (more than ``threshold``, sorted by index) rebuild one secret
    from each window of ``threshold`` consecutive ones, the windows covering them all.

    A share off the others' polynomial by an error e ≠ 0 moves the secret of each window it is
    in by e times its Lagrange coefficient there, which differs between two windows of different
    index sets; so a wrong share shows as windows that disagree. Each window is one
    :func:`reconstruct_many` group (its coefficients cached per index set), so checking a secret
    costs a few reconstructions, not an interpolation per share (at 100 agents a round's
    unmasking took 36.9 CPU-seconds with the interpolation, 2.5 with the windows:
    benchmarks/results/secure_rounds.md)."""
    n = len(got)
    starts = sorted({*range(0, n - threshold, threshold), n - threshold})
    return len(set(reconstruct_many([got[i:i + threshold] for i in starts], threshold, length))) == 1


def disagreeing_share(shares: Iterable[tuple[int, bytes]], threshold: int, length: int = SEED_BYTES) -> int | None:
    """The index of the one share that is not on the polynomial the others agree on, or None when
    all agree (or there are only ``threshold`` of them: nothing to check them against). Raises
    SecAggError when they disagree and no single share explains it: ``threshold + 1`` shares
    show that one is wrong but not which, and more than one wrong share is not told apart here.
    Agreement is tested by windows of ``threshold`` shares covering them (:func:`_windows_agree`).

    A share revealed at unmasking is either its revealer's lie or its dealer's: the dealer sealed
    it and nobody but the two can tell which (docs/SECURITY.md); what is certain is that it is
    not the secret's, so the secret is taken from the others."""
    got = sorted({i: s for i, s in shares}.items())
    if any(len(s) != length for _, s in got):
        raise SecAggError(f"a share of {sorted({len(s) for _, s in got})} bytes, not {length}")
    if len(got) <= threshold or _windows_agree(got, threshold, length):
        return None
    if len(got) > threshold + 1:
        for k, (index, _) in enumerate(got):
            if _windows_agree(got[:k] + got[k + 1:], threshold, length):
                return index
    raise SecAggError(f"{len(got)} shares of one secret disagree, and no single one of them explains it")


def reconstruct_seed(shares: Iterable[tuple[int, bytes]], threshold: int) -> bytes:
    """A self-mask seed from at least ``threshold`` of its shares (index, 16 bytes); one group of
    :func:`reconstruct_many`."""
    return reconstruct_many([shares], threshold, SEED_BYTES)[0]


def reconstruct_mask_key(shares: Iterable[tuple[int, bytes]], threshold: int) -> bytes:
    """A mask private key from at least ``threshold`` of its shares (index, 32 bytes: both halves);
    one group of :func:`reconstruct_many`."""
    return reconstruct_many([shares], threshold, 2 * SEED_BYTES)[0]


def unmask(total: np.ndarray, survivors: Iterable[str], graph: Mapping[str, list[str]],
           mask_publics: Mapping[str, bytes], self_seeds: Mapping[str, bytes], dropped_keys: Mapping[str, bytes],
           bits: int, context: bytes) -> np.ndarray:
    """The sum of the survivors' inputs from ``total``, the sum of their masked inputs:
    ``self_seeds`` (reconstructed) of every survivor, ``dropped_keys`` (reconstructed mask
    private keys) of every agent of the round that sent nothing; ``graph`` and
    ``mask_publics`` as the round used them."""
    survivors = set(survivors)
    missing = survivors - set(self_seeds)
    if missing:
        raise SecAggError(f"no self-mask seed for {sorted(missing)}")
    unrecovered = [a for a in graph if a not in survivors and a not in dropped_keys
                   and any(b in survivors for b in graph[a])]
    if unrecovered:
        raise SecAggError(f"no mask key for {sorted(unrecovered)}, which dropped out beside survivors")
    out = total.copy()
    n = len(total)
    for agent in sorted(survivors):
        out = out - prg(self_seeds[agent], n, bits, context + b"self")
    for gone, key in sorted(dropped_keys.items()):
        if gone in survivors:
            raise SecAggError(f"{gone} both sent its input and dropped out: its masks would be revealed")
        for other in graph.get(gone, []):
            if other not in survivors:
                continue
            mask = prg(pairwise_seed(key, mask_publics[other], context), n, bits, context)
            # the survivor added sign(other, gone) * mask; the dropped agent's opposite never came
            out = out - mask if _sign(other, gone) > 0 else out + mask
    return out
