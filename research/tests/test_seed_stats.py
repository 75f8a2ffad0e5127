"""The benchmark's statistics over seeds (research/seed_stats.py) on synthetic records."""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "seed_stats.py"
_spec = importlib.util.spec_from_file_location("seed_stats", _PATH)
assert _spec and _spec.loader
seed_stats = importlib.util.module_from_spec(_spec)
sys.modules["seed_stats"] = seed_stats
_spec.loader.exec_module(seed_stats)


def record(method: str, seed: int, per_client: dict[str, float | None]) -> dict:
    scored = [v for v in per_client.values() if v is not None]
    return {"method": method, "seed": seed, "final_per_client": per_client,
            "final_accuracy": sum(scored) / len(scored)}


def test_spread_is_the_sample_mean_and_std():
    values = [0.91, 0.93, 0.86]
    s = seed_stats.spread(values)
    assert s.mean == pytest.approx(statistics.mean(values))
    assert s.std == pytest.approx(statistics.stdev(values))
    assert s.percent() == f"{100 * statistics.mean(values):.2f} ± {100 * statistics.stdev(values):.2f}"
    one = seed_stats.spread([0.5])
    assert one.std is None and one.percent() == "50.00"
    assert seed_stats.spread([]) is None


def test_paired_difference_is_per_client_and_per_seed():
    ref = {0: record("fedrep", 0, {"a": 0.8, "b": 0.6, "c": 0.9}),
           1: record("fedrep", 1, {"a": 0.7, "b": 0.7, "c": 0.7})}
    mine = {0: record("fedpac", 0, {"a": 0.9, "b": 0.5, "c": 0.95}),
            1: record("fedpac", 1, {"a": 0.8, "b": 0.8, "c": None}),  # c not evaluated: left out of seed 1
            2: record("fedpac", 2, {"a": 1.0, "b": 1.0, "c": 1.0})}  # the reference has no seed 2
    p = seed_stats.paired(mine, ref)
    seed0 = ((0.9 - 0.8) + (0.5 - 0.6) + (0.95 - 0.9)) / 3
    seed1 = ((0.8 - 0.7) + (0.8 - 0.7)) / 2
    assert p.difference.mean == pytest.approx((seed0 + seed1) / 2)
    assert p.difference.std == pytest.approx(statistics.stdev([seed0, seed1]))
    assert (p.client_wins, p.client_pairs) == (4, 5)  # a, c ahead in seed 0; a, b in seed 1
    assert (p.seed_wins, p.seeds) == (2, 2)


def test_seed_table_has_one_row_per_method_with_its_seeds():
    records = [record(m, s, {"a": base + 0.01 * s, "b": base - 0.01 * s})
               for m, base in (("fedavg", 0.7), ("fedrep", 0.8), ("fedpac", 0.85)) for s in (0, 1, 2)]
    lines = seed_stats.seed_table(records, ["fedavg", "fedrep", "fedpac"], targets=["fedpac"])
    assert len(lines) == 2 + 3
    fedpac = next(line for line in lines if line.startswith("| fedpac (target)"))
    cells = [c.strip() for c in fedpac.strip("|").split("|")]
    assert cells[1] == "0,1,2"
    assert cells[2].startswith("85.00")
    assert cells[3].startswith("+5.00") and "(0/6 clients)" not in cells[3]
    assert cells[4] == "3/3" and cells[6] == "3/3"
    fedrep = next(line for line in lines if line.startswith("| fedrep"))
    assert [c.strip() for c in fedrep.strip("|").split("|")][3] == "—"  # not compared with itself


def test_curve_band_is_the_per_round_mean_and_std_up_to_the_shortest_curve():
    runs = {0: {"accuracy_curve": [0.1, 0.5, 0.9, 0.95]},
            1: {"accuracy_curve": [0.1, None, 0.7, 0.85, 0.9]},
            2: {"accuracy_curve": [0.1, 0.6, 0.8, 0.9, 0.99]}}
    xs, mean, std = seed_stats.curve_band(runs)
    assert xs == [0, 2, 3]  # round 1 has a seed without an evaluation; seed 0 stops at 3
    assert mean == pytest.approx([0.1, 0.8, statistics.mean([0.95, 0.85, 0.9])])
    assert std[1] == pytest.approx(statistics.stdev([0.9, 0.7, 0.8]))
    one_xs, _, one_std = seed_stats.curve_band({0: runs[0]})
    assert one_xs == [0, 1, 2, 3] and one_std == [None] * 4
    assert seed_stats.curve_band({}) == ([], [], [])
