"""Honest skewed fleets under the default aggregation settings: is any honest update clipped
or refused, and does any device end worse than in the same run with the bounds off?

The fleet is the one a bound relative to the fleet alone punished: digits, MLP with
BatchNorm (feature 32), 3 devices, 15 local epochs, SGD lr 0.05 momentum 0.5 wd 5e-4
batch 32, FedAvg, 6 rounds; its label split varies (Dirichlet 0.1 / 0.3 / 0.5, two classes
per device, or IID labels with each device's own image transform), synchronous rounds or
buffered ones (a state every 2 updates), seeds 0-2. Each run uses the defaults; a run in
which any bound fired (or anything was refused) is run again with every bound off
(``max_update_ratio``, ``max_update_vs_median``, ``max_mean_shift``,
``max_variance_growth``: null) and each device's final accuracy compared. A run in which
nothing fired needs no second run: an update no bound fires on is added as it came, so the
run is the bounds-off run bit for bit (tests/integration/rounds/test_honest_fleets.py).

    OMP_NUM_THREADS=1 python benchmarks/honest_fleets.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time

from edgepfl.config import load_run_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

AGENTS, ROUNDS = 3, 6
TRAINING = ["data.dataset=digits", "model.arch=mlp", "model.feature_dim=32", "train.epochs=15", "train.lr=0.05",
            "train.momentum=0.5", "train.weight_decay=0.0005", "train.batch_size=32", "data.samples_per_client=null"]
PARTITIONS = {
    "dirichlet0.1": ["data.partition.kind=dirichlet", "data.partition.alpha=0.1"],
    "dirichlet0.3": ["data.partition.kind=dirichlet", "data.partition.alpha=0.3"],
    "dirichlet0.5": ["data.partition.kind=dirichlet", "data.partition.alpha=0.5"],
    "pathological2": ["data.partition.kind=pathological", "data.partition.classes_per_client=2"],
    "domain": ["data.partition.kind=domain"],
}
MODES = {"sync": [], "buffered2": ["asynchrony.mode=buffered", "asynchrony.buffer_size=2"]}
BOUNDS_OFF = ["aggregation.max_update_ratio=null", "aggregation.max_update_vs_median=null",
              "aggregation.max_mean_shift=null", "aggregation.max_variance_growth=null"]


def run(sets: list[str]) -> tuple[list, float, float]:
    config = load_run_config("configs/fedavg.yaml", sets)
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        rows, _ = simulate(config, AGENTS, out, in_process=local_trainers, rounds=ROUNDS, progress=False)
    return rows, time.perf_counter() - t0, time.process_time() - c0


def one(partition: str, mode: str, seed: int, extra: list[str] = (), method: str = "fedavg") -> dict:
    """One fleet of ``method`` under the defaults (with ``extra`` settings on top: then the
    reference run is always made, without them and with the bounds off)."""
    sets = [*TRAINING, f"method.name={method}", *PARTITIONS[partition], *MODES[mode], f"seed={seed}",
            f"data.seed={seed}"]
    rows, wall, cpu = run([*sets, *extra])
    training = [r for r in rows if not r.final]
    final = next(r for r in rows if r.final)
    fired: dict[str, int] = {}
    for row in training:
        for bounds in row.clipped_by.values():
            for bound in bounds:
                fired[bound] = fired.get(bound, 0) + 1
    rejected = sum(n for row in training for n in row.rejected.values())
    updates = sum(len(row.participants) + len(row.late) for row in training)
    result = {"partition": partition, "mode": mode, "seed": seed, "method": method, "set": list(extra),
              "updates": updates,
              "clipped": sum(len(row.clipped) for row in training), "fired": fired, "rejected": rejected,
              "accuracy": final.per_client, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
    if fired or rejected or extra:  # otherwise the bounds-off run is this run
        off_rows, wall, cpu = run([*sets, *BOUNDS_OFF])
        off = next(r for r in off_rows if r.final).per_client
        result["accuracy_bounds_off"] = off
        result["worst_drop"] = max(off[a] - final.per_client.get(a, 0.0) for a in off)
        result["wall_s"] += round(wall, 1)
        result["cpu_s"] += round(cpu, 1)
    else:
        result["worst_drop"] = 0.0
    return result


def markdown(result: dict) -> str:
    lines = ["# Honest skewed fleets under the default bounds", "", f"`{result['command']}` on {result['machine']}", "",
             "digits MLP-BN, 3 devices, 15 local epochs, SGD lr 0.05 momentum 0.5, "
             f"{result.get('method', 'fedavg')}, 6 rounds (buffered: 6 states of 2 updates)"
             + (f", with {', '.join(result['set'])}" if result.get("set") else "") + ". `clipped`: honest updates a "
             "bound clipped or clamped, of `updates`; `worst drop`: the most any device's final accuracy fell "
             "against the same run with the bounds off"
             + (" and without those settings" if result.get("set") else " (0 when nothing fired: the runs are then "
                                                                         "identical)") + ".", "",
             "| labels | mode | seed | updates | clipped | bounds fired | refused | worst drop (points) | "
             "lowest device (%) | wall s | CPU s |",
             "|" + " --- |" * 11]
    for r in result["runs"]:
        fired = ", ".join(f"{k} x{v}" for k, v in sorted(r["fired"].items())) or "-"
        lines.append(f"| {r['partition']} | {r['mode']} | {r['seed']} | {r['updates']} | {r['clipped']} | {fired} | "
                     f"{r['rejected']} | {100 * r['worst_drop']:.1f} | {100 * min(r['accuracy'].values()):.1f} | "
                     f"{r['wall_s']} | {r['cpu_s']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--partitions", nargs="*", default=list(PARTITIONS), choices=list(PARTITIONS))
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    p.add_argument("--seeds", type=int, nargs="*", default=[0])
    p.add_argument("--out", default="benchmarks/results/honest_fleets")
    p.add_argument("--method", default="fedavg", help="the method every run uses (FedAvg: the fleet measured)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting on top of the fleet's (repeatable), e.g. aggregation.rule=median or "
                        "method.name=fedrep; each run is then compared with the same fleet without them, bounds off")
    args = p.parse_args(argv)
    runs = []
    total = len(args.partitions) * len(args.modes) * len(args.seeds)
    for partition in args.partitions:
        for mode in args.modes:
            for seed in args.seeds:
                runs.append(one(partition, mode, seed, args.set, args.method))
                r = runs[-1]
                print(f"[{len(runs)}/{total}] {partition} {mode} seed {seed}: clipped {r['clipped']}/{r['updates']} "
                      f"{r['fired'] or ''} refused {r['rejected']} worst drop {100 * r['worst_drop']:.1f} "
                      f"({r['wall_s']} s)", flush=True)
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["OMP_NUM_THREADS=1 python benchmarks/honest_fleets.py", *given]),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "method": args.method,
              "set": args.set, "runs": runs}
    write_results(result, args.out, markdown)
    return result


if __name__ == "__main__":
    main()
