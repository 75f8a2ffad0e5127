"""Secure aggregation (SecAgg on the SecAgg+ sparse graph), written from
docs/PROTOCOL.md §19 alone (by a helper given only that section and §5's ``secagg``
fields; it read no code of the project). Checked against §19.5's vectors by
tests/unit/core/test_secagg_from_the_text.py; run as a live agent's secure aggregation by
tests/foreign_agent/secagg_agent.py.

This is an independent second implementation meant to cross-check the text:
every primitive, byte layout, the grid contribution (§19.3) and unmasking
(§19.4) follow the specification's wording, not another implementation.

Ring arithmetic is modulo 2^64 on numpy "<u8" vectors (wrap-around addition and
subtraction).  Shamir sharing is over GF(2^128) as defined in §19.2 ("field").
"""

from __future__ import annotations

import hashlib
import math
import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "context", "hkdf", "x25519_public", "x25519", "prg", "pair_seed",
    "default_degree", "neighbours", "gf_mul", "gf_inv", "split", "combine",
    "share_key", "seal", "open_sealed", "Participant", "contribution", "unmask",
]

# §19.2 labels
_PRG_LABEL = b"edgepfl secagg v1 prg"
_PAIR_LABEL = b"edgepfl secagg v1 pair"
_SHARE_LABEL = b"edgepfl secagg v2 share"
_ZERO_NONCE = bytes(12)
_PLAINTEXT_LEN = 50   # §19.2 "share plaintext (50 bytes)"
_SEALED_LEN = 66      # §19.2 seal: 50 bytes + 16-byte tag
_U8 = np.dtype("<u8")

# §19.2 field: x^128 + x^7 + x^2 + x + 1
_FIELD_BITS = 128
_FIELD_MASK = (1 << _FIELD_BITS) - 1
_REDUCTION = 0x87  # x^7 + x^2 + x + 1


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def _id_bytes(agent: str) -> bytes:
    """Agent ids are ASCII [A-Za-z0-9_-] (§19.2); strings are UTF-8."""
    if not isinstance(agent, str) or not agent:
        raise ValueError("agent id must be a non-empty string")
    for ch in agent:
        if not (ch.isascii() and (ch.isalnum() or ch in "_-")):
            raise ValueError(f"agent id {agent!r} is not [A-Za-z0-9_-]")
    return agent.encode("utf-8")


def _before(a: str, b: str) -> bool:
    """§19.2: "sorted" means by the ids' bytes."""
    return a.encode("utf-8") < b.encode("utf-8")


def _sorted_ids(ids) -> list[str]:
    return sorted(ids, key=lambda s: s.encode("utf-8"))


def _bytes32(value: bytes, what: str) -> bytes:
    value = bytes(value)
    if len(value) != 32:
        raise ValueError(f"{what} must be 32 bytes")
    return value


def _ring(v: np.ndarray) -> np.ndarray:
    a = np.asarray(v)
    if a.dtype.kind != "u" or a.dtype.itemsize != 8:
        raise ValueError("a ring vector must be uint64 ('<u8')")
    return np.ascontiguousarray(a.reshape(-1), dtype=_U8)


# ---------------------------------------------------------------------------
# §19.2 primitives
# ---------------------------------------------------------------------------

def context(federation: str, round: int, session: str) -> bytes:
    """§19.2 `context`: "edgepfl secagg" ‖ 0x00 ‖ federation ‖ 0x00 ‖ decimal round ‖ 0x00 ‖ session."""
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError("round must be a non-negative integer")
    if not isinstance(session, str):
        raise ValueError("session must be text")
    return b"\x00".join([
        b"edgepfl secagg",
        federation.encode("utf-8"),
        str(round).encode("ascii"),
        session.encode("utf-8"),  # the 32 hex characters as text
    ])


def hkdf(secret: bytes, info: bytes) -> bytes:
    """§19.2 `HKDF(secret, info)`: HKDF-SHA256, no salt (32 zero bytes), 32 bytes out."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=bytes(info)).derive(bytes(secret))


def x25519_public(private: bytes) -> bytes:
    """§19.2 `X25519`: the RFC 7748 public key of a 32-byte private key."""
    key = X25519PrivateKey.from_private_bytes(_bytes32(private, "X25519 private key"))
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def x25519(private: bytes, public: bytes) -> bytes:
    """§19.2 `X25519(private, public)`; an all-zero result is an error (ValueError)."""
    key = X25519PrivateKey.from_private_bytes(_bytes32(private, "X25519 private key"))
    peer = X25519PublicKey.from_public_bytes(_bytes32(public, "X25519 public key"))
    try:
        shared = key.exchange(peer)
    except ValueError as exc:  # cryptography refuses all-zero results itself
        raise ValueError("X25519 result is all zeros: the key is unusable") from exc
    if shared == bytes(32):
        raise ValueError("X25519 result is all zeros: the key is unusable")
    return shared


def prg(seed: bytes, n: int, context: bytes, info: bytes = b"") -> np.ndarray:
    """§19.2 `PRG(seed, n, info)`: ChaCha20 under HKDF(seed, "edgepfl secagg v1 prg" ‖ context ‖ info),
    nonce 12 zero bytes, counter from 0; first 8·n keystream bytes as n little-endian uint64."""
    if n < 0:
        raise ValueError("n must be non-negative")
    key = hkdf(seed, _PRG_LABEL + bytes(context) + bytes(info))
    # cryptography's ChaCha20 "nonce": 4-byte LE block counter (0) ‖ 12-byte nonce (zeros)
    cipher = Cipher(algorithms.ChaCha20(key, (0).to_bytes(4, "little") + _ZERO_NONCE), mode=None)
    stream = cipher.encryptor().update(bytes(8 * n))
    return np.frombuffer(stream, dtype=_U8).copy()


def pair_seed(my_mask_private: bytes, their_mask_public: bytes, context: bytes) -> bytes:
    """§19.2 `s(i, j)` = HKDF(X25519(i's mask private, j's mask public), "edgepfl secagg v1 pair" ‖ context)."""
    return hkdf(x25519(my_mask_private, their_mask_public), _PAIR_LABEL + bytes(context))


# ---------------------------------------------------------------------------
# §19.1 step 2: the degree rule; §19.2 `neighbours`
# ---------------------------------------------------------------------------

def default_degree(holders: int, dropout: float = 1 / 3, failure: float = 1e-3) -> int:
    """§19.1 step 2: the smallest even d ≥ 4 with
    N · Σ_{i < d/2+1} C(d, i) (1−p)^i p^(d−i) ≤ failure, and N − 1 (everyone) when no such
    d < N exists or that degree is ≥ N − 1."""
    n = int(holders)
    if n < 1:
        raise ValueError("need at least one holder")
    p = float(dropout)
    if not 0.0 <= p <= 1.0:
        raise ValueError("dropout must be in [0, 1]")
    d = 4
    while d < n:
        chance = n * sum(math.comb(d, i) * (1 - p) ** i * p ** (d - i) for i in range(d // 2 + 1))
        if chance <= failure:
            return n - 1 if d >= n - 1 else d
        d += 2
    return n - 1


def neighbours(ids: list[str], degree: int, session: str) -> dict[str, list[str]]:
    """§19.2 `neighbours`: everyone when d ≥ N − 1; otherwise (d even, ≥ 2) the ring of the
    holders sorted by SHA-256(session's 16 bytes ‖ id), each rᵢ joined to r_{i±1} … r_{i±d/2}."""
    ids = list(ids)
    if len(set(ids)) != len(ids):
        raise ValueError("ids must be distinct")
    raw = {i: _id_bytes(i) for i in ids}
    if (not isinstance(session, str) or len(session) != 32
            or any(c not in "0123456789abcdef" for c in session)):
        raise ValueError("session must be 32 lowercase hex digits")
    sess = bytes.fromhex(session)
    n = len(ids)
    if degree >= n - 1:
        return {i: _sorted_ids(j for j in ids if j != i) for i in ids}
    if degree < 2 or degree % 2:
        raise ValueError("a sparse degree must be even and at least 2")
    ring = sorted(ids, key=lambda i: hashlib.sha256(sess + raw[i]).digest())
    graph: dict[str, set[str]] = {i: set() for i in ids}
    for pos, me in enumerate(ring):
        for step in range(1, degree // 2 + 1):
            graph[me].add(ring[(pos + step) % n])
            graph[me].add(ring[(pos - step) % n])
    return {i: _sorted_ids(graph[i]) for i in ids}


def _ring_order(ids: list[str], session: str) -> list[str]:
    """The ring r₀ … r_{N−1} of §19.2 `neighbours` (for the worked example, §19.5)."""
    sess = bytes.fromhex(session)
    return sorted(ids, key=lambda i: hashlib.sha256(sess + _id_bytes(i)).digest())


# ---------------------------------------------------------------------------
# §19.2 field, split, combine
# ---------------------------------------------------------------------------

def _element(a: int) -> int:
    if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= _FIELD_MASK:
        raise ValueError("a field element is an integer in [0, 2^128)")
    return a


def gf_mul(a: int, b: int) -> int:
    """§19.2 field: carry-less multiplication modulo x^128 + x^7 + x^2 + x + 1."""
    a, b = _element(a), _element(b)
    result = 0
    while b:
        if b & 1:
            result ^= a
        b >>= 1
        a <<= 1
        if a >> _FIELD_BITS:
            a = (a & _FIELD_MASK) ^ _REDUCTION
    return result


def gf_inv(a: int) -> int:
    """Multiplicative inverse in GF(2^128): a^(2^128 − 2)."""
    if _element(a) == 0:
        raise ValueError("0 has no inverse")
    result, base, e = 1, a, (1 << _FIELD_BITS) - 2
    while e:
        if e & 1:
            result = gf_mul(result, base)
        base = gf_mul(base, base)
        e >>= 1
    return result


def _to_element(b: bytes) -> int:
    """§19.2 field: a 16-byte string is the element of its big-endian integer."""
    b = bytes(b)
    if len(b) != 16:
        raise ValueError("a field element is 16 bytes")
    return int.from_bytes(b, "big")


def _from_element(a: int) -> bytes:
    return a.to_bytes(16, "big")


def split(secret: bytes, threshold: int, count: int,
          coefficients: list[bytes] | None = None) -> list[tuple[int, bytes]]:
    """§19.2 `split(secret, t, m)`: f(x) = secret + c₁x + … + c_{t−1}x^{t−1}; shares (k, f(k)), k = 1..m."""
    s = _to_element(secret)
    if threshold < 1 or count < threshold or count > 0xFFFF:
        raise ValueError("need 1 ≤ threshold ≤ count ≤ 65535")
    if coefficients is None:
        coeffs = [_to_element(os.urandom(16)) for _ in range(threshold - 1)]
    else:
        if len(coefficients) != threshold - 1:
            raise ValueError("need threshold − 1 coefficients")
        coeffs = [_to_element(c) for c in coefficients]
    poly = [s] + coeffs  # poly[i] is the coefficient of x^i
    shares = []
    for k in range(1, count + 1):
        y = 0
        for c in reversed(poly):  # Horner; addition is XOR
            y = gf_mul(y, k) ^ c
        shares.append((k, _from_element(y)))
    return shares


def combine(shares: list[tuple[int, bytes]], threshold: int) -> bytes:
    """§19.2 `combine`: f(0) = Σₖ yₖ · Πₘ≠ₖ xₘ / (xₖ + xₘ) from `threshold` shares with distinct indices."""
    if threshold < 1:
        raise ValueError("threshold must be at least 1")
    chosen: list[tuple[int, int]] = []
    seen: set[int] = set()
    for index, value in shares:
        x = _element(int(index))
        if x in seen:
            continue
        seen.add(x)
        chosen.append((x, _to_element(value)))
        if len(chosen) == threshold:
            break
    if len(chosen) < threshold:
        raise ValueError(f"need {threshold} shares with distinct indices, got {len(chosen)}")
    secret = 0
    for k, (xk, yk) in enumerate(chosen):
        num, den = 1, 1
        for m, (xm, _) in enumerate(chosen):
            if m != k:
                num = gf_mul(num, xm)
                den = gf_mul(den, xk ^ xm)
        secret ^= gf_mul(yk, gf_mul(num, gf_inv(den)))
    return _from_element(secret)


# ---------------------------------------------------------------------------
# §19.2 share_key, seal, open
# ---------------------------------------------------------------------------

def share_key(my_share_private: bytes, their_share_public: bytes, context: bytes,
              sender: str, recipient: str) -> bytes:
    """§19.2 `share_key(i → j)` = HKDF(X25519(i's share private, j's share public),
    "edgepfl secagg v2 share" ‖ context ‖ 0x00 ‖ i ‖ 0x00 ‖ j), i the sender."""
    info = _SHARE_LABEL + bytes(context) + b"\x00" + _id_bytes(sender) + b"\x00" + _id_bytes(recipient)
    return hkdf(x25519(my_share_private, their_share_public), info)


def _associated_data(context: bytes, sender: str, recipient: str) -> bytes:
    """§19.2 `seal`: associated data context ‖ 0x00 ‖ sender ‖ 0x00 ‖ recipient."""
    return bytes(context) + b"\x00" + _id_bytes(sender) + b"\x00" + _id_bytes(recipient)


def seal(key: bytes, context: bytes, sender: str, recipient: str, plaintext: bytes) -> bytes:
    """§19.2 `seal`: ChaCha20-Poly1305, nonce 12 zero bytes; 66 bytes (ciphertext ‖ tag)."""
    plaintext = bytes(plaintext)
    if len(plaintext) != _PLAINTEXT_LEN:
        raise ValueError("a share plaintext is 50 bytes")
    return ChaCha20Poly1305(_bytes32(key, "share key")).encrypt(
        _ZERO_NONCE, plaintext, _associated_data(context, sender, recipient))


def open_sealed(key: bytes, context: bytes, sender: str, recipient: str,
                ciphertext: bytes) -> tuple[int, bytes, bytes]:
    """§19.2 `open`: the same key and associated data; returns (index, seed share, 32-byte key share).
    A tag that does not verify or a plaintext that is not 50 bytes raises ValueError."""
    ciphertext = bytes(ciphertext)
    try:
        plaintext = ChaCha20Poly1305(_bytes32(key, "share key")).decrypt(
            _ZERO_NONCE, ciphertext, _associated_data(context, sender, recipient))
    except InvalidTag as exc:
        raise ValueError("share does not open") from exc
    if len(plaintext) != _PLAINTEXT_LEN:
        raise ValueError("share plaintext is not 50 bytes")
    # §19.2 share plaintext: index (2) ‖ share of b (16) ‖ key bytes 0–15 (16) ‖ key bytes 16–31 (16)
    return int.from_bytes(plaintext[:2], "big"), plaintext[2:18], plaintext[18:50]


# ---------------------------------------------------------------------------
# one agent's side (§19.1 steps 1–3)
# ---------------------------------------------------------------------------

class Participant:
    """One agent's side of a secure round (§19.1): its two key pairs, its self-mask seed `b`,
    the shares it seals to its neighbours, opening theirs, and its masked update."""

    def __init__(self, me: str, mask_private: bytes, share_private: bytes, context: bytes,
                 self_seed: bytes | None = None) -> None:
        _id_bytes(me)
        self.me = me
        self._mask_private = _bytes32(mask_private, "mask private key")
        self._share_private = _bytes32(share_private, "share private key")
        self._mask_public = x25519_public(self._mask_private)
        self._share_public = x25519_public(self._share_private)
        if self._mask_public == self._share_public:  # §19.1 step 1: never the same key
            raise ValueError("the mask and share keys must differ")
        self._context = bytes(context)
        seed = os.urandom(16) if self_seed is None else bytes(self_seed)
        if len(seed) != 16:
            raise ValueError("the self-mask seed is 16 bytes")
        self._self_seed = seed

    @property
    def mask_public(self) -> bytes:
        return self._mask_public

    @property
    def share_public(self) -> bytes:
        return self._share_public

    def sealed_shares(self, neighbours: dict[str, tuple[bytes, bytes]], threshold: int,
                      coefficients: dict[str, list[bytes]] | None = None) -> dict[str, bytes]:
        """§19.1 step 2: split b and the two halves of the mask private key, one share per
        neighbour (position k in the sorted neighbours), seal each neighbour's three shares."""
        names = list(neighbours)
        if self.me in names:
            raise ValueError("a roster must not name the agent itself")
        if not names:
            raise ValueError("a roster needs neighbours")
        if threshold * 2 <= len(names) or threshold > len(names):
            raise ValueError("the threshold must be a strict majority of the neighbours")
        order = _sorted_ids(names)
        coeffs = coefficients or {}
        seed_shares = split(self._self_seed, threshold, len(order), coeffs.get("seed"))
        low_shares = split(self._mask_private[:16], threshold, len(order), coeffs.get("key low"))
        high_shares = split(self._mask_private[16:], threshold, len(order), coeffs.get("key high"))
        out: dict[str, bytes] = {}
        for pos, peer in enumerate(order):
            k = pos + 1
            assert seed_shares[pos][0] == low_shares[pos][0] == high_shares[pos][0] == k
            plaintext = (k.to_bytes(2, "big") + seed_shares[pos][1]
                         + low_shares[pos][1] + high_shares[pos][1])
            _, their_share_public = neighbours[peer]
            key = share_key(self._share_private, their_share_public, self._context, self.me, peer)
            out[peer] = seal(key, self._context, self.me, peer, plaintext)
        return out

    def open_share(self, sender: str, sender_share_public: bytes,
                   ciphertext: bytes) -> tuple[int, bytes, bytes]:
        """§19.1 step 3 / §19.2 `open`: under share_key(sender → me)."""
        key = share_key(self._share_private, sender_share_public, self._context, sender, self.me)
        return open_sealed(key, self._context, sender, self.me, ciphertext)

    def masked(self, v: np.ndarray, mask_publics: dict[str, bytes]) -> np.ndarray:
        """§19.2 `mask(v)` = v + PRG(b, n, "self") + Σ_j ±PRG(s(me, j), n, "") mod 2^64,
        `+` when me sorts before j, `−` after; over exactly the neighbours given."""
        y = _ring(v).copy()
        n = y.size
        y += prg(self._self_seed, n, self._context, b"self")
        for peer, public in mask_publics.items():
            if peer == self.me:
                raise ValueError("cannot mask with oneself")
            stream = prg(pair_seed(self._mask_private, public, self._context), n, self._context, b"")
            if _before(self.me, peer):
                y += stream
            else:
                y -= stream
        return y


# ---------------------------------------------------------------------------
# §19.3 the contribution on the grid
# ---------------------------------------------------------------------------

def _weight(num_train: int, weight_cap: int | None, counts_once: bool = False) -> int:
    """§19.3 `w`: min(num_train, weight_cap), num_train when the cap is null, 1 when every update counts once."""
    if counts_once:
        return 1
    return int(num_train) if weight_cap is None else min(int(num_train), int(weight_cap))


def _is_running_variance(name: str, x0: dict[str, np.ndarray]) -> bool:
    """§19.3 (since 1.17): a float tensor named ``<p>running_var`` with a float ``<p>running_mean``
    of the same shape among the task's tensors, ``<p>`` empty or ending in "."."""
    if not (name == "running_var" or name.endswith(".running_var")):
        return False
    mean = x0.get(name[: -len("running_var")] + "running_mean")
    var = np.asarray(x0[name])
    return mean is not None and np.asarray(mean).dtype.kind == "f" and var.dtype.kind == "f" \
        and np.shape(mean) == var.shape


def _grid_scale(x0: np.ndarray, variance: bool = False) -> tuple[float, float]:
    """§19.3: L = 64 · max(1, max |x₀|) (a running variance: 2^15 · max(1, max |x₀|)) and
    s = 2^(62 − e), e smallest with 2^e ≥ L · 2^24."""
    a = np.asarray(x0, dtype=np.float64)
    biggest = float(np.max(np.abs(a))) if a.size else 0.0
    L = (32768.0 if variance else 64.0) * max(1.0, biggest)
    target = L * 2.0 ** 24
    mantissa, exponent = math.frexp(target)  # target = mantissa · 2^exponent, 0.5 ≤ mantissa < 1
    e = exponent - 1 if mantissa == 0.5 else exponent
    return L, math.ldexp(1.0, 62 - e)


_INT64_LIMIT = 2.0 ** 63


def contribution(x: dict[str, np.ndarray], x0: dict[str, np.ndarray], weight: int) -> np.ndarray:
    """§19.3: the shared tensors (names without '/') in sorted name order, each row-major,
    float tensors as rint(((clamp(x) − x₀) · w) · s), integer tensors as w · (x − x₀); a "<u8" vector."""
    w = int(weight)
    parts: list[np.ndarray] = []
    for name in sorted((k for k in x0 if "/" not in k), key=lambda k: k.encode("utf-8")):
        base = np.asarray(x0[name])
        if name not in x:
            raise ValueError(f"trained tensor {name!r} missing")
        new = np.asarray(x[name])
        if new.shape != base.shape:
            raise ValueError(f"tensor {name!r} changed shape")
        if base.dtype.kind == "f":
            if base.dtype.itemsize not in (2, 4, 8):
                raise ValueError(f"tensor {name!r}: unsupported float type")
            b64 = base.astype(np.float64).reshape(-1)
            n64 = new.astype(np.float64).reshape(-1)
            if not (np.all(np.isfinite(b64)) and np.all(np.isfinite(n64))):
                raise ValueError(f"tensor {name!r} is not finite")
            L, s = _grid_scale(b64, _is_running_variance(name, x0))
            bound = L * (1.0 - 2.0 ** -16)
            clamped = np.minimum(np.maximum(n64, b64 - bound), b64 + bound)
            grid = np.rint(((clamped - b64) * float(w)) * s)
            if grid.size and (np.max(grid) >= _INT64_LIMIT or np.min(grid) < -_INT64_LIMIT):
                raise ValueError(f"tensor {name!r} leaves the int64 grid (weight too large)")
            parts.append(grid.astype(np.int64))
        elif base.dtype.kind in "iub":
            with np.errstate(over="ignore"):
                diff = new.astype(np.int64).reshape(-1) - base.astype(np.int64).reshape(-1)
                parts.append((np.int64(w) * diff).astype(np.int64))
        else:
            raise ValueError(f"tensor {name!r}: unsupported type {base.dtype}")
    v = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    # a contribution element as a ring element: its 64 bits read unsigned
    return np.ascontiguousarray(v, dtype=np.int64).view(_U8).astype(_U8)


# ---------------------------------------------------------------------------
# §19.4 unmasking
# ---------------------------------------------------------------------------

def unmask(total: np.ndarray, survivors: list[str], graph: dict[str, list[str]],
           mask_publics: dict[str, bytes], self_seeds: dict[str, bytes],
           dropped_keys: dict[str, bytes], context: bytes) -> np.ndarray:
    """§19.4: sum = Y − Σ_{i∈S} PRG(bᵢ, n, "self") − Σ_{j∈D} Σ_{i∈S, i~j} ±PRG(s(j, i), n, "")
    (mod 2^64), `+` where i sorts before j; D = the keys of `dropped_keys` (kⱼ rebuilt)."""
    y = _ring(total).copy()
    n = y.size
    alive = list(dict.fromkeys(survivors))
    for i in alive:
        if i not in self_seeds:
            raise ValueError(f"no rebuilt self seed for survivor {i!r}")
        y -= prg(self_seeds[i], n, context, b"self")
    for j, k_j in dropped_keys.items():
        if j in alive:
            raise ValueError(f"{j!r} is both a survivor and dropped")
        for i in alive:
            if i not in graph.get(j, ()) and j not in graph.get(i, ()):
                continue
            stream = prg(pair_seed(k_j, mask_publics[i], context), n, context, b"")
            if _before(i, j):
                y -= stream
            else:
                y += stream
    return y
