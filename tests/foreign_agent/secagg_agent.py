"""An edgepfl trainer agent whose secure aggregation is the second implementation.

``python tests/foreign_agent/secagg_agent.py --config agent.yaml`` runs ``edgepfl agent``
with every computation of a secure round that PROTOCOL.md §19 defines — its keys, the
context, the Shamir shares and their sealing, opening a neighbour's share, the contribution
on the grid, the masks — taken from :mod:`secagg` (``tests/foreign_agent/secagg.py``,
written from §19 alone) instead of ``edgepfl.secagg`` and ``edgepfl.aggregation``. The
agent's MQTT, signing, training and step checks stay the project's: what this process
proves is that the text's secure aggregation, byte for byte, composes with the project's
in a live round (``tests/integration/security/test_secure_aggregation_from_the_text.py``).
Differential privacy's contribution is not replaced (the live test runs without it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import secagg as text  # tests/foreign_agent/secagg.py: this script's folder is first on sys.path

import edgepfl.edge_agent.secure as secure
import edgepfl.edge_agent.trainer as trainer
from edgepfl.secagg import EncryptedShare, SecAggError

#: the key under which the text's ring vector travels between the two replaced functions
_RING = "ring vector of §19.3"


@dataclass
class TextKeys:
    """An agent's two X25519 private keys for one session; public keys by the text's X25519."""

    mask_private: bytes
    share_private: bytes

    @classmethod
    def generate(cls) -> TextKeys:
        return cls(os.urandom(32), os.urandom(32))

    @property
    def mask_public(self) -> bytes:
        return text.x25519_public(self.mask_private)

    @property
    def share_public(self) -> bytes:
        return text.x25519_public(self.share_private)


@dataclass
class TextMasker:
    """``edgepfl.secagg.Masker``'s place in the agent, done by :class:`secagg.Participant`."""

    me: str
    keys: TextKeys
    mask_publics: Mapping[str, bytes]
    share_publics: Mapping[str, bytes]
    threshold: int
    bits: int
    context: bytes
    self_seed: bytes = field(default_factory=lambda: os.urandom(16))

    def __post_init__(self) -> None:
        if self.bits != 64:
            raise SecAggError(f"the protocol's ring is 2**64, not 2**{self.bits}")
        self.participant = text.Participant(self.me, self.keys.mask_private, self.keys.share_private, self.context,
                                            self.self_seed)

    def shares_for(self) -> list[EncryptedShare]:
        neighbours = {n: (self.mask_publics[n], self.share_publics[n]) for n in sorted(self.mask_publics)}
        sealed = self.participant.sealed_shares(neighbours, self.threshold)
        return [EncryptedShare(self.me, recipient, ciphertext) for recipient, ciphertext in sorted(sealed.items())]

    def open_share(self, share: EncryptedShare, sender_share_public: bytes) -> tuple[int, bytes, bytes]:
        if share.recipient != self.me:
            raise SecAggError(f"a share for {share.recipient}, not {self.me}")
        try:
            return self.participant.open_share(share.sender, sender_share_public, share.ciphertext)
        except ValueError as exc:
            raise SecAggError(f"the share from {share.sender} does not open: {exc}") from None

    def masked(self, x: np.ndarray) -> np.ndarray:
        return self.participant.masked(np.ascontiguousarray(x, dtype="<u8"), dict(self.mask_publics))


def text_contribution(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], weight: int,
                      clip_norm: float | None = None, noise_std: float = 0.0, rng=None) -> dict[str, np.ndarray]:
    if clip_norm is not None:
        raise SecAggError("this agent's text implementation has no differential privacy")
    x0 = {k: np.asarray(v) for k, v in reference.items()}
    return {_RING: text.contribution({k: np.asarray(params[k]) for k in x0}, x0, weight)}


def text_ring_vector(contributions: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> np.ndarray:
    return contributions[_RING]


def main() -> int:
    secure.RoundKeys = TextKeys  # type: ignore[misc,assignment]
    secure.Masker = TextMasker  # type: ignore[misc,assignment]
    secure.session_context = text.context  # type: ignore[assignment]
    trainer.grid_contribution = text_contribution  # type: ignore[assignment]
    trainer.ring_vector = text_ring_vector  # type: ignore[assignment]
    from edgepfl.cli import main as edgepfl

    return edgepfl(["agent", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
