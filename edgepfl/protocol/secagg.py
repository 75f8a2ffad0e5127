"""The secure-aggregation fields of the wire (since protocol 1.9; docs/PROTOCOL.md §19).

A secure round (``secure_aggregation.enabled``) runs the steps of
:mod:`edgepfl.secagg` as messages of type ``secagg`` on the agents' task topics
(coordinator -> agent) and update topics (agent -> coordinator), every one signed like
any other frame of its sender:

=========  ===================  ==============================================================
step       direction            what it carries
=========  ===================  ==============================================================
advertise  coordinator -> agent the round's ``session``: make fresh keys for it
keys       agent -> coordinator its two X25519 public keys (:class:`PeerKeys`)
roster     coordinator -> agent its neighbours' public keys, the share ``threshold``
shares     agent -> coordinator one :class:`SealedShare` per neighbour
(task)     coordinator -> agent ``task.secagg``: the shares sealed to it (:class:`SecAggTask`)
(update)   agent -> coordinator the masked vector instead of the shared tensors
unmask     coordinator -> agent which of its neighbours sent a masked update, which did not
reveal     agent -> coordinator its shares of the survivors' seeds, of the others' mask keys
=========  ===================  ==============================================================

Binary values travel as standard base64 strings; every list is bounded, so a frame's
size is bounded by the neighbour count (:data:`MAX_NEIGHBOURS`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .evolution import since
from .topics import NAME_PATTERN

__all__ = [
    "MASKED_TENSOR", "MAX_NEIGHBOURS", "PeerKeys", "RevealedShare", "SealedShare", "SecAggMeta", "SecAggStep",
    "SecAggTask", "b64", "unb64",
]

#: the one tensor a masked update carries: the flat vector of its masked contribution, elements of
#: the ring of integers modulo 2**64 sent as the int64 of the same bits
MASKED_TENSOR = "secagg/masked"
#: the most neighbours one agent may have (a sparse graph's degree; a round of more agents is sparse)
MAX_NEIGHBOURS = 1024
_ID = r"^[0-9a-f]{32}$"
_KEY_B64 = r"^[A-Za-z0-9+/]{43}=$"  # 32 bytes
_SHARE_B64 = r"^[A-Za-z0-9+/]{22}==$|^[A-Za-z0-9+/]{43}=$"  # 16 or 32 bytes
SecAggStep = Literal["advertise", "keys", "roster", "shares", "unmask", "reveal"]


def b64(data: bytes) -> str:
    """``data`` as standard base64 text."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    """The bytes of standard base64 ``text`` (ValueError for anything else)."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise ValueError(f"not base64: {exc}") from None


class _Wire(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)


class PeerKeys(_Wire):
    """One agent's public keys for a round: X25519, base64 of 32 bytes each."""

    agent: str = Field(pattern=NAME_PATTERN)
    #: its agreements with a neighbour's seed the pairwise mask between them
    mask_public: str = Field(pattern=_KEY_B64)
    #: its agreements with a neighbour's encrypt the shares between them
    share_public: str = Field(pattern=_KEY_B64)
    #: since 1.14: the agent's message-signing key certified by the federation's CA (base64 DER X.509)
    #: and its Ed25519 signature of :func:`edgepfl.secagg.keys_statement`, so that a neighbour that
    #: trusts the CA can check the keys the coordinator relays (absent: not certified)
    certificate: str | None = Field(None, min_length=4, max_length=4096, pattern=r"^[A-Za-z0-9+/]+={0,2}$",
                                    json_schema_extra=since("1.14"))
    signature: str | None = Field(None, pattern=r"^[A-Za-z0-9+/]{86}==$", json_schema_extra=since("1.14"))


class SealedShare(_Wire):
    """Shares of one agent's secrets for one neighbour, ChaCha20-Poly1305-sealed to it.
    ``peer`` is the other end: the recipient in an agent's ``shares``, the sender in a
    task's ``secagg.shares``."""

    peer: str = Field(pattern=NAME_PATTERN)
    ciphertext: str = Field(min_length=4, max_length=128)


class RevealedShare(_Wire):
    """One share, opened, of ``agent``'s self-mask seed (16 bytes) or mask key (32 bytes)."""

    agent: str = Field(pattern=NAME_PATTERN)
    index: int = Field(ge=1, le=65535)
    share: str = Field(pattern=_SHARE_B64)


class SecAggTask(_Wire):
    """``task.secagg`` (since 1.9): this training update is to be masked (docs/PROTOCOL.md §19).

    The agent adds its contribution on the exact grid of the round's sums, weighted by
    ``min(num_train, weight_cap)``, masks it with the neighbours whose shares are here
    (and no others), and sends the masked vector as its update's only tensor."""

    session: str = Field(pattern=_ID)
    #: the weight cap of the round (None: none): the agent's weight is min(its num_train, this)
    weight_cap: int | None = Field(None, ge=1)
    #: the shares its neighbours sealed to it: the neighbours it masks with
    shares: list[SealedShare] = Field(max_length=MAX_NEIGHBOURS)
    #: distributed differential privacy: clip the float tensors' change to this L2 norm and count once
    #: (weight 1); None: no privacy mechanism on the device
    clip_norm: float | None = Field(None, gt=0, le=1e6)
    #: distributed differential privacy: the standard deviation of the Gaussian noise the device adds to
    #: each coordinate of its clipped change, drawn from its own entropy
    noise_std: float | None = Field(None, ge=0, le=1e6)


class SecAggMeta(_Wire):
    """A step of a secure round (since 1.9): ``step`` says which fields it carries."""

    session: str = Field(pattern=_ID)
    step: SecAggStep
    #: advertise, roster: Shamir shares reconstruct a secret from this many
    threshold: int | None = Field(None, ge=1, le=MAX_NEIGHBOURS)
    #: keys: the sender's own
    keys: PeerKeys | None = None
    #: roster: the agent's neighbours
    neighbours: list[PeerKeys] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)
    #: shares: one per neighbour of the roster
    shares: list[SealedShare] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)
    #: unmask: neighbours whose masked update is in the sum (reveal their seeds' shares)
    survivors: list[str] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)
    #: unmask: neighbours that sealed shares and sent no masked update (reveal their mask keys' shares)
    dropped: list[str] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)
    #: reveal: shares of the survivors' self-mask seeds
    seeds: list[RevealedShare] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)
    #: reveal: shares of the dropped agents' mask keys
    mask_keys: list[RevealedShare] = Field(default_factory=list, max_length=MAX_NEIGHBOURS)

    @model_validator(mode="after")
    def _fields_of_step(self) -> SecAggMeta:
        carried = {name for name in ("threshold", "keys") if getattr(self, name) is not None}
        carried |= {name for name in ("neighbours", "shares", "survivors", "dropped", "seeds", "mask_keys")
                    if getattr(self, name)}
        allowed = _STEP_FIELDS[self.step]
        if not carried <= allowed:
            raise ValueError(f"a {self.step} step carries no {', '.join(sorted(carried - allowed))}")
        if self.step == "keys" and self.keys is None:
            raise ValueError("a keys step carries the sender's keys")
        if self.step in ("advertise", "roster") and self.threshold is None:
            raise ValueError(f"a {self.step} step carries the threshold")
        if set(self.survivors) & set(self.dropped):
            raise ValueError("an agent is both a survivor and dropped")
        return self


_STEP_FIELDS: dict[str, set[str]] = {
    "advertise": {"threshold"},
    "keys": {"keys"},
    "roster": {"threshold", "neighbours"},
    "shares": {"shares"},
    "unmask": {"survivors", "dropped"},
    "reveal": {"seeds", "mask_keys"},
}
