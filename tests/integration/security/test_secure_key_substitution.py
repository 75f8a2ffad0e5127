"""A curious coordinator substitutes a device's keys in a secure round (PROTOCOL.md §19,
protocol 1.14), live: six agent processes of a signed fleet over Mosquitto, and a coordinator
whose rosters put its own X25519 keys in agent-01's place — the relayed certificate and
signature stay agent-01's, since it cannot make new ones without the CA key.

Without the federation's CA on the devices the attack works: the other five seal their shares
of their self-mask seed and mask key to the coordinator's key, and it opens them (shown
here with its private key). With the CA (``security.peer_ca``, as ``edgepfl provision`` now
writes it) every one of them refuses the roster: no share is sealed to the substitute, and
the round ends with nothing learnt."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from edgepfl import pki
from edgepfl.config import SecuritySpec
from edgepfl.coordinator.drivers import secure as driver
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import MessageType, agent_topic, decode
from edgepfl.protocol.secagg import SecAggMeta, b64, unb64
from edgepfl.protocol.signing import load_public_key
from edgepfl.secagg import EncryptedShare, Masker, RoundKeys, session_context

from tests.attack_kit import signed_fleet
from tests.fleet_helpers import run_config

pytest.importorskip("torch")

AGENTS = 6
VICTIM = "agent-01"
NO_BOUNDS = {"rule": "mean", "max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}


def certify(root: Path, ids: list[str], agents: dict[str, SecuritySpec]) -> dict[str, SecuritySpec]:
    """The federation's CA certifies each agent's signing key; each agent holds its certificate and the CA."""
    ca = pki.new_ca("edgepfl test")
    pki.write_certificate(root / "ca.crt", ca[1])
    out = {}
    for agent in ids:
        cert = pki.issue_signing_certificate(*ca, agent, load_public_key(root / "enrolled" / f"{agent}.pub"))
        pki.write_certificate(root / f"{agent}.crt", cert)
        out[agent] = agents[agent].model_copy(update={"certificate": str(root / f"{agent}.crt"),
                                                      "peer_ca": str(root / "ca.crt")})
    return out


def run_substituting(url: str, out: Path, coordinator: SecuritySpec, agents: dict[str, SecuritySpec],
                     substitute: RoundKeys, monkeypatch) -> tuple[str, list]:
    """One secure round whose rosters carry ``substitute``'s keys for VICTIM; the federation and rows."""
    honest_send = driver.SecureRounds._send

    def substituting(self, agent_id, meta, result):
        if meta.step == "roster":
            meta = meta.model_copy(update={"neighbours": [
                k.model_copy(update={"mask_public": b64(substitute.mask_public),
                                     "share_public": b64(substitute.share_public)}) if k.agent == VICTIM else k
                for k in meta.neighbours]})
        return honest_send(self, agent_id, meta, result)

    monkeypatch.setattr(driver.SecureRounds, "_send", substituting)
    config = prepare(run_config(f"ks{uuid.uuid4().hex[:8]}", rounds=1, min_agents=AGENTS, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, aggregation=NO_BOUNDS,
                                data={"dataset": "digits", "samples_per_client": 60}, security=coordinator,
                                round_timeout_s=20, secure_aggregation={"enabled": True, "step_timeout_s": 10}),
                     AGENTS)
    procs = [spawn_agent(config, out, url, a, i, security=agents[a]) for i, a in enumerate(agent_ids(AGENTS))]
    fleet = MqttFleet(config.federation, config.broker, url=url, security=coordinator)
    try:
        rows = Coordinator(config, fleet, out, progress=False, **data_shape(config)).run()
    finally:
        fleet.close()
        stop_agents(procs)
    return config.federation, rows


def sealed_to_victim(captured, federation: str) -> list[tuple[str, int, str, bytes]]:
    """Every share an agent sealed to VICTIM: (sender, round, session, ciphertext)."""
    out = []
    for agent in agent_ids(AGENTS):
        for topic, payload in captured:
            if topic != agent_topic(federation, agent, "update"):
                continue
            message = decode(payload)
            if message.type != MessageType.SECAGG:
                continue
            meta = message.meta_as(SecAggMeta)
            out += [(agent, message.header.round, meta.session, unb64(s.ciphertext))
                    for s in meta.shares if s.peer == VICTIM]
    return out


def test_a_coordinator_substituting_a_devices_keys_is_refused_by_devices_that_hold_the_ca(
        mosquitto, broker_capture, tmp_path, monkeypatch):
    ids = agent_ids(AGENTS)
    coordinator, plain = signed_fleet(tmp_path / "keys", ids)
    substitute = RoundKeys.generate()

    # without the CA on the devices: the shares sealed "to agent-01" open with the coordinator's key
    federation, _ = run_substituting(mosquitto.url, tmp_path / "plain", coordinator, plain, substitute, monkeypatch)
    stolen = sealed_to_victim(broker_capture.snapshot(), federation)
    assert len(stolen) == AGENTS - 1
    sender, round, session, ciphertext = stolen[0]
    thief = Masker(VICTIM, substitute, {}, {}, 1, 64, session_context(federation, round, session))
    index, seed_share, key_share = thief.open_share(EncryptedShare(sender, VICTIM, ciphertext),
                                                    unb64(plain_keys_of(broker_capture.snapshot(), federation, sender,
                                                                        session)))
    assert index >= 1 and len(seed_share) == 16 and len(key_share) == 32

    # with it: every neighbour refuses the roster; nothing is sealed to the substitute, nothing is learnt
    broker_capture.clear()
    certified = certify(tmp_path / "keys", ids, plain)
    federation, rows = run_substituting(mosquitto.url, tmp_path / "certified", coordinator, certified, substitute,
                                        monkeypatch)
    assert sealed_to_victim(broker_capture.snapshot(), federation) == []
    trained = [r for r in rows if not r.final]
    assert trained and all(r.aborted and not r.participants for r in trained)
    for agent in ids:
        if agent == VICTIM:
            continue
        log = (tmp_path / "certified" / "agents" / f"{agent}.log").read_text()
        assert (f"the roster's keys of {VICTIM} are not certified by the federation's CA: the keys are not the ones "
                "its certified key signed") in log, log[-2000:]


def plain_keys_of(captured, federation: str, agent: str, session: str) -> str:
    """``agent``'s share public key (base64) of ``session``, as its keys step sent it."""
    for topic, payload in captured:
        if topic == agent_topic(federation, agent, "update"):
            message = decode(payload)
            if message.type == MessageType.SECAGG:
                meta = message.meta_as(SecAggMeta)
                if meta.session == session and meta.keys is not None:
                    return meta.keys.share_public
    raise AssertionError(f"no keys of {agent} in session {session}")

