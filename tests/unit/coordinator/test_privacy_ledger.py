"""Differential privacy in the round loop (coordinator/privacy.py): every trained round's ε in
its metrics row, training stopped before the budget is passed, the spend remembered by a
resumed coordinator, and the report saying it; real trainer tiers on the in-process fleet
(digits, an MLP)."""

from __future__ import annotations

import math

import pytest

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.ops.report import write_report
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.privacy import PrivacyAccountant

pytest.importorskip("torch")
pytest.importorskip("dp_accounting")

AGENTS = 4


def config(rounds: int, budget: float | None = None, fraction: float = 0.5) -> RunConfig:
    return prepare(RunConfig(federation="private", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                             train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits"}, rounds=rounds,
                             min_agents=AGENTS, fraction=fraction, device="cpu",
                             privacy={"mechanism": "central", "clip_norm": 1.0, "noise_multiplier": 1.0,
                                      "epsilon_budget": budget}), AGENTS)


def run(cfg: RunConfig, out) -> list:
    coordinator = Coordinator(cfg, LocalFleet(local_trainers(cfg, agent_ids(AGENTS), out), cfg.federation), out,
                              progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    return coordinator.run()


def test_each_trained_round_carries_the_runs_epsilon_and_the_budget_stops_training(tmp_path):
    spec = config(1).privacy
    # the budget lets three rounds of 2 of 4 devices through, not four
    three = PrivacyAccountant(spec, [(AGENTS, 2)] * 3).epsilon()
    rows = run(config(rounds=8, budget=three + 1e-9), tmp_path / "run")
    trained = [r for r in rows if not r.final]
    assert len(trained) == 3 and rows[-1].final  # stopped before the fourth; the final evaluation ran
    records = [r.privacy for r in trained]
    assert all(p is not None and p.population == AGENTS and p.sampled == 2 == len(r.sampled)
               for p, r in zip(records, trained, strict=True))
    assert [p.epsilon for p in records] == pytest.approx([PrivacyAccountant(spec, [(AGENTS, 2)] * k).epsilon()
                                                          for k in (1, 2, 3)])
    assert rows[-1].privacy is None  # an evaluation spends nothing
    table, summary = write_report(tmp_path / "run", "fedavg")
    assert summary["privacy"]["epsilon"] == pytest.approx(three) and summary["privacy"]["rounds"] == 3
    assert f"ε = {three:.3f} at δ = 1e-05 after 3 rounds" in table


def test_a_resumed_coordinator_counts_the_rounds_spent_before_it(tmp_path):
    out = tmp_path / "run"
    run(config(rounds=2), out)
    rows = run(config(rounds=4), out)  # resumes after round 1: rounds 2 and 3
    trained = [r for r in rows if not r.final]
    assert [r.round for r in trained] == [2, 3]
    spec = config(1).privacy
    assert trained[-1].privacy is not None
    assert trained[-1].privacy.epsilon == pytest.approx(PrivacyAccountant(spec, [(AGENTS, 2)] * 4).epsilon())


def test_an_adaptive_clip_follows_the_changes_round_by_round_within_the_same_epsilon(tmp_path):
    """Started far above every device's change (and without noise, so the count is exact:
    every change within, the clip is multiplied by exp(-rate (1 - target)) each round), the
    clip shrinks round by round, each row says the clip it used and the one it set, a
    resumed coordinator takes the last row's, and ε is the fixed clip's."""

    def adaptive(rounds: int, noise: float = 0.0) -> RunConfig:
        cfg = config(rounds).model_dump()
        cfg["privacy"].update(clip_norm=1e4, noise_multiplier=noise,
                              adaptive_clipping={"target_quantile": 0.5, "learning_rate": 1.0})
        return RunConfig.model_validate(cfg)

    out = tmp_path / "run"
    cfg = adaptive(3)
    rows = [r for r in run(cfg, out) if not r.final]
    records = [r.privacy for r in rows]
    assert all(p is not None and p.next_clip_norm is not None for p in records)
    clips = [p.clip_norm for p in records]
    assert clips == pytest.approx([1e4, 1e4 * math.exp(-0.5), 1e4 * math.exp(-1.0)])
    assert [p.next_clip_norm for p in records[:-1]] == clips[1:]
    assert all(p.epsilon is None for p in records)  # no noise, no finite ε: null in the rows, read back
    assert "ε = unbounded (no noise)" in write_report(out, "fedavg")[0]
    resumed = [r for r in run(adaptive(4), out) if not r.final]
    assert [r.round for r in resumed] == [3] and resumed[0].privacy.clip_norm == records[-1].next_clip_norm
    noisy = RunConfig.model_validate({**adaptive(3, noise=1.0).model_dump()})
    assert [p.epsilon for p in (r.privacy for r in run(noisy, tmp_path / "noisy") if not r.final)] == pytest.approx(
        [PrivacyAccountant(noisy.privacy, [(AGENTS, 2)] * k).epsilon() for k in (1, 2, 3)])


@pytest.mark.parametrize(("security", "mode", "sampled", "chosen"), [
    ({}, "sync", 4, "Mean"),                                 # unsigned: anyone may send as any device
    ({"enrolled_dir": "enrolled"}, "sync", 4, "CenteredClip"),  # enrolled: one device, one vote
    ({"enrolled_dir": "enrolled"}, "sync", 2, "Mean"),       # nothing to vote with two
    ({"enrolled_dir": "enrolled"}, "sync", 100, "Mean"),     # past AUTO_ROBUST_MAX_UPDATES
    ({"enrolled_dir": "enrolled"}, "buffered", 100, "CenteredClip"),  # a buffered state holds buffer_size updates
])
def test_the_ledger_opens_each_round_with_the_rule_auto_chooses_for_the_fleet_and_logs_it(
        tmp_path, caplog, security, mode, sampled, chosen):
    """``aggregation.rule: auto`` in the round loop: what decides is the coordinator's own
    config (``security.enrolled_dir``) and how many updates a round aggregates (a buffered
    state: ``asynchrony.buffer_size``); the choice is logged once, when it changes."""
    from edgepfl.coordinator.privacy import PrivacyLedger

    cfg = RunConfig(federation="auto", security={k: str(tmp_path / v) for k, v in security.items()},
                    asynchrony={"mode": mode, "buffer_size": 10})
    ledger = PrivacyLedger(cfg, tmp_path)
    sampled_ids = [f"d{i}" for i in range(sampled)]
    with caplog.at_level("INFO", logger="edgepfl"):
        rules = [ledger.open(r, sampled_ids, sampled)[0] for r in range(3)]
    assert {type(rule).__name__ for rule in rules} == {chosen}
    said = [m for m in caplog.messages if "aggregation.rule auto" in m]
    assert len(said) == 1 and chosen in said[0] and ("an enrolled" in said[0]) == bool(security)


def test_a_poisson_sampled_runs_rounds_carry_the_accountants_epsilon_and_divide_by_the_expected_count(tmp_path):
    """privacy.sampling poisson: the rounds' sizes vary, each row's ε is the add-or-remove
    accountant's for that many Poisson rounds at the run's rate, and a round's noised mean
    divides by rate x population (a count fixed before the draw), never by who was drawn."""
    import dp_accounting
    from dp_accounting import rdp

    n, rate = 12, 0.5
    cfg = prepare(RunConfig(federation="poisson", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
                            train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "samples_per_client": 60},
                            rounds=6, min_agents=n, fraction=rate, device="cpu",
                            privacy={"mechanism": "central", "clip_norm": 1.0, "noise_multiplier": 1.0,
                                     "sampling": "poisson"}), n)
    out = tmp_path / "run"
    coordinator = Coordinator(cfg, LocalFleet(local_trainers(cfg, agent_ids(n), out), cfg.federation), out,
                              progress=False, **data_shape(cfg))
    coordinator.init_or_resume()
    denominators: list[float] = []
    opened = coordinator.privacy.open

    def watch(round, sampled, population):
        rule, record = opened(round, sampled, population)
        denominators.append(rule.denominator)
        return rule, record

    coordinator.privacy.open = watch
    trained = [r for r in coordinator.run() if not r.final]
    sizes = [len(r.sampled) for r in trained]
    assert len(set(sizes)) > 1  # each device drawn on its own: the rounds' sizes vary
    assert denominators == [rate * n] * len([s for s in sizes if s])
    for k, row in enumerate(trained, 1):
        direct = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        direct.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(1.0)), k)
        assert row.privacy is not None and row.privacy.sampling_rate == rate and row.privacy.sampled == sizes[k - 1]
        assert row.privacy.epsilon == pytest.approx(direct.get_epsilon(1e-5))


def test_a_round_its_noise_alone_moves_past_the_guard_says_so_with_the_noise_it_added(tmp_path, caplog):
    """A fleet too small for its noise: the round guard (``max_change_ratio``) refuses every
    aggregate, and the warning says how far the noise alone moves the mean, which is the move
    measured (within a tenth: the changes themselves are clipped to 1), so that the operator
    reads "too few devices for this budget" rather than a model that diverged."""
    import re

    cfg = config(rounds=1, fraction=1.0)
    cfg = cfg.model_copy(update={"privacy": cfg.privacy.model_copy(update={"noise_multiplier": 400.0})})
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = run(cfg, tmp_path / "run")
    assert rows[0].aborted and rows[0].abort_reason == "diverged"
    said = re.search(r"moves the shared parameters by ([\d.e+]+),.*noise alone moves the mean by about ([\d.e+]+) "
                     r"\(4 devices, ([\d,]+) values\): too few devices a round for this budget", caplog.text)
    assert said is not None, caplog.text
    measured, estimated = float(said.group(1)), float(said.group(2))
    assert estimated == pytest.approx(measured, rel=0.1)
