"""A straggler's late update in synchronous rounds, on the virtual
clock: one device of four takes ~9 simulated seconds per task against an 8 s deadline.

Chosen behaviour (``stragglers``): the round closes at its deadline without it and it
sits out the next round (PROTOCOL §10); its update, when it arrives, is folded into the round
then open — its change from the state it was trained on, discounted by
``(1 + staleness) ** -0.5``, applied to that round's state — if it is at most
``max_staleness`` rounds late (default 2), and rejected ``stale`` otherwise (or with
``max_staleness: 0``, as before).

The change rule alone: tests/unit/core/test_stragglers.py.
"""

from __future__ import annotations

from edgepfl.config import RunConfig
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.simulation import FleetTiming


def _config(max_staleness: int) -> RunConfig:
    return RunConfig.model_validate(dict(
        federation="stragglers", method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 16},
        train={"epochs": 1, "batch_size": 32}, data={"dataset": "digits", "num_clients": 4}, rounds=6, device="cpu",
        seed=5, round_timeout_s=8.0, stragglers={"max_staleness": max_staleness},
        simulation={"devices": [{"name": "fast", "share": 3}, {"name": "slow", "share": 1, "seconds_per_sample": 0.02}]}))


def _slow_agent(config: RunConfig) -> str:
    timing = FleetTiming(config.simulation, [f"agent-{i:02d}" for i in range(4)], config.seed)
    return next(a for a, d in timing.devices.items() if d.profile.name == "slow")


def test_a_late_update_is_folded_into_the_open_round_instead_of_thrown_away(tmp_path):
    config = _config(max_staleness=2)
    slow = _slow_agent(config)
    rows, _ = simulate(config, 4, tmp_path / "fold", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    dropped_in = [row.round for row in training if slow in row.dropped]
    folded_in = [row.round for row in training if slow in row.late]
    assert len(dropped_in) >= 2 and all(0 < f - d <= 2 for d, f in zip(dropped_in, folded_in))
    assert all(row.rejected == {} for row in training)
    # every dropped update came back and counted, but one whose window ran past the last
    # training round: the final evaluation takes no update, so that one is `stale`
    if len(folded_in) < len(dropped_in):
        assert len(folded_in) == len(dropped_in) - 1 and dropped_in[-1] + 2 >= len(training)
        assert rows[-1].final and rows[-1].rejected == {"stale": 1}
    assert all(slow not in row.participants for row in training)  # a late update is not an on-time answer


def test_without_late_updates_the_same_update_is_rejected_stale(tmp_path):
    config = _config(max_staleness=0)
    slow = _slow_agent(config)
    rows, _ = simulate(config, 4, tmp_path / "drop", in_process=local_trainers, progress=False)
    training = [row for row in rows if not row.final]
    dropped = sum(slow in row.dropped for row in training)
    assert dropped and all(row.late == [] for row in rows)
    assert sum(row.rejected.get("stale", 0) for row in rows) == dropped
