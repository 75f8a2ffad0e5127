"""Secure rounds in the round loop (coordinator/drivers/secure.py; PROTOCOL.md §19): real
trainer tiers on the in-process fleet (digits, an MLP), the coordinator's real steps.

A secure run adopts the same state as the run in the clear, bit for bit, also when a third
of the round's agents die after sealing their shares; what reaches the coordinator from an
agent is only ever a masked vector; a round whose masks cannot be removed is aborted and
its state kept."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest

from edgepfl.aggregation import SecureMean
from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
from edgepfl.edge_agent.tiers import TrainerTier, local_trainers
from edgepfl.protocol import AgentChannel, Message, MessageType, TaskMeta, decode, encode
from edgepfl.protocol.secagg import MASKED_TENSOR, SecAggMeta, b64, unb64

pytest.importorskip("torch")

AGENTS = 6
#: the per-update bounds are the coordinator's in the clear and cannot apply to a masked update:
#: both runs go without them, so that the same updates make the same sum
NO_BOUNDS = {"max_update_ratio": None, "max_update_vs_median": None, "max_first_update_ratio": None,
             "max_mean_shift": None, "max_variance_growth": None}


def config(secure: bool, rounds: int = 2, privacy: dict | None = None, group_size: int | None = None,
           agents: int = AGENTS) -> RunConfig:
    return prepare(RunConfig(federation="sec", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                             train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits"}, rounds=rounds,
                             min_agents=agents, fraction=1.0, device="cpu", aggregation=NO_BOUNDS,
                             secure_aggregation={"enabled": secure, "group_size": group_size},
                             privacy=privacy or {}), agents)


@dataclass
class Device:
    """A trainer tier as its device runs it: it may die in the middle of a round (after its
    shares, before its update), and every frame it sends is kept for the test to read."""

    tier: TrainerTier
    dies_in_round: int | None = None
    sent: list[Message] = field(default_factory=list)

    def status(self):
        return self.tier.status()

    def handle(self, message: Message):
        if message.type == MessageType.TASK and message.header.round == self.dies_in_round \
                and message.meta_as(TaskMeta).kind == "train":
            return None  # powered off while training: nothing more comes from it this round
        reply = self.tier.handle(message)
        if reply is not None:
            self.sent.append(decode(reply.frame))
        return reply


def run(cfg: RunConfig, out, dying: dict[str, int] | None = None) -> tuple[Coordinator, list, dict[str, Device]]:
    ids = agent_ids(AGENTS)
    devices = {a: Device(tier, (dying or {}).get(a)) for a, tier in local_trainers(cfg, ids, out).items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), out, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    return coordinator, coordinator.run(), devices


def same_state(a: Coordinator, b: Coordinator) -> bool:
    x, y = a.server_state().global_tensors, b.server_state().global_tensors
    return set(x) == set(y) and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)


def test_a_secure_run_adopts_the_plaintext_runs_states_bit_for_bit(tmp_path):
    plain, plain_rows, _ = run(config(secure=False), tmp_path / "plain")
    secure, secure_rows, devices = run(config(secure=True), tmp_path / "secure")
    assert same_state(plain, secure)
    assert [r.accuracy for r in secure_rows] == [r.accuracy for r in plain_rows]
    assert all(not r.aborted and len(r.participants) == AGENTS for r in secure_rows if not r.final)
    for row in (r for r in secure_rows if not r.final):  # the row says what the steps did and cost
        s = row.secure
        assert s is not None and (s.key_holders, s.members, s.survivors, s.recovered) == (AGENTS,) * 3 + (0,)
        assert s.unmasked and s.neighbours == AGENTS - 1 and s.threshold == 3 and 0 < s.bytes_up < row.bytes_up
    assert all(r.secure is None for r in plain_rows)
    from edgepfl.coordinator.ops.report import write_report

    table, summary = write_report(tmp_path / "secure", "fedavg")
    assert summary["secure_aggregation"]["rounds"] == summary["secure_aggregation"]["unmasked"] == 2
    assert "secure aggregation: 2 rounds, the coordinator saw only their sums (2 unmasked" in table
    # every agent took part in each training round's four steps: keys, shares, masked update, reveal
    for device in devices.values():
        steps = [m.meta_as(SecAggMeta).step for m in device.sent if m.type == MessageType.SECAGG]
        assert steps == ["keys", "shares", "reveal"] * 2


def test_a_third_dying_after_sealing_their_shares_leaves_the_exact_sum_of_the_others(tmp_path, caplog):
    """Two of six die in round 1 after their keys and shares went out: their neighbours have
    masked with them, so the coordinator must have their mask keys reconstructed from the
    survivors' shares. The state is the one the clear run makes when the same two die."""
    ids = agent_ids(AGENTS)
    dying = {ids[1]: 1, ids[4]: 1}
    plain, plain_rows, _ = run(config(secure=False), tmp_path / "plain", dying)
    with caplog.at_level("INFO", logger="edgepfl.coordinator"):
        secure, secure_rows, devices = run(config(secure=True), tmp_path / "secure", dying)
    assert "round 1: secure sum of 4 updates unmasked (2 dropped agents' masks removed)" in caplog.text
    for rows in (plain_rows, secure_rows):
        round1 = next(r for r in rows if r.round == 1 and not r.final)
        assert not round1.aborted and sorted(round1.participants) == sorted(set(ids) - set(dying))
    secure_round1 = next(r for r in secure_rows if r.round == 1 and not r.final).secure
    assert secure_round1 is not None and (secure_round1.survivors, secure_round1.recovered) == (4, 2)
    assert same_state(plain, secure)
    dead = devices[ids[1]]
    assert [m.meta_as(SecAggMeta).step for m in dead.sent if m.header.round == 1] == ["keys", "shares"]


def test_the_coordinator_receives_only_masked_vectors(tmp_path):
    """What an agent sends in a secure round carries no shared tensor, and its one vector
    looks like noise: an unmasked contribution on the grid is a small integer (its top 16
    bits are a sign extension, 0x0000 or 0xffff), a masked one is uniform in the ring (that
    happens to 2 in 65,536 elements)."""
    _, _, devices = run(config(secure=True, rounds=1), tmp_path / "secure")
    updates = [m for d in devices.values() for m in d.sent if m.type == MessageType.UPDATE and m.meta.kind == "train"]
    assert len(updates) == AGENTS
    for update in updates:
        assert set(update.tensors) == {MASKED_TENSOR}
        top = update.tensors[MASKED_TENSOR].view("<u8") >> np.uint64(48)
        assert np.mean((top == 0) | (top == 0xFFFF)) < 0.01


def test_a_round_whose_masks_cannot_be_removed_is_aborted_and_the_state_kept(tmp_path, monkeypatch):
    """Survivors that reveal nothing leave every self mask on: the sum says nothing, the
    round is aborted with its reason and the state is the one before it."""
    from edgepfl.edge_agent import secure

    monkeypatch.setattr(secure.SecureSessions, "_unmask", lambda self, h, meta: (_ for _ in ()).throw(
        secure.SecAggError("this device keeps its shares")))
    coordinator, rows, _ = run(config(secure=True, rounds=1), tmp_path / "secure")
    trained = [r for r in rows if not r.final]
    assert [(r.aborted, r.abort_reason) for r in trained] == [(True, "secagg_failed")]
    assert trained[0].secure is not None and not trained[0].secure.unmasked
    fresh = Coordinator(config(secure=True, rounds=1), LocalFleet({}, "sec"), tmp_path / "fresh", progress=False,
                        **data_shape(config(secure=True)))
    fresh.init_or_resume()
    assert same_state(coordinator, fresh)  # the initial state, untouched


def test_a_secure_rounds_rule_takes_only_a_masked_vector_of_the_rounds_size():
    from edgepfl.aggregation import AggregationRejected

    rule = SecureMean()
    rule.begin({"w": np.zeros((2, 3), np.float32), "n": np.zeros((), np.int64)})
    with pytest.raises(AggregationRejected, match="alone"):
        rule.add({"w": np.zeros((2, 3), np.float32)}, 1)
    with pytest.raises(AggregationRejected, match=r"int64\[7\]"):
        rule.add({MASKED_TENSOR: np.zeros(6, np.int64)}, 1)
    with pytest.raises(AggregationRejected, match="secagg_failed|not unmasked"):
        rule.add({MASKED_TENSOR: np.zeros(7, np.int64)}, 1)
        rule.result()


def test_a_groups_sum_is_set_aside_only_when_one_of_its_updates_was_past_the_bound_of_the_clear_rounds():
    """Unmasked sums (no masks here: the ring's sum of grid contributions) held to what one
    update is held to in the clear. Every honest contribution, even each at its bound, makes a
    sum that is taken (the bounds are convex); one input scaled past ``max_update_ratio`` sets its
    group aside, and the other group still makes the round."""
    from edgepfl.aggregation import grid_contribution, ring_vector

    rng = np.random.default_rng(0)
    reference = {"w": rng.normal(size=(8, 8)).astype(np.float32), "n": np.zeros((), np.int64)}
    norm = float(np.linalg.norm(reference["w"]))
    rule = SecureMean(max_update_ratio=2.0)
    rule.begin(reference)
    rule.assign({"a": 0, "b": 0, "c": 0, "d": 1, "e": 1, "f": 1})

    def update(scale: float) -> dict:
        direction = rng.normal(size=(8, 8))
        change = direction / np.linalg.norm(direction) * scale * norm  # a change of scale x the norm
        return {"w": (reference["w"] + change).astype(np.float32), "n": np.zeros((), np.int64)}

    sent = {"a": update(2.0 * 0.999), "b": update(1.0), "c": update(2.0 * 0.999),  # honest, two at the bound
            "d": update(0.5), "e": update(20.0), "f": update(0.5)}  # e: ten times the bound
    for agent, params in sent.items():
        vector = ring_vector(grid_contribution(params, reference, 3), reference)
        rule.add_masked(agent, {MASKED_TENSOR: vector.view("<i8")}, 3)
    assert rule.take_group(0, rule.group_sums_[0]) is None
    why = rule.take_group(1, rule.group_sums_[1])
    assert why is not None and "max_update_ratio" in why
    kept = rule.result()["w"] - reference["w"]  # the first group's mean alone
    expected = np.mean([sent[a]["w"].astype(np.float64) - reference["w"] for a in "abc"], axis=0)
    assert np.allclose(kept, expected, atol=1e-5)


def test_a_group_that_cannot_be_unmasked_costs_its_updates_not_the_round(tmp_path):
    """Groups of three (two neighbours each, threshold two): one member dying after its shares
    leaves its two group mates with one surviving neighbour each, fewer than the threshold, so
    they reveal nothing and that group's masks stay on. The other group's sum makes the round,
    and the row counts only the updates in the sum: the lost group's two survivors are not
    participants (they would otherwise count towards the quorum a distributed-DP sum needs)."""
    ids = agent_ids(AGENTS)
    cfg = config(True, rounds=1, group_size=3)
    coordinator, rows, _ = run(cfg, tmp_path / "secure", dying={ids[1]: 0})
    row = next(r for r in rows if not r.final)
    assert not row.aborted and row.secure.unmasked
    assert (row.secure.groups, row.secure.not_unmasked, row.secure.set_aside) == (2, 1, 0)
    assert row.secure.survivors == 3 and len(row.participants) == 3
    assert ids[1] not in row.participants


def test_suspects_of_one_set_are_dealt_to_different_groups():
    from edgepfl.secagg import SecureAggregationSpec

    spec = SecureAggregationSpec(enabled=True, group_size=3)
    agents = [f"agent-{i:02d}" for i in range(12)]
    assert spec.groups(agents[:5], b"s") == [agents[:5]]  # fewer than two groups' worth: one group
    groups = spec.groups(agents, b"s", [{"agent-01", "agent-05", "agent-07"}, {"agent-09", "agent-11"}])
    assert len(groups) == 4 and sorted(a for g in groups for a in g) == agents
    assert all(len(g) == 3 for g in groups)
    for found in ({"agent-01", "agent-05", "agent-07"}, {"agent-09", "agent-11"}):
        assert all(len(found.intersection(g)) <= 1 for g in groups)
    assert SecureAggregationSpec(enabled=True).groups(agents, b"s") == [agents]


def test_distributed_dp_without_noise_is_central_dp_without_noise_bit_for_bit(tmp_path):
    """Each device clips its own change and counts once; the coordinator divides the unmasked
    sum by the devices sampled: the same clip, weights and mean as central DP's GaussianMean,
    so with the noise at zero both runs adopt the same states, and spend the same ε."""
    dp = {"clip_norm": 0.5, "noise_multiplier": 0.0}
    central, central_rows, _ = run(config(False, privacy={"mechanism": "central", **dp}), tmp_path / "central")
    spread, spread_rows, _ = run(config(True, privacy={"mechanism": "distributed", **dp}), tmp_path / "distributed")
    assert same_state(central, spread)
    records = [(r.privacy, s.privacy) for r, s in zip(central_rows, spread_rows, strict=True) if not r.final]
    assert all(c is not None and d is not None and d.mechanism == "distributed" and c.sampled == d.sampled == AGENTS
               for c, d in records)


def test_the_devices_noise_adds_up_to_the_runs_multiplier_on_the_quorum(tmp_path):
    """With quorum 0.5 of six devices, each adds noise of z C / sqrt(3): the six-device sum
    carries z C sqrt(2), the mean z C sqrt(2) / 6. Measured on one round's state against the
    same round without noise (same training, same clip)."""
    noisy, _, _ = run(config(True, rounds=1, privacy={"mechanism": "distributed", "clip_norm": 0.5,
                                                      "noise_multiplier": 1.0}), tmp_path / "noisy")
    quiet, _, _ = run(config(True, rounds=1, privacy={"mechanism": "distributed", "clip_norm": 0.5,
                                                      "noise_multiplier": 0.0}), tmp_path / "quiet")
    x, y = noisy.server_state().global_tensors, quiet.server_state().global_tensors
    diff = np.concatenate([(x[k].astype(np.float64) - y[k]).ravel() for k in x
                           if x[k].dtype.kind == "f" and "running_" not in k])
    assert diff.size > 2000
    assert np.std(diff) == pytest.approx(0.5 * np.sqrt(2) / AGENTS, rel=0.06)
    assert abs(np.mean(diff)) < 4 * np.std(diff) / np.sqrt(diff.size)


def test_secure_rounds_over_a_broker_need_signed_steps_and_enrolled_agents():
    """Over MQTT anyone could write a roster or keys in another's name: without the
    coordinator's signing key and an enrolled dir a secure run does not start."""
    from edgepfl.config import ConfigError
    from edgepfl.coordinator.drivers.secure import require_authenticated
    from edgepfl.coordinator.fleet import MqttFleet

    for signs, enrols in ((False, False), (True, False), (False, True)):
        with pytest.raises(ConfigError, match="security.signing_key and security.enrolled_dir"):
            require_authenticated(MqttFleet.__new__(MqttFleet), signs, enrols)
    require_authenticated(MqttFleet.__new__(MqttFleet), True, True)
    require_authenticated(LocalFleet({}, "sec"), False, False)  # in process: every frame is its own


def test_a_device_announcing_another_devices_public_keys_is_left_out_of_the_round(tmp_path):
    """Keys another agent announced too (an enrolled device replaying a neighbour's, to be
    sealed the same shares' keys): which one owns them cannot be told, so neither takes part
    in the round; it goes on with the others."""
    ids = agent_ids(AGENTS)
    devices: dict = {}

    class Copycat(Device):
        def handle(self, message):
            reply = super().handle(message)
            if reply is None or message.type != MessageType.SECAGG or message.meta_as(SecAggMeta).step != "advertise":
                return reply
            victim = next(m for m in devices[ids[0]].sent if m.type == MessageType.SECAGG
                          and m.meta_as(SecAggMeta).step == "keys" and m.header.round == message.header.round)
            stolen = victim.meta_as(SecAggMeta).keys.model_copy(update={"agent": self.tier.agent_id})
            frame = encode(MessageType.SECAGG, federation=message.header.federation, sender=self.tier.agent_id,
                           round=message.header.round, meta=SecAggMeta(session=victim.meta_as(SecAggMeta).session,
                                                                       step="keys", keys=stolen))
            return type(reply)(reply.channel, frame, reply.round)

    cfg = config(True, rounds=1)
    for agent_id, tier in local_trainers(cfg, ids, tmp_path / "secure").items():
        devices[agent_id] = (Copycat if agent_id == ids[5] else Device)(tier)
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path / "secure", progress=False,
                              **data_shape(cfg))
    coordinator.init_or_resume()
    row = next(r for r in coordinator.run() if not r.final)
    assert not row.aborted and sorted(row.participants) == ids[1:5] and {ids[0], ids[5]} <= set(row.dropped)
    assert row.secure is not None and (row.secure.key_holders, row.secure.members) == (4, 4)


class OldAgent(Device):
    """A trainer that announces an older protocol (``version``): 1.13 would seal both directions
    of an edge under one key; 1.16 would put a BatchNorm variance on the old grid."""

    version = "1.13"

    def status(self):
        return self.tier.status().model_copy(update={"version": self.version})


@pytest.mark.parametrize("version", ["1.13", "1.16"])
def test_a_secure_run_gives_no_task_to_an_agent_before_protocol_1_17(tmp_path, caplog, version):
    """Before 1.14 an agent sealed its shares to a neighbour under the key of the neighbour's
    shares to it, with the same zero nonce; before 1.17 it put a BatchNorm running variance on a
    grid of 64 x its largest (PROTOCOL.md §19.3), where the coordinator decodes 2**15 x: the secure
    round driver keeps such an agent out of the run's tasks (said once) — not sampled, not benched
    as silent — and the round goes on with the others."""
    ids = agent_ids(AGENTS + 1)
    cfg = prepare(config(True, rounds=1), AGENTS + 1).model_copy(update={"min_agents": AGENTS})
    devices = {a: (OldAgent if a == ids[0] else Device)(tier) for a, tier in local_trainers(cfg, ids, tmp_path).items()}
    devices[ids[0]].version = version
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        row = next(r for r in coordinator.run() if not r.final)
    assert not row.aborted and sorted(row.participants) == ids[1:]
    assert not devices[ids[0]].sent  # no step, no task: nothing to answer
    assert caplog.text.count(f"it speaks protocol {version}; secure aggregation needs 1.17") == 1


class StepRewriter(Device):
    """An enrolled device whose answer to one secure step (``step``: the step it answers) is its
    honest answer with :meth:`rewrite`'s changes, signed as its own would be."""

    step = ""

    def rewrite(self, answer: SecAggMeta) -> dict:
        raise NotImplementedError

    def handle(self, message):
        reply = self.tier.handle(message)
        if reply is None or message.type != MessageType.SECAGG or message.meta_as(SecAggMeta).step != self.step:
            if reply is not None:
                self.sent.append(decode(reply.frame))
            return reply
        answer = decode(reply.frame).meta_as(SecAggMeta)
        frame = encode(MessageType.SECAGG, federation=message.header.federation, sender=self.tier.agent_id,
                       round=message.header.round, meta=answer.model_copy(update=self.rewrite(answer)))
        self.sent.append(decode(frame))
        return type(reply)(reply.channel, frame, reply.round)


class GarbageSealer(StepRewriter):
    """An enrolled device that seals garbage to its neighbours: every shares step it sends
    carries ciphertexts of the right size that open for no one."""

    step = "roster"

    def rewrite(self, answer: SecAggMeta) -> dict:
        return {"shares": [s.model_copy(update={"ciphertext": b64(bytes(len(unb64(s.ciphertext))))})
                           for s in answer.shares]}


def test_a_device_whose_shares_do_not_open_costs_one_round_then_is_suspended_with_its_reason_in_the_view(tmp_path):
    """Its neighbours refuse their tasks as ``bad_shares`` naming it, before training: that
    round has too few updates. From the next round on it is in no roster (no step, no task),
    the rounds go on without it, and the fleet view says why and until when."""
    ids = agent_ids(AGENTS)
    cfg = config(True, rounds=4)
    devices = {a: (GarbageSealer if a == ids[2] else Device)(tier)
               for a, tier in local_trainers(cfg, ids, tmp_path / "secure").items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path / "secure", progress=False,
                              **data_shape(cfg))
    coordinator.init_or_resume()
    rows = [r for r in coordinator.run() if not r.final]
    honest = [a for a in ids if a != ids[2]]
    assert rows[0].refused == {"bad_shares": len(honest)}  # each of its neighbours said so, and trained for nothing
    for agent_id in honest:
        refusals = [m for m in devices[agent_id].sent if m.type == MessageType.REFUSAL]
        assert [(m.meta.reason, m.meta.peers) for m in refusals] == [("bad_shares", [ids[2]])]
        assert not any(m.type == MessageType.UPDATE and m.header.round == 0 for m in devices[agent_id].sent)
    for row in rows[1:]:
        assert not row.aborted and sorted(row.participants) == honest and not row.refused
    # in no roster and sent no task of a training round; the final evaluation asks it, like every device
    assert [(m.type.value, m.header.round) for m in devices[ids[2]].sent if m.header.round > 0] == [("update", 4)]
    why = coordinator.registry.suspended(ids[2], 3)
    assert why is not None and f"did not open for {len(honest)} of its neighbours (round 0)" in why
    shown = next(a for a in coordinator.observer.view().agents if a.id == ids[2])
    assert shown.suspended == why


def test_one_device_naming_an_honest_neighbour_suspends_no_one(tmp_path):
    """A refusal is a device's word: one liar of six naming the same neighbour every round
    never reaches the two accusers a suspension needs (a round's threshold here: three)."""
    ids = agent_ids(AGENTS)
    cfg = config(True, rounds=3)

    class Liar(Device):
        def handle(self, message):
            if message.type == MessageType.TASK and message.meta_as(TaskMeta).kind == "train" \
                    and message.meta_as(TaskMeta).secagg is not None:
                from edgepfl.protocol import encode_refusal

                frame = encode_refusal(message, sender=self.tier.agent_id, reason="bad_shares", detail="lies",
                                       peers=[ids[0]])
                return type(self.tier.handle(message))(AgentChannel.UPDATE, frame, message.header.round,
                                                       message.meta_as(TaskMeta).task_id, refusal=True)
            return super().handle(message)

    devices = {a: (Liar if a == ids[5] else Device)(tier)
               for a, tier in local_trainers(cfg, ids, tmp_path / "secure").items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path / "secure", progress=False,
                              **data_shape(cfg))
    coordinator.init_or_resume()
    rows = [r for r in coordinator.run() if not r.final]
    assert all(ids[0] in r.participants for r in rows) and all(r.refused == {"bad_shares": 1} for r in rows)
    assert coordinator.registry.suspended(ids[0], 1) is None


class LyingRevealer(StepRewriter):
    """An enrolled device that reveals, at unmasking, random bytes for every share it holds:
    the seeds it was asked to reveal would unmask the round to garbage."""

    step = "unmask"

    def rewrite(self, answer: SecAggMeta) -> dict:
        rng = np.random.default_rng(0)
        return {"seeds": [s.model_copy(update={"share": b64(rng.bytes(len(unb64(s.share))))}) for s in answer.seeds]}


def test_a_device_revealing_false_shares_is_outvoted_at_unmasking_and_then_suspended(tmp_path, caplog):
    """Six agents, each secret shared among its five neighbours with a threshold of three: a
    revealed share that is not on the polynomial the other four agree on is set aside and the
    secret taken from those, so the round is unmasked to the very sum of the clear run; the
    device whose revealed shares disagreed with as many neighbours as the threshold is
    suspended, with the reason in the view, and the next round goes on without it. (Before, its
    false shares went into the reconstruction and the round's masks could not be removed.)"""
    ids = agent_ids(AGENTS)
    liar = ids[0]  # its answer comes first: its shares would be among the three a secret is rebuilt from
    cfg = config(True, rounds=2)
    devices = {a: (LyingRevealer if a == liar else Device)(tier)
               for a, tier in local_trainers(cfg, ids, tmp_path / "secure").items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path / "secure", progress=False,
                              **data_shape(cfg))
    coordinator.init_or_resume()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = [r for r in coordinator.run() if not r.final]
    assert not rows[0].aborted and sorted(rows[0].participants) == ids and rows[0].secure.unmasked
    assert caplog.text.count(f"that {liar} revealed is not on the polynomial of the others'") == len(ids) - 1
    why = coordinator.registry.suspended(liar, 1)
    assert why is not None and "disagreed with those of" in why
    assert not rows[1].aborted and sorted(rows[1].participants) == [a for a in ids if a != liar]
    # round 0's sum is the clear run's: the same state after it, bit for bit
    clear, _, _ = run(config(False, rounds=1), tmp_path / "clear")
    first = Coordinator(cfg.model_copy(update={"rounds": 1}), LocalFleet(
        {a: (LyingRevealer if a == liar else Device)(tier)
         for a, tier in local_trainers(cfg, ids, tmp_path / "again").items()}, cfg.federation),
        tmp_path / "again", progress=False, **data_shape(cfg))
    first.init_or_resume()
    first.run()
    assert same_state(first, clear)


def test_with_the_federations_ca_a_device_whose_keys_are_not_certified_is_left_out_before_the_roster(tmp_path, caplog):
    """Every neighbour of a device whose keys no certified key signed would refuse the roster
    (edge_agent/secure.py): the coordinator, holding the same CA (``security.peer_ca``), leaves
    such a device out first, so one bad certificate costs the round that device, not the round."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding

    from edgepfl import pki
    from edgepfl.data import load_client_data
    from edgepfl.protocol.signing import Signer

    ids = agent_ids(AGENTS)
    ca, outsider_ca = pki.new_ca("edgepfl sec"), pki.new_ca("edgepfl sec")
    pki.write_certificate(tmp_path / "ca.crt", ca[1])
    cfg = config(True, rounds=1)
    cfg = cfg.model_copy(update={"security": cfg.security.model_copy(update={"peer_ca": str(tmp_path / "ca.crt")})})
    devices = {}
    for i, agent in enumerate(ids):
        signer = Signer.from_private(Ed25519PrivateKey.generate())
        cert = pki.issue_signing_certificate(*(outsider_ca if agent == ids[2] else ca), agent, signer.public)
        devices[agent] = Device(TrainerTier(agent, load_client_data(cfg.data, i), str(tmp_path / "agents" / agent),
                                            cfg.device, signer=signer, in_process=True, max_model_params=None,
                                            certificate=cert.public_bytes(Encoding.DER), peer_ca=ca[1]))
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path / "run", progress=False,
                              **data_shape(cfg))
    coordinator.init_or_resume()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        row = next(r for r in coordinator.run() if not r.final)
    assert sorted(row.sampled) == ids
    assert not row.aborted and sorted(row.participants) == [a for a in ids if a != ids[2]]
    assert f"{ids[2]}'s keys are not certified by the federation's CA (not issued by the federation's CA)" in caplog.text
    assert row.secure is not None and row.secure.key_holders == AGENTS - 1


class ScaledMasker(Device):
    """An enrolled device that sends its masked vector times 1,000 (modulo 2**64, as the ring
    adds): its masks no longer cancel, so whatever sum it is in is noise the size of the ring.
    ``rounds``: the rounds it does it in (None: every round)."""

    rounds: set[int] | None = None

    def handle(self, message):
        reply = self.tier.handle(message)
        if reply is None or message.type != MessageType.TASK or message.meta_as(TaskMeta).kind != "train" \
                or (self.rounds is not None and message.header.round not in self.rounds):
            return reply
        update = decode(reply.frame)
        vector = update.tensors[MASKED_TENSOR].view("<u8") * np.uint64(1000)
        frame = encode(MessageType.UPDATE, federation=message.header.federation, sender=self.tier.agent_id,
                       round=message.header.round, meta=update.meta, tensors={MASKED_TENSOR: vector.view("<i8")})
        self.sent.append(decode(frame))
        return type(reply)(reply.channel, frame, reply.round)


def scaled_run(tmp_path, group_size: int | None, rounds: int, attacker: str | None, agents: int = AGENTS,
               attacks: set[int] | None = None):
    ids = agent_ids(agents)
    cfg = config(True, rounds=rounds, group_size=group_size, agents=agents)
    devices = {a: (ScaledMasker if a == attacker else Device)(tier)
               for a, tier in local_trainers(cfg, ids, tmp_path).items()}
    if attacker is not None:
        devices[attacker].rounds = attacks
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    return coordinator, coordinator.run()


def test_a_device_scaling_its_masked_vector_costs_its_group_and_is_suspended_within_three_rounds(tmp_path, caplog):
    """``group_size: 3`` over six agents: two secure sums a round. The group with the device whose
    masked vector is scaled x1000 has a sum past the grid's range (an honest contribution is
    clamped into it, so an honest group's mean never is): that group is set aside and the other
    one makes the round. Its three members are suspects, dealt to different groups next round; a
    set narrowed to one agent is suspended: within k = 1 + ceil(log2 3) = 3 rounds here. From
    then on the rounds are whole again, and the run ends where the honest fleet's does.
    Without groups every round's one sum is past the bounds: each is aborted and no one is named."""
    ids = agent_ids(AGENTS)
    attacker = ids[3]
    ROUNDS = 10  # noqa: N806 (a constant of this test)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        coordinator, rows = scaled_run(tmp_path / "grouped", 3, ROUNDS, attacker)
    training = [r for r in rows if not r.final]
    why = coordinator.registry.suspended(attacker, len(training))
    assert why is not None and "the only one in common" in why
    suspended_in = int(re.search(r"in common \(round (\d+)\)", why).group(1))
    assert suspended_in <= 2  # k = 3 rounds: 0, 1, 2
    for row in training[:suspended_in + 1]:  # its group set aside, the other group's sum taken
        assert not row.aborted and row.secure.unmasked and (row.secure.groups, row.secure.set_aside) == (2, 1)
        assert attacker not in row.participants and len(row.participants) == row.secure.survivors == 3
    for row in training[suspended_in + 1:]:  # in no roster: five agents, one group, nothing set aside
        assert not row.aborted and attacker not in row.sampled + row.participants
        assert row.secure.set_aside == 0 and sorted(row.participants) == [a for a in ids if a != attacker]
    assert caplog.text.count("set aside (") == suspended_in + 1
    assert not any(coordinator.registry.suspended(a, ROUNDS) for a in ids if a != attacker)
    # the same fleet all honest, same rounds: the honest devices end within a few points of it
    _, honest_rows = scaled_run(tmp_path / "honest", 3, ROUNDS, None)
    assert all(r.secure.set_aside == 0 for r in honest_rows if not r.final)

    def honest_accuracy(row):
        return np.mean([row.per_client[a] for a in ids if a != attacker])

    assert rows[-1].final and honest_accuracy(rows[-1]) >= honest_accuracy(honest_rows[-1]) - 0.03
    # one group: the round's sum is past the bounds every round, so nothing is adopted and no one named
    caplog.clear()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        ungrouped, plain_rows = scaled_run(tmp_path / "ungrouped", None, 2, attacker)
    for row in (r for r in plain_rows if not r.final):
        assert row.aborted and row.abort_reason == "out_of_range" and row.secure.set_aside == 1
    assert caplog.text.count("past the range every update is clamped into") == 2 * 2  # the driver's line, the round's
    assert not any(ungrouped.registry.suspended(a, 2) for a in ids)


def test_by_default_a_sum_past_the_bounds_splits_the_next_rounds_until_its_sender_is_named(tmp_path):
    """``group_size`` unset (one secure sum a round) and twelve agents: the device scaling its
    masked vector costs round 0 whole (aborted ``out_of_range``); from round 1 on the rounds are
    split into groups of at least ``suspect_group_size`` (5: two groups of six), its group set
    aside each round, until it is the one device common to them: k = 1 + ceil(log2 12) = 5 rounds
    at most. Then the rounds are one group again, of the eleven."""
    ids = agent_ids(12)
    attacker = ids[7]
    coordinator, rows = scaled_run(tmp_path, None, 8, attacker, agents=12)
    training = [r for r in rows if not r.final]
    why = coordinator.registry.suspended(attacker, len(training))
    assert why is not None and "the only one in common" in why
    named_in = int(re.search(r"in common \(round (\d+)\)", why).group(1))
    assert 1 <= named_in <= 4
    assert training[0].aborted and training[0].abort_reason == "out_of_range" and training[0].secure.groups == 1
    for row in training[1:named_in + 1]:
        assert not row.aborted and (row.secure.groups, row.secure.set_aside) == (2, 1), row.secure
    for row in training[named_in + 1:]:
        assert not row.aborted and row.secure.groups == 1 and row.secure.set_aside == 0
        assert sorted(row.participants) == [a for a in ids if a != attacker]
    assert not any(coordinator.registry.suspended(a, len(training)) for a in ids if a != attacker)
    from edgepfl.coordinator.ops.report import write_report

    table, summary = write_report(tmp_path, "fedavg")  # what the operator reads after the run
    assert summary["secure_aggregation"]["set_aside"] == named_in + 1  # round 0's one sum too
    assert (f"secure groups: {named_in} rounds split into groups; {named_in + 1} group sums past the bounds set "
            "aside; 0 groups lost to dropouts") in table


def test_suspects_no_sum_narrowed_for_sixteen_rounds_are_forgotten_and_the_rounds_whole_again(tmp_path, caplog):
    """The device garbles round 0's sum only: the rounds after it are split (two groups of six),
    nothing is set aside, no one is named; sixteen rounds on the suspects are forgotten and
    round 17 is one secure sum again. Privacy is given up while tracing, not for good."""
    from edgepfl.coordinator.drivers.secure import SUSPECT_ROUNDS

    ids = agent_ids(12)
    with caplog.at_level("INFO", logger="edgepfl.coordinator"):
        coordinator, rows = scaled_run(tmp_path, None, SUSPECT_ROUNDS + 2, ids[7], agents=12, attacks={0})
    training = [r for r in rows if not r.final]
    assert training[0].abort_reason == "out_of_range"
    assert [r.secure.groups for r in training[1:]] == [2] * SUSPECT_ROUNDS + [1]
    assert all(not r.aborted and r.secure.set_aside == 0 for r in training[1:])
    assert not any(coordinator.registry.suspended(a, len(training)) for a in ids)
    assert f"round {SUSPECT_ROUNDS + 1}: 12 suspects of a sum past the bounds in round 0 forgotten" in caplog.text


def test_a_groups_set_aside_updates_do_not_count_towards_the_quorum(tmp_path):
    """``quorum: 1.0``: every sampled device's update must be in the sum. The scaled vector's group
    is set aside, so the other group's three updates are below the quorum and the round is
    aborted ``below_quorum`` (state kept): under distributed DP each device adds its share of the
    noise a quorum's sum needs, and a smaller sum would hold too little of it."""
    ids = agent_ids(AGENTS)
    cfg = config(True, rounds=1, group_size=3)
    cfg = cfg.model_copy(update={"quorum": 1.0})
    devices = {a: (ScaledMasker if a == ids[0] else Device)(tier)
               for a, tier in local_trainers(cfg, ids, tmp_path).items()}
    coordinator = Coordinator(cfg, LocalFleet(devices, cfg.federation), tmp_path, progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    before = {k: v.copy() for k, v in coordinator.server_state().global_tensors.items()}
    row = next(r for r in coordinator.run() if not r.final)
    assert row.aborted and row.abort_reason == "below_quorum" and row.secure.set_aside == 1
    assert len(row.participants) == 3 and ids[0] not in row.participants
    after = coordinator.server_state().global_tensors
    assert all(np.array_equal(before[k], after[k]) for k in before)
