"""Bytes and accuracy with compressed updates and task deltas: q8 and q4 against float32.

Per seed, per method, the same federation five times — ``compression.uplink`` none, q8
and q4, and q8 and q4 both ways (``compression.downlink`` too: task deltas) — interleaved
(seed by seed, the settings of one method back to back) so that load from other processes
hits them alike. ``edgepfl simulate --in-process`` on the virtual
clock: every device trains every round, the update bytes are those of the frames as they
would cross the broker (envelope, codec header and streams; ``metrics.jsonl``'s
``update_bytes``), and the accuracy is the run's final evaluation (every device, the last
state). Reported per method and codec, over seeds:

* **uplink ratio**: the run's training-update bytes over the uncompressed run's;
* **final accuracy**, and its paired difference from the uncompressed run of the same seed;
* **bytes to target**: the update bytes, and all bytes (tasks too), sent until the
  round-by-round accuracy first reaches ``--target`` × the uncompressed run's final
  accuracy (same seed), and rounds;
* **downlink per round**: the task bytes of a round after the first (the first goes whole
  to everyone), and their ratio to the uncompressed run's;
* **time to target**: the virtual seconds (the simulated devices' download, work and
  upload on their links) until then — ``--uplink-mbps`` / ``--downlink-mbps`` set every
  device's links (default: the simulator's 10 / 50 Mbit/s);
* CPU seconds and wall seconds of each run (this process's rusage).

Sized for a 2-core box: Fashion-MNIST, the default CNN (feature 64), ``--clients``
devices of ``--samples`` images (Dirichlet 0.5), ``--rounds`` rounds of one epoch; each
method with the options and learning rate of its ``configs/<method>.yaml``::

    .venv/bin/python benchmarks/compression_accuracy.py --methods fedavg fedrep dualfed --seeds 0 1 2
    .venv/bin/python benchmarks/compression_accuracy.py --methods fedavg --uplink-mbps 1 --downlink-mbps 2 \
        --settings none "q8 both ways" "q4 both ways" --out benchmarks/results/compression_slow_links

Writes ``benchmarks/results/compression_accuracy.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

#: setting -> (compression.uplink, compression.downlink)
SETTINGS = {"none": ("none", "none"), "q8": ("q8", "none"), "q4": ("q4", "none"),
            "q8 both ways": ("q8", "q8"), "q4 both ways": ("q4", "q4")}


def method_settings(method: str) -> tuple[dict, float]:
    """The method's options and learning rate from ``configs/<method>.yaml`` (its tuned
    Fashion-MNIST settings: DualFed's default con_lambda 40 with lr 0.05 overshoots the
    coordinator's change bound on every update), or none and 0.05."""
    import yaml

    path = ROOT / "configs" / f"{method}.yaml"
    if not path.is_file():
        return {}, 0.05
    config = yaml.safe_load(path.read_text())
    options = {k: v for k, v in config.get("method", {}).items() if k != "name"}
    return options, float(config.get("train", {}).get("lr", 0.05))


def run_config(method: str, setting: str, seed: int, ns: argparse.Namespace):
    from edgepfl.config import RunConfig, parse_config

    options, lr = method_settings(method)
    uplink, downlink = SETTINGS[setting]
    return parse_config(RunConfig, {
        "federation": f"cmp-{method}-{setting.replace(' ', '-')}-{seed}",
        "method": {"name": method, **options},
        "model": {"arch": "cnn", "feature_dim": 64},
        "train": {"epochs": 1, "batch_size": 32, "lr": lr, "momentum": 0.5},
        "data": {"dataset": ns.dataset, "samples_per_client": ns.samples, "num_clients": ns.clients,
                 "partition": {"kind": "dirichlet", "alpha": 0.5}, "seed": seed},
        "rounds": ns.rounds, "seed": seed, "device": "cpu", "quorum": 1.0,
        "compression": {"uplink": uplink, "downlink": downlink},
        "simulation": {"devices": [{k: v for k, v in (("uplink_mbps", ns.uplink_mbps),
                                                     ("downlink_mbps", ns.downlink_mbps)) if v is not None}]},
    }, "benchmark config")


def one_run(method: str, codec: str, seed: int, ns: argparse.Namespace, tmp: Path) -> dict:
    from edgepfl.coordinator.simulate import simulate
    from edgepfl.edge_agent.tiers import local_trainers

    config = run_config(method, codec, seed, ns)
    before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    rows, _ = simulate(config, ns.clients, tmp / f"{method}-{codec.replace(' ', '-')}-{seed}", in_process=local_trainers,
                       progress=False)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    training = [r for r in rows if not r.final]
    return {
        "method": method, "codec": codec, "seed": seed,
        "final_accuracy": rows[-1].accuracy,
        "accuracy_by_round": [r.accuracy for r in training],
        "update_bytes_by_round": [sum(r.update_bytes.values()) for r in training],
        "update_bytes_by_codec": {k: sum(r.update_bytes.get(k, 0) for r in training)
                                  for k in sorted({k for r in training for k in r.update_bytes})},
        "bytes_down_by_round": [r.bytes_down for r in training],
        "seconds_by_round": [r.seconds for r in training],
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
        "wall_s": round(wall, 2),
    }


def to_target(run: dict, target: float) -> tuple[int | None, int | None, int | None, float | None]:
    """(update bytes, all bytes, rounds, virtual seconds) until the round-by-round accuracy
    first reaches ``target``."""
    sent = total = 0
    elapsed = 0.0
    seconds = run.get("seconds_by_round") or [0.0] * len(run["accuracy_by_round"])
    rounds = zip(run["accuracy_by_round"], run["update_bytes_by_round"], run["bytes_down_by_round"], seconds,
                 strict=True)
    for i, (accuracy, spent, down, took) in enumerate(rounds):
        sent, total, elapsed = sent + spent, total + spent + down, elapsed + took
        if accuracy is not None and accuracy >= target:  # None: a row nobody evaluated in
            return sent, total, i + 1, elapsed
    return None, None, None, None


def summarize(runs: list[dict], target: float) -> list[dict]:
    plain = {(r["method"], r["seed"]): r for r in runs if r["codec"] == "none"}
    rows = []
    for method in dict.fromkeys(r["method"] for r in runs):
        for codec in SETTINGS:
            mine = [r for r in runs if r["method"] == method and r["codec"] == codec]
            if not mine:
                continue
            ratios, down_ratios, deltas, to_bytes, to_all, to_rounds, to_seconds = [], [], [], [], [], [], []
            for r in mine:
                base = plain[(method, r["seed"])]
                ratios.append(sum(r["update_bytes_by_round"]) / sum(base["update_bytes_by_round"]))
                down_ratios.append(sum(r["bytes_down_by_round"][1:]) / sum(base["bytes_down_by_round"][1:]))
                deltas.append(100 * (r["final_accuracy"] - base["final_accuracy"]))
                b, a, n, t = to_target(r, target * base["final_accuracy"])
                to_bytes.append(b)
                to_all.append(a)
                to_rounds.append(n)
                to_seconds.append(t)
            reached = [b for b in to_bytes if b is not None]
            reached_all = [a for a in to_all if a is not None]
            rows.append({
                "method": method, "codec": codec, "seeds": len(mine),
                "uplink_ratio": round(statistics.mean(ratios), 4), "uplink_ratio_max": round(max(ratios), 4),
                "final_accuracy": round(100 * statistics.mean(r["final_accuracy"] for r in mine), 2),
                "delta_points": round(statistics.mean(deltas), 2),
                "delta_points_worst": round(min(deltas), 2),
                "bytes_to_target": round(statistics.mean(reached)) if len(reached) == len(mine) else None,
                "all_bytes_to_target": round(statistics.mean(reached_all)) if len(reached_all) == len(mine) else None,
                "rounds_to_target": [n for n in to_rounds],
                "seconds_to_target": (round(statistics.mean(t for t in to_seconds if t is not None), 1)
                                      if all(t is not None for t in to_seconds) and "seconds_by_round" in mine[0]
                                      else None),
                "downlink_per_round": round(statistics.mean(statistics.mean(r["bytes_down_by_round"][1:])
                                                            for r in mine)),
                "downlink_ratio": round(statistics.mean(down_ratios), 4),
                "cpu_s": round(statistics.mean(r["cpu_s"] for r in mine), 1),
                "wall_s": round(statistics.mean(r["wall_s"] for r in mine), 1),
            })
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Compressed updates and task deltas: bytes and accuracy ({result['machine']})", "",
             f"`{result['command']}`", "",
             f"{result['setup']} Ratio: training-update bytes over the uncompressed run's (mean, max over "
             f"seeds). Δ: final accuracy minus the uncompressed run's, same seed (mean, worst). To target: update "
             f"bytes, and all bytes (tasks too), until the accuracy first reaches {result['target']} × the "
             "uncompressed run's final accuracy (mean over seeds; rounds per seed). Downlink: task bytes per round "
             "after the first (which goes whole), and their ratio to the uncompressed run's. \"both ways\": "
             "compression.uplink and compression.downlink (task deltas) with the codec.", "",
             "| method | setting | uplink ratio (max) | downlink B/round (ratio) | final acc % | Δ points (worst) | "
             "update bytes to target | all bytes to target | rounds | virtual s to target | CPU-s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        to_target_bytes = f"{r['bytes_to_target']:,}" if r["bytes_to_target"] is not None else "not reached"
        to_all = f"{r['all_bytes_to_target']:,}" if r["all_bytes_to_target"] is not None else "not reached"
        lines.append(f"| {r['method']} | {r['codec']} | {r['uplink_ratio']:.3f} ({r['uplink_ratio_max']:.3f}) | "
                     f"{r['downlink_per_round']:,} ({r['downlink_ratio']:.3f}) | "
                     f"{r['final_accuracy']:.2f} | {r['delta_points']:+.2f} ({r['delta_points_worst']:+.2f}) | "
                     f"{to_target_bytes} | {to_all} | {r['rounds_to_target']} | "
                     f"{r['seconds_to_target'] if r.get('seconds_to_target') is not None else '–'} | "
                     f"{r['cpu_s']} | {r['wall_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedrep", "dualfed"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS),
                        help="which settings to run (none is needed: the others are compared with it)")
    parser.add_argument("--uplink-mbps", type=float, help="every device's uplink (default: the simulator's)")
    parser.add_argument("--downlink-mbps", type=float, help="every device's downlink (default: the simulator's)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compression_accuracy"))
    ns = parser.parse_args()
    if "none" not in ns.settings:
        parser.error("--settings needs none: every other setting is compared with it")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = []
    with tempfile.TemporaryDirectory(prefix="edgepfl-compression-") as tmp:
        # not measured: the first run of a process pays the imports and torch's first steps
        one_run(ns.methods[0], "none", 0, argparse.Namespace(**{**vars(ns), "rounds": 1}), Path(tmp) / "warm-up")
        for seed in ns.seeds:
            for method in ns.methods:
                for codec in ns.settings:
                    print(f"seed {seed} {method} {codec}", file=sys.stderr, flush=True)
                    runs.append(one_run(method, codec, seed, ns, Path(tmp)))
                    # what is measured survives a failure of the summary: the raw runs, as they come
                    Path(ns.out).with_suffix(".runs.json").write_text(json.dumps(runs) + "\n")
    command = "benchmarks/compression_accuracy.py " + " ".join(sys.argv[1:])
    links = (f"links {ns.uplink_mbps or 10:g} Mbit/s up, {ns.downlink_mbps or 50:g} down, 50 ms; "
             "1 ms per training sample")
    setup = (f"{ns.dataset}, CNN (feature 64), {ns.clients} devices × {ns.samples} images (Dirichlet 0.5), "
             f"{ns.rounds} rounds of one epoch, every device every round, in-process on the virtual clock ({links}), "
             f"seeds {', '.join(map(str, ns.seeds))}.")
    write_results({"command": command.strip(), "setup": setup, "target": ns.target,
                   "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
                   "rows": summarize(runs, ns.target), "runs": runs}, ns.out, markdown)
    Path(ns.out).with_suffix(".runs.json").unlink(missing_ok=True)  # the runs are in the results now


if __name__ == "__main__":
    main()
