"""A trainer's side of a secure round (edge_agent/secure.py): it answers each step once, and
refuses what would let a coordinator that lies about the round strip its masks — a roster
whose threshold is no majority, a second unmask, a reveal about an agent that sealed it no
share, too few surviving neighbours. Real keys, real sealed shares."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edgepfl.edge_agent.secure import SecureSessions, SharesNotOpened
from edgepfl.protocol import MessageType, decode, encode
from edgepfl.protocol.secagg import PeerKeys, SealedShare, SecAggMeta, SecAggTask
from edgepfl.secagg import SecAggError

SESSION = "5e" * 16
FED = "fed"


def step(sessions: SecureSessions, meta: SecAggMeta, round: int = 3, recipient: str | None = None) -> SecAggMeta | None:
    frame = encode(MessageType.SECAGG, federation=FED, sender="coordinator", round=round, meta=meta,
                   recipient=recipient)
    answer = sessions.step(decode(frame).header, meta)
    return None if answer is None else decode(answer).meta_as(SecAggMeta)


def fleet(n: int = 5) -> dict[str, tuple[SecureSessions, PeerKeys]]:
    out = {}
    for i in range(n):
        agent = f"a{i}"
        sessions = SecureSessions(agent, authenticated=True)
        keys = step(sessions, SecAggMeta(session=SESSION, step="advertise", threshold=3))
        assert keys is not None and keys.keys is not None and keys.keys.agent == agent
        out[agent] = (sessions, keys.keys)
    return out


def rosters(agents, threshold: int = 3) -> dict[str, SecAggMeta | None]:
    return {a: step(s, SecAggMeta(session=SESSION, step="roster", threshold=threshold,
                                  neighbours=[k for b, (_, k) in agents.items() if b != a]))
            for a, (s, _) in agents.items()}


def task_for(agent: str, shares: dict[str, SecAggMeta | None], senders) -> SecAggTask:
    sealed = [SealedShare(peer=b, ciphertext=next(s.ciphertext for s in shares[b].shares if s.peer == agent))
              for b in senders if b != agent]
    return SecAggTask(session=SESSION, shares=sealed)


def test_a_round_of_steps_masks_and_reveals_only_what_it_was_asked():
    agents = fleet()
    shares = rosters(agents)
    assert all(s is not None and len(s.shares) == 4 for s in shares.values())
    me, _ = agents["a0"]
    masked = me.mask(FED, 3, task_for("a0", shares, agents), np.arange(10, dtype="<u8"))
    assert masked.dtype == np.dtype("<u8") and not np.array_equal(masked, np.arange(10, dtype="<u8"))
    reveal = step(me, SecAggMeta(session=SESSION, step="unmask", survivors=["a1", "a2", "a3"], dropped=["a4"]))
    assert reveal is not None
    assert sorted(s.agent for s in reveal.seeds) == ["a1", "a2", "a3"] and [s.agent for s in reveal.mask_keys] == ["a4"]
    # a second unmask (the coordinator now calling a3 dropped, to get its mask key too) is not answered
    assert step(me, SecAggMeta(session=SESSION, step="unmask", survivors=["a1", "a2", "a4"], dropped=["a3"])) is None


@pytest.mark.parametrize("threshold", [1, 2])
def test_a_roster_whose_threshold_is_no_majority_is_not_answered(threshold):
    agents = fleet()
    assert all(v is None for v in rosters(agents, threshold).values())


def test_a_roster_naming_the_agent_itself_or_twice_is_not_answered():
    agents = fleet(4)
    me, mine = agents["a0"]
    others = [k for b, (_, k) in agents.items() if b != "a0"]
    assert step(me, SecAggMeta(session=SESSION, step="roster", threshold=3, neighbours=[mine, *others])) is None
    assert step(me, SecAggMeta(session=SESSION, step="roster", threshold=2,
                               neighbours=[others[0], others[0], others[1]])) is None


def test_an_unmask_about_agents_that_sealed_no_share_or_too_few_survivors_is_not_answered():
    agents = fleet()
    shares = rosters(agents)
    me, _ = agents["a0"]
    me.mask(FED, 3, task_for("a0", shares, ["a1", "a2", "a3"]), np.zeros(4, "<u8"))  # a4's share never came
    assert step(me, SecAggMeta(session=SESSION, step="unmask", survivors=["a1", "a2"], dropped=["a3"])) is None
    assert step(me, SecAggMeta(session=SESSION, step="unmask", survivors=["a1", "a2", "a3"], dropped=["a4"])) is None
    assert step(me, SecAggMeta(session=SESSION, step="unmask", survivors=["a1", "a2", "a3"])) is not None


def test_masking_needs_a_roster_enough_shares_and_shares_sealed_to_this_agent():
    agents = fleet()
    shares = rosters(agents)
    me, _ = agents["a0"]
    with pytest.raises(SecAggError, match="needed"):
        me.mask(FED, 3, task_for("a0", shares, ["a1", "a2"]), np.zeros(4, "<u8"))
    with pytest.raises(SharesNotOpened, match="do not open") as unopened:  # a share a1 sealed to a2, passed to a0
        forged = SealedShare(peer="a1", ciphertext=next(s.ciphertext for s in shares["a1"].shares if s.peer == "a2"))
        me.mask(FED, 3, SecAggTask(session=SESSION, shares=[forged, *task_for("a0", shares, ["a2", "a3"]).shares]),
                np.zeros(4, "<u8"))
    assert unopened.value.peers == ["a1"]  # the one whose share did not open, not the others
    with pytest.raises(SecAggError, match="no roster"):
        me.mask(FED, 4, task_for("a0", shares, agents), np.zeros(4, "<u8"))  # another round


def test_an_agent_without_a_pinned_coordinator_key_takes_no_step():
    """On a broker anyone may write on its task topic: a roster of an attacker's keys would
    get its shares, so an agent that cannot tell the coordinator's steps from others' takes none."""
    me = SecureSessions("a0")
    assert step(me, SecAggMeta(session=SESSION, step="advertise", threshold=2)) is None


def test_a_step_addressed_to_another_agent_or_advertised_twice_is_not_answered():
    me = SecureSessions("a0", authenticated=True)
    assert step(me, SecAggMeta(session=SESSION, step="advertise", threshold=2), recipient="a1") is None
    assert step(me, SecAggMeta(session=SESSION, step="advertise", threshold=2)) is not None
    assert step(me, SecAggMeta(session=SESSION, step="advertise", threshold=2)) is None


@pytest.mark.parametrize("fields, says", [
    ({"step": "keys"}, "carries the sender's keys"),
    ({"step": "advertise"}, "carries the threshold"),
    ({"step": "shares", "threshold": 2}, "carries no threshold"),
    ({"step": "unmask", "survivors": ["a"], "dropped": ["a"]}, "both a survivor and dropped"),
])
def test_a_step_carries_the_fields_of_its_step_only(fields, says):
    with pytest.raises(ValueError, match=says):
        SecAggMeta(session=SESSION, **fields)


# ------------------------------------------------------------------ keys a device can check (protocol 1.14)
def certified_fleet(n: int = 5, *, ca=None, uncertified: tuple[str, ...] = ()):
    """Agents whose signing keys the federation's CA certified (but ``uncertified``), each checking
    its neighbours' keys against that CA."""
    from cryptography.hazmat.primitives.serialization import Encoding

    from edgepfl import pki
    from edgepfl.protocol.signing import Signer

    ca = ca or pki.new_ca("edgepfl fed")
    out = {}
    for i in range(n):
        agent = f"a{i}"
        signer = Signer.from_private(Ed25519PrivateKey.generate())
        cert = None if agent in uncertified else pki.issue_signing_certificate(*ca, agent, signer.public)
        sessions = SecureSessions(agent, signer, authenticated=True,
                                  certificate=cert.public_bytes(Encoding.DER) if cert is not None else None,
                                  peer_ca=ca[1])
        keys = step(sessions, SecAggMeta(session=SESSION, step="advertise", threshold=3))
        assert keys is not None and keys.keys is not None
        out[agent] = (sessions, keys.keys)
    return out


def test_with_the_federations_ca_a_roster_of_certified_keys_is_answered_and_a_substituted_key_is_not():
    """A coordinator that puts keys of its own in a neighbour's place (to open the shares sealed
    to it) cannot sign them with the neighbour's certified key: the roster is refused, so no
    share is sealed to the substitute. The certificate and signature of the neighbour's real
    keys, relayed beside the substitute, do not help it."""
    from edgepfl.protocol.secagg import b64
    from edgepfl.secagg import RoundKeys

    agents = certified_fleet()
    assert all(k.certificate and k.signature for _, k in agents.values())
    assert all(s is not None and len(s.shares) == 4 for s in rosters(agents).values())

    agents = certified_fleet()
    mine = RoundKeys.generate()
    me, _ = agents["a0"]
    honest = [k for b, (_, k) in agents.items() if b != "a0"]
    swapped = honest[0].model_copy(update={"mask_public": b64(mine.mask_public), "share_public": b64(mine.share_public)})
    assert step(me, SecAggMeta(session=SESSION, step="roster", threshold=3, neighbours=[swapped, *honest[1:]])) is None
    # the same keys of the session's real ones, but signed for another session (a replay), are refused too
    other, _ = agents["a1"]
    replayed = step(other, SecAggMeta(session="6f" * 16, step="advertise", threshold=3))
    assert replayed is not None and replayed.keys is not None
    assert step(me, SecAggMeta(session=SESSION, step="roster", threshold=3,
                               neighbours=[replayed.keys, *honest[1:]])) is None


def test_with_the_federations_ca_keys_without_a_certificate_or_from_another_ca_are_refused():
    from edgepfl import pki

    for agents in (certified_fleet(uncertified=("a1",)), certified_fleet()):
        if "a1" in agents and agents["a1"][1].certificate is not None:  # the second: a1 certified by another CA
            outsider = certified_fleet(ca=pki.new_ca("edgepfl fed"))["a1"][1]
            agents["a1"] = (agents["a1"][0], outsider)
        me, _ = agents["a0"]
        assert step(me, SecAggMeta(session=SESSION, step="roster", threshold=3,
                                   neighbours=[k for b, (_, k) in agents.items() if b != "a0"])) is None
