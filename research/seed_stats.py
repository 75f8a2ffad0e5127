"""Statistics over seeds for the method benchmark: mean ± std, paired per-client
differences, and how often an ordering holds.

Pure functions over the result records that ``research/run_methods.py`` writes (one
JSON per setting, method and seed). Papers report one number per method; a table built
from these functions reports what the number is worth:

* ``mean ± std`` of the final accuracy over the seeds a method ran with (sample
  standard deviation, ``n - 1``; a single seed shows no spread);
* the **paired** difference to a reference method (FedRep, FedAvg): per seed, the mean
  over clients of (method − reference) on the same clients, then mean ± std over seeds,
  and on how many client-seed pairs the method was ahead — the same data and the same
  clients, so client difficulty cancels out;
* ``k/n``: in how many of the ``n`` seeds both ran the method's final accuracy is above
  the reference's.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    """Mean and sample standard deviation of ``n`` values (std is None for one value)."""

    mean: float
    std: float | None
    n: int

    def percent(self) -> str:
        """``"91.23 ± 0.45"`` (values are fractions; shown in percent)."""
        if self.std is None:
            return f"{100 * self.mean:.2f}"
        return f"{100 * self.mean:.2f} ± {100 * self.std:.2f}"


def spread(values: Iterable[float]) -> Spread | None:
    """Mean and sample std of ``values``; None when there are none."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return Spread(mean, None, 1)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return Spread(mean, math.sqrt(var), len(xs))


@dataclass(frozen=True)
class Paired:
    """``method`` minus ``reference`` on the same clients and seeds."""

    difference: Spread  # per-seed mean over clients of (method - reference), over seeds
    client_wins: int  # client-seed pairs where the method is strictly ahead
    client_pairs: int  # client-seed pairs compared
    seed_wins: int  # seeds where the method's final accuracy is strictly above the reference's
    seeds: int  # seeds both ran

    def cell(self) -> str:
        d = self.difference
        sign = "+" if d.mean >= 0 else "−"
        body = f"{sign}{abs(100 * d.mean):.2f}" + ("" if d.std is None else f" ± {100 * d.std:.2f}")
        return f"{body} ({self.client_wins}/{self.client_pairs} clients)"


def by_method_seed(records: Iterable[dict]) -> dict[str, dict[int, dict]]:
    """Records of one setting indexed as ``[method][seed]``."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in records:
        out[r["method"]][int(r["seed"])] = r
    return dict(out)


def final_spread(runs: dict[int, dict]) -> Spread | None:
    """The final accuracy of one method over its seeds."""
    return spread(r["final_accuracy"] for r in runs.values() if r.get("final_accuracy") is not None)


def paired(runs: dict[int, dict], reference: dict[int, dict]) -> Paired | None:
    """Compare one method's runs with a reference method's, seed by seed and client by client.

    Only seeds both ran count, and per seed only the clients both evaluated (a client
    whose accuracy is None in either run is left out of that seed)."""
    per_seed, wins, pairs, seed_wins = [], 0, 0, 0
    seeds = sorted(set(runs) & set(reference))
    for seed in seeds:
        mine, theirs = runs[seed]["final_per_client"], reference[seed]["final_per_client"]
        diffs = [mine[c] - theirs[c] for c in sorted(set(mine) & set(theirs))
                 if mine[c] is not None and theirs[c] is not None]
        if not diffs:
            continue
        per_seed.append(sum(diffs) / len(diffs))
        wins += sum(1 for d in diffs if d > 0)
        pairs += len(diffs)
        a, b = runs[seed].get("final_accuracy"), reference[seed].get("final_accuracy")
        seed_wins += int(a is not None and b is not None and a > b)
    difference = spread(per_seed)
    if difference is None:
        return None
    return Paired(difference, wins, pairs, seed_wins, len(per_seed))


def seed_table(records: Sequence[dict], order: Sequence[str], references: Sequence[str] = ("fedrep", "fedavg"),
               targets: Iterable[str] = ()) -> list[str]:
    """Markdown rows for one setting: final accuracy mean ± std over seeds, and per
    reference the paired difference and ``k/n`` seeds where the method is ahead."""
    table = by_method_seed(records)
    rank = {m: i for i, m in enumerate(order)}
    targets = set(targets)
    head = "| method | seeds | final acc. % (mean ± std) |"
    rule = "|---|---:|---:|"
    for ref in references:
        head += f" vs {ref}: paired Δ pts (clients ahead) | ahead of {ref} in k/n seeds |"
        rule += "---:|---:|"
    lines = [head, rule]
    for method in sorted(table, key=lambda m: (rank.get(m, len(rank)), m)):
        runs = table[method]
        final = final_spread(runs)
        label = method + (" (target)" if method in targets else "")
        row = f"| {label} | {','.join(str(s) for s in sorted(runs))} | {final.percent() if final else '—'} |"
        for ref in references:
            cmp = paired(runs, table[ref]) if ref in table and ref != method else None
            row += " — | — |" if cmp is None else f" {cmp.cell()} | {cmp.seed_wins}/{cmp.seeds} |"
        lines.append(row)
    return lines


def curve_band(runs: dict[int, dict]) -> tuple[list[int], list[float], list[float | None]]:
    """One method's accuracy curve over its seeds: evaluation index (0 is the initial model),
    mean and sample std per evaluation, up to the shortest curve and skipping evaluations
    where any seed has no accuracy; std is None for a single seed."""
    curves = [r["accuracy_curve"] for r in runs.values() if r.get("accuracy_curve")]
    xs: list[int] = []
    means: list[float] = []
    stds: list[float | None] = []
    for i in range(min((len(c) for c in curves), default=0)):
        column = [c[i] for c in curves]
        if any(v is None for v in column):
            continue
        s = spread(column)
        assert s is not None
        xs.append(i)
        means.append(s.mean)
        stds.append(s.std)
    return xs, means, stds
