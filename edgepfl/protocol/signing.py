"""Ed25519 keys and frame signatures, independent of the broker (``docs/PROTOCOL.md`` §3a).

Key files: a private key is PEM PKCS#8, unencrypted, mode 0600; a public key is PEM
SubjectPublicKeyInfo. A key's id is the first 16 hex digits of the SHA-256 of its raw
32-byte public key; a signed frame names its signer by that id. The coordinator keeps
a :class:`Keyring` of enrolled agents (``<agent_id>.pub`` files in one directory);
an agent pins the coordinator's public key.

The bytes signed are ``SIGNATURE_CONTEXT`` followed by the frame's prefix and header
exactly as transmitted; the header carries the body's SHA-256 and length, so the body
is bound without being hashed a second time. :mod:`.envelope` builds and splits
frames; this module only holds keys and checks signatures.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import read_private, write_bytes

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    from .envelope import Message

#: Domain separation: an edgepfl frame signature can never be mistaken for a signature
#: over anything else made with the same key.
SIGNATURE_CONTEXT = b"edgepfl frame signature v1\x00"
KEY_ID_HEX = 16

#: Rejection reasons of a signature check (PROTOCOL.md §7).
UNSIGNED, BAD_SIGNATURE, NOT_ENROLLED = "unsigned", "bad_signature", "not_enrolled"
SIGNATURE_REASONS = frozenset({UNSIGNED, BAD_SIGNATURE, NOT_ENROLLED})


class KeyFileError(ValueError):
    """A key file that cannot be used (missing, not Ed25519, readable by others)."""


def key_id(public: Ed25519PublicKey) -> str:
    """First 16 hex digits of SHA-256 over the raw 32-byte public key."""
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:KEY_ID_HEX]


@dataclass(frozen=True)
class Signer:
    """A private key and its id: signs frames (:func:`edgepfl.protocol.encode`'s ``signer``)."""

    private: Ed25519PrivateKey
    key_id: str

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey) -> Signer:
        return cls(private, key_id(private.public_key()))

    def sign(self, signed_part: bytes) -> bytes:
        """Signature over ``SIGNATURE_CONTEXT + signed_part`` (a frame's prefix and header)."""
        return self.private.sign(SIGNATURE_CONTEXT + signed_part)

    def sign_statement(self, statement: bytes) -> bytes:
        """Signature over ``statement`` alone, which names its own purpose in its first bytes
        (:func:`edgepfl.secagg.keys_statement`): it cannot pass for a frame signature, whose
        signed bytes start with ``SIGNATURE_CONTEXT``, nor a frame signature for it."""
        if statement.startswith(SIGNATURE_CONTEXT):
            raise ValueError("a statement may not begin as a frame's signed part")
        return self.private.sign(statement)

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()


def generate_keypair(private_path: str | Path, public_path: str | Path) -> str:
    """Write a new Ed25519 key pair (private: PEM PKCS#8, mode 0600; public: PEM SPKI); returns its key id."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    write_bytes(private_path, pem, private=True)  # 0600 before it gets its name: never readable by others
    write_public_key(private.public_key(), public_path)
    return key_id(private.public_key())


def write_public_key(public: Ed25519PublicKey, path: str | Path) -> None:
    """Write ``public`` as PEM SubjectPublicKeyInfo (mode 0644)."""
    from cryptography.hazmat.primitives import serialization

    write_bytes(path, public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    os.chmod(path, 0o644)


def load_signer(path: str | Path) -> Signer:
    """The private key in ``path``; :class:`KeyFileError` when it is unusable or readable by group/others."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    try:
        data = read_private(path, "signing key")
    except ValueError as exc:
        raise KeyFileError(str(exc)) from None
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"signing key {path}: not an unencrypted PEM PKCS#8 key ({exc})") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise KeyFileError(f"signing key {path}: not an Ed25519 key")
    return Signer.from_private(private)


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    """The Ed25519 public key in ``path`` (PEM SubjectPublicKeyInfo)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    path = Path(path)
    try:
        public = serialization.load_pem_public_key(path.read_bytes())
    except OSError as exc:
        raise KeyFileError(f"public key {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise KeyFileError(f"public key {path}: not a PEM public key ({exc})") from None
    if not isinstance(public, Ed25519PublicKey):
        raise KeyFileError(f"public key {path}: not an Ed25519 key")
    return public


def verify(message: Message, public: Ed25519PublicKey) -> str | None:
    """Check ``message``'s signature against ``public``: None when valid, else the rejection reason."""
    return verify_signed_part(message.signed_part, message.signature, message.header.signer, public)


def verify_signed_part(signed_part: bytes, signature: bytes | None, signer: str | None,
                       public: Ed25519PublicKey) -> str | None:
    """Check a signature over a frame's prefix and header (``signer``: the key id it names)."""
    from cryptography.exceptions import InvalidSignature

    if signature is None or signer is None:
        return UNSIGNED
    if signer != key_id(public):
        return BAD_SIGNATURE  # signed, but by another key than the one this sender must use
    try:
        public.verify(signature, SIGNATURE_CONTEXT + signed_part)
    except InvalidSignature:
        return BAD_SIGNATURE
    return None


@dataclass
class Keyring:
    """Public keys of the enrolled agents: ``<agent_id>.pub`` files in ``directory``.

    A key is read when first needed, so an agent enrolled while the coordinator runs
    is accepted without a restart; an id without a file is remembered as not enrolled
    for ``negative_ttl_s``, so a flood of Sybil ids costs one ``stat`` each per interval.
    """

    directory: Path
    negative_ttl_s: float = 10.0
    _keys: dict[str, Ed25519PublicKey] = field(default_factory=dict)
    _absent: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if not self.directory.is_dir():
            raise KeyFileError(f"enrolled_dir {self.directory} is not a directory")

    def get(self, agent_id: str) -> Ed25519PublicKey | None:
        """The enrolled key of ``agent_id`` (a topic segment, so never a path), or None."""
        key = self._keys.get(agent_id)
        if key is not None:
            return key
        now = time.monotonic()
        if now - self._absent.get(agent_id, float("-inf")) < self.negative_ttl_s:
            return None
        path = self.directory / f"{agent_id}.pub"
        if not path.is_file():
            if len(self._absent) > 100_000:  # bounded, whatever the number of ids tried
                self._absent.clear()
            self._absent[agent_id] = now
            return None
        try:
            key = load_public_key(path)
        except KeyFileError:  # an unreadable enrollment enrolls nobody
            self._absent[agent_id] = now
            return None
        self._keys[agent_id] = key
        return key

    def check(self, agent_id: str, message: Message) -> str | None:
        """None when ``message`` is signed by ``agent_id``'s enrolled key, else the reason."""
        if message.signature is None:
            return UNSIGNED
        public = self.get(agent_id)
        if public is None:
            return NOT_ENROLLED
        return verify(message, public)
