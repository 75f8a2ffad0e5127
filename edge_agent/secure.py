"""A trainer's side of secure aggregation (protocol 1.9; docs/PROTOCOL.md §19).

:class:`SecureSessions` answers the coordinator's ``secagg`` steps and masks the
update of a task that asks for it (``task.secagg``), with :mod:`edgepfl.secagg`'s
primitives. Before it sends a secret it makes the checks that keep its update hidden
from a coordinator that lies about who is in the round:

* a roster is taken once per session, of distinct neighbours other than itself, with a
  threshold that is a strict majority of them (so no two disjoint sets of its
  neighbours can each reconstruct one of its secrets);
* it masks only with the neighbours whose shares reached it, and only if they are at
  least the threshold;
* it answers one unmask step per session, and only about neighbours that sealed it
  shares: for each either the share of its self-mask seed (it sent a masked update) or
  of its mask key (it did not), never both — with both, the coordinator could strip
  every mask off that neighbour's update;
* with the federation's CA (``security.peer_ca``, protocol 1.14) it takes a roster only
  when every neighbour's keys are signed by a message-signing key the CA certified as that
  neighbour's: a coordinator that puts its own keys in a neighbour's place, or enrols a
  device of its own, is refused. With its own certificate (``security.certificate``) it
  signs its keys so that its neighbours can check them.

It takes no step at all without a pinned coordinator key (``security.coordinator_key``):
on a broker anyone could send it a roster of their own keys, and its shares with them.

A step that fails a check is not answered (the round goes on without this agent, and
its update, if sent, stays masked); the reason is logged. Sessions live in memory: an
agent that restarts mid-round has dropped out of it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgepfl.protocol import MessageType, encode
from edgepfl.protocol.envelope import Header
from edgepfl.protocol.secagg import (
    PeerKeys,
    RevealedShare,
    SealedShare,
    SecAggMeta,
    SecAggTask,
    b64,
    unb64,
)
from edgepfl.protocol.signing import Signer
from edgepfl.secagg import (
    RING_BITS,
    EncryptedShare,
    Masker,
    RoundKeys,
    SecAggError,
    keys_statement,
    session_context,
)

if TYPE_CHECKING:
    from cryptography import x509

log = logging.getLogger("edgepfl.agent")

#: sessions kept at once: a round's, and the one before it while its unmask step is late
SESSIONS_KEPT = 4


class SharesNotOpened(SecAggError):
    """Shares sealed to this agent that do not open, by the neighbours in ``peers``: the
    agent refuses the task as ``bad_shares`` naming them (PROTOCOL.md §19)."""

    def __init__(self, peers: list[str]):
        super().__init__(f"the shares from {', '.join(peers[:5])}{' …' if len(peers) > 5 else ''} do not open")
        self.peers = peers

@dataclass
class _Session:
    round: int
    context: bytes
    keys: RoundKeys
    threshold: int
    #: the roster's neighbours' public keys (mask, share), by id; None until the roster came
    roster: dict[str, tuple[bytes, bytes]] | None = None
    masker: Masker | None = None
    #: the neighbours whose shares reached this agent (with its task): (index, seed share, key share)
    received: dict[str, tuple[int, bytes, bytes]] = field(default_factory=dict)
    revealed: bool = False


class SecureSessions:
    """The secure rounds an agent takes part in, by session id."""

    def __init__(self, agent_id: str, signer: Signer | None = None, authenticated: bool = False,
                 certificate: bytes | None = None, peer_ca: x509.Certificate | None = None):
        self.agent_id = agent_id
        self.signer = signer
        #: the coordinator's steps reach this agent only signed by its pinned key (or from within its process):
        #: without that, a forged roster or unmask could take its secrets, so it takes no step at all
        self.authenticated = authenticated
        #: this agent's signing key certified by the federation's CA (DER): sent with its keys, which it signs
        self.certificate = certificate if signer is not None else None
        #: the federation's CA: every neighbour's keys must be signed by a key it certified (None: not checked)
        self.peer_ca = peer_ca
        self._sessions: OrderedDict[str, _Session] = OrderedDict()

    def step(self, message_header: Header, meta: SecAggMeta) -> bytes | None:
        """Answer one ``secagg`` step from the coordinator: the frame to publish on the
        update topic, or None (a step that needs no answer, or failed a check: logged)."""
        h = message_header
        try:
            if not self.authenticated:
                raise SecAggError("no pinned coordinator key (security.coordinator_key): this agent takes part in "
                                  "secure rounds only when the coordinator's steps are signed")
            if h.recipient not in (None, self.agent_id):
                raise SecAggError(f"addressed to {h.recipient}")
            if meta.step == "advertise":
                answer = self._advertise(h, meta)
            elif meta.step == "roster":
                answer = self._roster(h, meta)
            elif meta.step == "unmask":
                answer = self._unmask(h, meta)
            else:
                raise SecAggError(f"a {meta.step} step is the agent's to send")
        except SecAggError as exc:
            log.warning("secure aggregation, round %d: %s step not answered: %s", h.round, meta.step, exc)
            return None
        return encode(MessageType.SECAGG, federation=h.federation, sender=self.agent_id, round=h.round,
                      meta=answer, signer=self.signer)

    def open_shares(self, round: int, task: SecAggTask) -> None:
        """Open the shares ``task`` carries, before the agent trains for it: SecAggError when
        it cannot take part (no roster, shares from strangers, too few), :class:`SharesNotOpened`
        naming every neighbour whose share does not open (garbage, or sealed for another round,
        key or recipient) — none of them is used then, and no update is sent."""
        s = self._sessions.get(task.session)
        if s is None or s.roster is None or s.masker is None or s.round != round:
            raise SecAggError(f"no roster for session {task.session} of round {round}")
        received, unopened = {}, []
        for sealed in task.shares:
            if sealed.peer not in s.roster or sealed.peer in received or sealed.peer in unopened:
                raise SecAggError(f"a share from {sealed.peer}, not one of its neighbours (or twice)")
            share = EncryptedShare(sealed.peer, self.agent_id, unb64(sealed.ciphertext))
            try:
                received[sealed.peer] = s.masker.open_share(share, s.roster[sealed.peer][1])
            except SecAggError:
                unopened.append(sealed.peer)
        if unopened:
            raise SharesNotOpened(sorted(unopened))
        if len(received) < s.threshold:
            raise SecAggError(f"{len(received)} neighbours sealed shares, {s.threshold} needed")
        s.received = received

    def mask(self, federation: str, round: int, task: SecAggTask, vector: np.ndarray) -> np.ndarray:
        """``vector`` (the update's contribution in the ring) masked for the session of
        ``task``, with the neighbours whose shares it carries (:meth:`open_shares`, which it
        calls). SecAggError when it cannot be: the update is then not sent."""
        self.open_shares(round, task)
        s = self._sessions[task.session]
        assert s.roster is not None and s.masker is not None  # open_shares checked them
        received = s.received
        # masks with exactly the neighbours the coordinator will count as having shares
        masker = Masker(self.agent_id, s.keys, {a: s.roster[a][0] for a in received},
                        {a: s.roster[a][1] for a in received}, s.threshold, RING_BITS, s.context,
                        self_seed=s.masker.self_seed)
        return masker.masked(np.ascontiguousarray(vector, dtype="<u8"))

    # ---------------------------------------------------------------- steps
    def _advertise(self, h: Header, meta: SecAggMeta) -> SecAggMeta:
        if meta.session in self._sessions:
            raise SecAggError(f"session {meta.session} was advertised before")
        keys = RoundKeys.generate()
        assert meta.threshold is not None  # SecAggMeta's validator
        self._sessions[meta.session] = _Session(h.round, session_context(h.federation, h.round, meta.session), keys,
                                                meta.threshold)
        while len(self._sessions) > SESSIONS_KEPT:
            self._sessions.popitem(last=False)
        certificate = signature = None
        if self.certificate is not None and self.signer is not None:
            certificate = b64(self.certificate)
            signature = b64(self.signer.sign_statement(keys_statement(self._sessions[meta.session].context, self.agent_id,
                                                            keys.mask_public, keys.share_public)))
        return SecAggMeta(session=meta.session, step="keys", keys=PeerKeys(
            agent=self.agent_id, mask_public=b64(keys.mask_public), share_public=b64(keys.share_public),
            certificate=certificate, signature=signature))

    def _roster(self, h: Header, meta: SecAggMeta) -> SecAggMeta:
        s = self._session(meta.session, h.round)
        if s.roster is not None:
            raise SecAggError("a second roster for the session")
        ids = [p.agent for p in meta.neighbours]
        if len(set(ids)) != len(ids) or self.agent_id in ids:
            raise SecAggError("the roster names a neighbour twice, or this agent")
        threshold = meta.threshold or 0
        if not len(ids) // 2 + 1 <= threshold <= len(ids):
            raise SecAggError(f"threshold {threshold} of {len(ids)} neighbours is not a majority of them")
        if self.peer_ca is not None:
            from edgepfl.pki import uncertified_keys

            for peer in meta.neighbours:
                why = uncertified_keys(self.peer_ca, peer, s.context)
                if why is not None:
                    raise SecAggError(f"the roster's keys of {peer.agent} are not certified by the federation's CA: "
                                      f"{why}")
        s.threshold = threshold
        s.roster = {p.agent: (unb64(p.mask_public), unb64(p.share_public)) for p in meta.neighbours}
        s.masker = Masker(self.agent_id, s.keys, {a: k[0] for a, k in s.roster.items()},
                          {a: k[1] for a, k in s.roster.items()}, threshold, RING_BITS, s.context)
        sealed = [SealedShare(peer=e.recipient, ciphertext=b64(e.ciphertext)) for e in s.masker.shares_for()]
        return SecAggMeta(session=meta.session, step="shares", shares=sealed)

    def _unmask(self, h: Header, meta: SecAggMeta) -> SecAggMeta:
        s = self._session(meta.session, h.round)
        if s.revealed:
            raise SecAggError("a second unmask step for the session")
        named = set(meta.survivors) | set(meta.dropped)
        if not named <= set(s.received):
            raise SecAggError(f"asked about {sorted(named - set(s.received))[:3]}, which sealed it no shares")
        if len(meta.survivors) < s.threshold:
            raise SecAggError(f"{len(meta.survivors)} surviving neighbours, {s.threshold} needed")
        s.revealed = True
        seeds = [RevealedShare(agent=a, index=s.received[a][0], share=b64(s.received[a][1])) for a in meta.survivors]
        keys = [RevealedShare(agent=a, index=s.received[a][0], share=b64(s.received[a][2])) for a in meta.dropped]
        return SecAggMeta(session=meta.session, step="reveal", seeds=seeds, mask_keys=keys)

    def _session(self, session: str, round: int) -> _Session:
        s = self._sessions.get(session)
        if s is None or s.round != round:
            raise SecAggError(f"no session {session} in round {round}")
        return s
