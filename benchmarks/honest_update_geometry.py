"""How far honest updates of non-IID fleets move the shared state, in the measures the
per-update bound may use (decided by measurement, not by a guess).

Runs small in-process federations of honest agents with no update bound at all and
records every update against its round's reference. Per fleet it reports the largest
honest value of each measure below, and which share of the honest updates and of the
attacks made from them the default aggregation settings refuse (``x10``: each honest
change scaled tenfold; ``x1e6``; ``flip``: the change reversed, which no per-update bound
can tell from an honest one). Measures:

* ``param_ratio`` — the learned parameters' change norm over ``max(1, ||reference||)``;
* ``stats_ratio`` — the same over BatchNorm's running statistics (the old bound's measure);
* ``mean_shift`` — per channel ``|mu' - mu| / sqrt(var + s2)``, ``s2`` the layer's median
  reference variance: a running mean's move in reference standard deviations (the
  default bound, ``max_mean_shift``: 20), the largest channel;
* ``var_growth`` — per channel ``var' / (var + s2)`` (``max_variance_growth``: 1000);
  ``var_shrink`` its inverse (not bounded); ``min_var`` the smallest variance sent.

Fleets are the issue's: digits MLP (BatchNorm, feature 32) on Dirichlet 0.5 with 15 local
epochs, a harsher one (2 classes per device, lr 0.05, momentum 0.9) and one whose local
training diverges (1 class per device, lr 0.1, momentum 0.9), FMNIST CNN
pathological with 2 classes per client, FMNIST CNN Dirichlet 0.1. Sized to run in
minutes on a 2-core CPU (few rounds, 400 samples per FMNIST client).

    python benchmarks/honest_update_geometry.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
from collections.abc import Mapping

import numpy as np

from edgepfl.aggregation import STATISTIC_LEAVES, AggregationRejected, AggregationSpec, Aggregator
from edgepfl.config import load_run_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

EPS = 1e-5  # BatchNorm's default eps

#: name -> (agents, rounds, --set overrides on configs/fedavg.yaml)
FLEETS: dict[str, tuple[int, int, list[str]]] = {
    "digits-mlp-dirichlet0.5": (3, 6, ["data.dataset=digits", "model.arch=mlp", "model.feature_dim=32",
                                       "data.partition.kind=dirichlet", "data.partition.alpha=0.5",
                                       "train.epochs=15", "data.samples_per_client=null"]),
    "digits-mlp-pathological2-fast": (3, 6, ["data.dataset=digits", "model.arch=mlp", "model.feature_dim=32",
                                             "data.partition.kind=pathological", "data.partition.classes_per_client=2",
                                             "train.epochs=15", "train.lr=0.05", "train.momentum=0.9",
                                             "data.samples_per_client=null"]),
    "digits-mlp-one-class-diverging": (3, 4, ["data.dataset=digits", "model.arch=mlp", "model.feature_dim=32",
                                              "data.partition.kind=pathological", "data.partition.classes_per_client=1",
                                              "train.epochs=15", "train.lr=0.1", "train.momentum=0.9",
                                              "data.samples_per_client=null"]),
    "fmnist-cnn-pathological2": (10, 4, ["data.dataset=fmnist", "data.partition.kind=pathological",
                                         "data.partition.classes_per_client=2", "train.epochs=2",
                                         "data.samples_per_client=400"]),
    "fmnist-cnn-dirichlet0.1": (10, 4, ["data.dataset=fmnist", "data.partition.kind=dirichlet",
                                        "data.partition.alpha=0.1", "train.epochs=2",
                                        "data.samples_per_client=400"]),
}
ATTACKS = {"x10": 10.0, "x1e6": 1e6, "flip": -1.0}


def _norm(arrays) -> float:
    return math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays))


def measures(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Every candidate measure of one update against its reference."""
    floats = [k for k, v in reference.items() if v.dtype.kind == "f"]
    stats = [k for k in floats if k.rpartition(".")[2] in STATISTIC_LEAVES]
    params = [k for k in floats if k not in stats]
    out = {
        "param_ratio": _norm(update[k] - reference[k].astype(np.float64) for k in params)
        / max(1.0, _norm(reference[k] for k in params)),
        "stats_ratio": _norm(update[k] - reference[k].astype(np.float64) for k in stats)
        / max(1.0, _norm(reference[k] for k in stats)) if stats else 0.0,
        "mean_shift": 0.0, "var_growth": 0.0, "var_shrink": 0.0, "min_var": math.inf,
    }
    for key in stats:
        if not key.endswith("running_mean"):
            continue
        layer = key[: -len("running_mean")]
        var = reference[layer + "running_var"].astype(np.float64)
        floor = max(float(np.median(var)), EPS)  # the layer's typical variance
        new_var = update[layer + "running_var"].astype(np.float64)
        shift = np.abs(update[key].astype(np.float64) - reference[key]) / np.sqrt(var + floor)
        out["mean_shift"] = max(out["mean_shift"], float(shift.max()))
        out["var_growth"] = max(out["var_growth"], float((new_var / (var + floor)).max()))
        out["var_shrink"] = max(out["var_shrink"], float(((var + floor) / np.maximum(new_var + floor, 1e-30)).max()))
        out["min_var"] = min(out["min_var"], float(new_var.min()))
    return out


def attacked(reference: Mapping[str, np.ndarray], update: Mapping[str, np.ndarray], factor: float) -> dict:
    return {k: (reference[k].astype(np.float64) + factor * (np.asarray(update[k], np.float64) - reference[k]))
            if reference[k].dtype.kind == "f" else update[k] for k in reference}


def refused_share(captured: list[tuple[dict, dict]], factor: float) -> float:
    """The share of the captured updates (their changes scaled by ``factor``) that the
    default aggregation settings refuse, whatever the reason."""
    refused = 0
    for reference, update in captured:
        rule = AggregationSpec().build()
        rule.begin(reference)
        sent = {k: v.astype(reference[k].dtype) for k, v in attacked(reference, update, factor).items()}
        try:
            rule.add(sent, 1)
        except AggregationRejected:
            refused += 1
    return refused / len(captured)


def run_fleet(name: str, seed: int) -> dict:
    agents, rounds, sets = FLEETS[name]
    config = load_run_config("configs/fedavg.yaml", [*sets, f"seed={seed}", f"data.seed={seed}",
                                                    "aggregation.max_update_ratio=null"])
    captured: list[tuple[dict, dict]] = []
    original = Aggregator.add

    def recording_add(self, params, weight=1, own=None):
        captured.append(({k: np.array(v) for k, v in self.reference_.items()}, {k: np.array(v) for k, v in params.items()}))
        return original(self, params, weight, own)

    Aggregator.add = recording_add  # type: ignore[method-assign]
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with tempfile.TemporaryDirectory() as out:
            simulate(config, agents, out, in_process=local_trainers, rounds=rounds, progress=False)
    finally:
        Aggregator.add = original  # type: ignore[method-assign]
    honest = [measures(ref, upd) for ref, upd in captured]
    result = {"agents": agents, "rounds": rounds, "updates": len(honest), "seed": seed,
              "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
              "honest_max": {m: (min if m == "min_var" else max)(h[m] for h in honest) for m in honest[0]},
              "refused": {"honest": refused_share(captured, 1.0),
                          **{attack: refused_share(captured, factor) for attack, factor in ATTACKS.items()}}}
    return result


def markdown(result: dict) -> str:
    names = ["param_ratio", "stats_ratio", "mean_shift", "var_growth", "var_shrink", "min_var"]
    kinds = ["honest", *ATTACKS]
    lines = ["# Honest update geometry", "", f"`{result['command']}` on {result['machine']}", "",
             "Largest honest value of each measure (`min_var`: the smallest), and the share of updates the default "
             "aggregation settings refuse: honest ones as sent, and each attack made from them.", "",
             "| fleet | seed | updates | " + " | ".join(names) + " | " + " | ".join(f"refused {k}" for k in kinds) + " |",
             "|" + " --- |" * (3 + len(names) + len(kinds))]
    for row in result["fleets"]:
        lines.append(f"| {row['fleet']} | {row['seed']} | {row['updates']} | "
                     + " | ".join(f"{row['honest_max'][m]:.3g}" for m in names) + " | "
                     + " | ".join(f"{row['refused'][k]:.0%}" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleets", nargs="*", default=list(FLEETS))
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--out", default="benchmarks/results/honest_update_geometry")
    args = p.parse_args(argv)
    rows = []
    for name in args.fleets:
        for seed in args.seeds:
            rows.append({"fleet": name, **run_fleet(name, seed)})
            print(name, seed, rows[-1]["honest_max"], flush=True)
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["python benchmarks/honest_update_geometry.py", *given]),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "fleets": rows}
    write_results(result, args.out, markdown)
    return result


if __name__ == "__main__":
    main()
