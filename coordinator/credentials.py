"""The coordinator's keys, loaded once per process and handed to whoever signs or checks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from edgepfl.config import SecuritySpec
from edgepfl.protocol.signing import Keyring, Signer, load_public_key, load_signer


@dataclass(frozen=True)
class Credentials:
    """The signing key (``security.signing_key``) and the enrolled agents' keys
    (``security.enrolled_dir``); either may be absent (an unsigned or open deployment)."""

    #: signs every task, release, presence and NACK (None: unsigned deployment)
    signer: Signer | None = None
    #: with it only enrolled agents' signed frames get in (PROTOCOL.md §3a)
    keyring: Keyring | None = None
    #: the coordinator above this one (a site aggregator's central coordinator), whose frames alone it acts on
    #: (``security.coordinator_key``; None: not pinned)
    upstream: Ed25519PublicKey | None = None
    #: the key files these were read from: a coordinator built over a fleet takes the fleet's
    #: credentials only when they come from its own ``security`` section (wiring.py)
    source: SecuritySpec | None = None

    @classmethod
    def load(cls, security: SecuritySpec) -> Credentials:
        """The one place the coordinator side reads its key files."""
        return cls(signer=load_signer(security.signing_key) if security.signing_key else None,
                   keyring=Keyring(Path(security.enrolled_dir)) if security.enrolled_dir else None,
                   upstream=load_public_key(security.coordinator_key) if security.coordinator_key else None,
                   source=security)
