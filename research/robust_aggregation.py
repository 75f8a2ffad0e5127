"""Robust aggregation under attack: personalized accuracy of each aggregation rule
when 0, 1 or 2 of 8 agents send poisoned updates, on Fashion-MNIST, plus each rule's cost
on a clean run and its server-step time.

The attackers are real agents of the in-process fleet: a :class:`PoisonedTrainer` is a
:class:`~edgepfl.edge_agent.trainer.TrainerRuntime` that trains honestly and then
corrupts the shared tensors of its update before encoding it, so the poisoned frame goes
through the coordinator's gate, the update bound and the rule exactly like an MQTT
agent's would. Attacks, on the change ``d = x - g`` from the global parameters ``g``
the task carried (every floating-point shared tensor, BatchNorm statistics included):

* ``sign_flip``: ``g - d`` (the update pushed the other way);
* ``scale10``: ``g + 10 d``;
* ``gaussian``: ``g + N(0, std(d))`` per tensor (noise with the honest update's scale).

Rules (``aggregation:`` of the run config): ``mean`` (FedAvg), ``median``,
``trimmed_mean`` (trim 25 %: two of eight cut from each end), ``clipped_mean``,
``multi_krum`` (f = 2), each with the update bound off (``max_update_ratio: null``) to
see the rule alone; and ``mean`` with the update bound, clipping or rejecting. The
norm-based thresholds (``clip_ratio``, ``max_update_ratio``) are set from the clean run's
honest updates: ``--bound`` (default 2) times the largest change ratio an honest update
of the clean FedAvg run had, so that honest updates pass and a ×10 one does not.

    OMP_NUM_THREADS=1 python research/robust_aggregation.py --jobs 2
    python research/robust_aggregation.py --table          # table and plot from the JSONs

Writes ``research/results/robust_aggregation/<method>__<rule>__<attack>.json``, and
``research/results/robust_aggregation.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "research" / "results"
OUT_DIR = RESULTS / "robust_aggregation"
AGENTS = 8

ATTACKS = ["none", "sign_flip:1", "sign_flip:2", "scale10:1", "scale10:2", "gaussian:1", "gaussian:2"]
RULES = ["mean", "median", "trimmed_mean", "clipped_mean", "multi_krum", "mean+bound_clip", "mean+bound_reject"]


# ---------------------------------------------------------------------- the attacker
def poison(kind: str, sent: dict[str, np.ndarray], upload: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``upload`` with its shared floating-point tensors corrupted by attack ``kind``,
    relative to the global tensors ``sent`` with the task."""
    rng = np.random.default_rng(seed)
    out = dict(upload)
    for key, x in upload.items():
        g = sent.get(key)
        if g is None or x.dtype.kind != "f":
            continue
        d = x.astype(np.float64) - g.astype(np.float64)
        if kind == "sign_flip":
            bad = g - d
        elif kind == "scale10":
            bad = g + 10.0 * d
        elif kind == "gaussian":
            bad = g + rng.normal(0.0, float(d.std()) if d.size else 0.0, d.shape)
        else:
            raise ValueError(f"unknown attack {kind!r}")
        out[key] = bad.astype(x.dtype)
    return out


def poisoned_trainer(kind: str):
    """A TrainerRuntime class whose train answers carry ``kind``-poisoned shared tensors."""
    from edgepfl.edge_agent.trainer import TrainerRuntime

    class PoisonedTrainer(TrainerRuntime):
        def handle(self, task):
            meta, upload = super().handle(task)
            if meta.kind == "train":
                upload = poison(kind, task.tensors, upload, task.meta.seed)
            return meta, upload

    return PoisonedTrainer


# ---------------------------------------------------------------------- one run
def run_config(method: str, rule: str, rounds: int, ratios: dict, seed: int) -> dict:
    """``ratios``: the norm thresholds, from the clean run (``all``: clip_ratio; ``parameters``
    and ``statistics``: the update bound's two groups)."""
    name, _, bound = rule.partition("+")
    aggregation: dict = {"rule": name, "max_update_ratio": None, "max_mean_shift": None, "max_variance_growth": None,
                         "trim_fraction": 0.25, "krum_byzantine": 2,
                         "clip_ratio": ratios.get("all", 1.0), "max_change_ratio": None}
    if bound:
        # the statistics keep their default per-channel bounds (a norm ratio of them is no longer a setting)
        for field in ("max_mean_shift", "max_variance_growth"):
            del aggregation[field]
        aggregation.update(max_update_ratio=ratios["parameters"], on_large_update=bound.removeprefix("bound_"))
    method_block = {"name": method, **({"head_epochs": 4} if method == "fedrep" else {})}
    return {
        "federation": f"robust-{method}",
        "method": method_block,
        "model": {"arch": "cnn", "feature_dim": 128, "norm": "batch"},
        "train": {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "weight_decay": 5e-4, "batch_size": 50, "epochs": 1},
        "data": {"dataset": "fmnist", "num_clients": AGENTS, "samples_per_client": 400, "test_fraction": 0.25,
                 "seed": seed, "partition": {"kind": "dominant", "uniform_fraction": 0.2}},
        "rounds": rounds, "fraction": 1.0, "seed": seed, "device": "cpu", "round_timeout_s": 3600,
        "aggregation": aggregation,
    }


def run_one(method: str, rule: str, attack: str, rounds: int, ratio: dict, seed: int, runs_root: Path) -> dict:
    """One in-process federation with ``attack`` (``kind:count``; attackers are the first agents)."""
    import torch

    from edgepfl.config import RunConfig, parse_config
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.tiers import TrainerTier

    torch.set_num_threads(1)
    cfg = run_config(method, rule, rounds, ratio, seed)
    config = parse_config(RunConfig, cfg, f"robust {method}/{rule}/{attack}")
    kind, _, count = attack.partition(":")
    attackers = int(count or 0)
    out = runs_root / f"{method}__{rule}__{attack.replace(':', '-')}"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    ids = agent_ids(AGENTS)
    runtimes = {}
    for i, agent in enumerate(ids):
        data, state_dir = load_client_data(config.data, i), out / "agents" / agent
        tier = TrainerTier(agent, data, str(state_dir), "cpu")
        if i < attackers:  # the tier's answers (and refusals) come from the poisoned runtime
            tier.runtime = poisoned_trainer(kind)(agent, data, state_dir, "cpu")
        runtimes[agent] = tier
    coord = Coordinator(config, LocalFleet(runtimes, config.federation), out, progress=False, **data_shape(config))
    timing = {"cpu_s": 0.0, "rounds": 0}
    _time_server_step(coord, timing)
    changes: dict[str, list[float]] = {}
    if attack == "none":
        _record_change_ratios(coord, changes)
    t0 = time.monotonic()
    rows = coord.run()
    honest = [a for a in ids[attackers:]]
    final = rows[-1]
    # personalized accuracy of the honest agents only: what the attack costs them
    correct = total = 0
    for agent in honest:
        data = runtimes[agent].data
        acc = final.per_client.get(agent)
        if acc is not None:
            correct += acc * data.num_test
            total += data.num_test
    return {
        "method": method, "rule": rule, "attack": kind, "attackers": attackers, "rounds": rounds, "seed": seed,
        "agents": AGENTS, "ratio": ratio, "config": cfg,
        "honest_accuracy": correct / total if total else None,
        "accuracy_curve": [r.accuracy for r in rows if r.accuracy is not None],
        "rejected": {k: sum(r.rejected.get(k, 0) for r in rows) for k in sorted({k for r in rows for k in r.rejected})},
        "clipped": sum(len(r.clipped) for r in rows),
        "aborted_rounds": sum(r.aborted for r in rows),
        "server_step_cpu_s_per_round": timing["cpu_s"] / max(1, timing["rounds"]),
        "honest_change_ratio_max": {group: max(values) for group, values in changes.items()},
        "wall_seconds": round(time.monotonic() - t0, 1),
        "torch_threads": torch.get_num_threads(),
    }


def _time_server_step(coord, timing: dict) -> None:
    """Add the CPU time of every aggregate's add and close (the server step, spread over the round)."""
    method = coord.method
    open_round = method.open_round

    def timed_open_round(state, rule, *options):
        aggregate = open_round(state, rule, *options)
        add, close = aggregate.add, aggregate.close

        def timed_add(update):
            t = time.process_time()
            try:
                return add(update)
            finally:
                timing["cpu_s"] += time.process_time() - t

        def timed_close(round):
            t = time.process_time()
            try:
                return close(round)
            finally:
                timing["cpu_s"] += time.process_time() - t
                timing["rounds"] += 1

        aggregate.add, aggregate.close = timed_add, timed_close
        return aggregate

    method.open_round = timed_open_round


def _record_change_ratios(coord, changes: dict[str, list[float]]) -> None:
    """On the clean run: each honest update's change norm over the reference's norm, for the
    learned parameters, the BatchNorm statistics and all floats together, to set the norm
    thresholds of the attacked runs from."""
    method = coord.method
    open_round = method.open_round

    def probing_open_round(state, rule, *options):
        aggregate = open_round(state, rule, *options)
        add = aggregate.add
        ref = state.shared_params()
        floats = [k for k, v in ref.items() if v.dtype.kind == "f"]
        stats = [k for k in floats if k.endswith(("running_mean", "running_var"))]
        groups = {"all": floats, "statistics": stats, "parameters": [k for k in floats if k not in stats]}

        def probing_add(update):
            for group, keys in groups.items():
                if not keys:
                    continue
                norm = max(1.0, math.sqrt(sum(float(np.sum(ref[k].astype(np.float64) ** 2)) for k in keys)))
                change = math.sqrt(sum(float(np.sum((update.tensors[k].astype(np.float64) - ref[k]) ** 2))
                                       for k in keys))
                changes.setdefault(group, []).append(change / norm)
            return add(update)

        aggregate.add = probing_add
        return aggregate

    method.open_round = probing_open_round


# ---------------------------------------------------------------------- the grid
def result_path(method: str, rule: str, attack: str) -> Path:
    return OUT_DIR / f"{method}__{rule}__{attack.replace(':', '-')}.json"


def worker(args) -> int:
    method, rule, attack = args.one.split("/")
    record = run_one(method, rule, attack, args.rounds, json.loads(args.ratio), args.seed, Path(args.runs_root))
    record["command"] = (f"OMP_NUM_THREADS=1 python research/robust_aggregation.py --methods {method} "
                         f"--rounds {args.rounds} --seed {args.seed} --bound {args.bound}")
    path = result_path(method, rule, attack)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{method:7s} {rule:18s} {attack:12s} honest acc {record['honest_accuracy']:.4f} "
          f"rejected {record['rejected']} clipped {record['clipped']} ({record['wall_seconds']} s)", flush=True)
    return 0


def spawn(one: str, args, ratio: dict) -> None:
    method, rule, attack = one.split("/")
    if args.skip_done and result_path(method, rule, attack).exists():
        return
    cmd = [sys.executable, __file__, "--one", one, "--rounds", str(args.rounds), "--seed", str(args.seed),
           "--ratio", json.dumps(ratio), "--bound", str(args.bound), "--runs-root", args.runs_root]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="fedavg", help="comma list (fedavg, fedrep, fedper)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bound", type=float, default=2.0, help="norm thresholds = this x the clean run's largest "
                                                           "honest change ratio")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--runs-root", default=str(REPO / "runs" / "robust"))
    p.add_argument("--skip-done", action="store_true", help="keep runs whose result JSON exists")
    p.add_argument("--table", action="store_true", help="only write the table and plot from the JSONs")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ratio", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return worker(args)
    if not args.table:
        for method in args.methods.split(","):
            # the clean FedAvg-style run first: its honest updates set the norm thresholds
            spawn(f"{method}/mean/none", args, {})
            clean = json.loads(result_path(method, "mean", "none").read_text())
            ratio = {group: float(f"{args.bound * value:.3g}")
                     for group, value in clean["honest_change_ratio_max"].items()}
            print(f"{method}: largest honest change ratios {clean['honest_change_ratio_max']}; "
                  f"thresholds {ratio}", flush=True)
            queue = [f"{method}/{rule}/{attack}" for attack in args.attacks.split(",")
                     for rule in args.rules.split(",") if (rule, attack) != ("mean", "none")]
            with ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(spawn, queue, [args] * len(queue), [ratio] * len(queue)))
    write_summary()
    return 0


# ---------------------------------------------------------------------- table and plot
def load() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(OUT_DIR.glob("*.json"))]


def write_summary() -> None:
    from results_io import write_results

    records = load()
    write_results({"runs": records}, RESULTS / "robust_aggregation", markdown)
    plot(records, RESULTS / "robust_aggregation.png")


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}"


def markdown(result: dict) -> str:
    records = result["runs"]
    lines = []
    for method in sorted({r["method"] for r in records}):
        mine = {(r["rule"], r["attack"], r["attackers"]): r for r in records if r["method"] == method}
        attacks = [("none", 0)] + [(a.split(":")[0], int(a.split(":")[1])) for a in ATTACKS[1:]]
        ratio = next((r["ratio"] for r in mine.values() if isinstance(r["ratio"], dict) and r["ratio"]), {})
        rounds = next(iter(mine.values()))["rounds"]
        lines += [f"### {method}: honest agents' personalized accuracy (%) after {rounds} rounds, "
                  f"{AGENTS} agents, k attackers", "",
                  f"thresholds (2 x the clean run's largest honest change ratio): clip_ratio = {ratio.get('all')}, "
                  f"max_update_ratio = {ratio.get('parameters')} (statistics: the default per-channel bounds)",
                  "",
                  "| rule | clean | " + " | ".join(f"{a} ×{k}" for a, k in attacks[1:])
                  + " | server step (CPU ms/round) | rejected / clipped (all runs) |",
                  "|---|" + "---|" * (len(attacks) + 2)]
        for rule in RULES:
            cells = []
            rejected: dict[str, int] = {}
            clipped = 0
            for a, k in attacks:
                r = mine.get((rule, a, k))
                cells.append(_pct(r["honest_accuracy"]) if r else "—")
                if r:
                    for key, v in r["rejected"].items():
                        rejected[key] = rejected.get(key, 0) + v
                    clipped += r["clipped"]
            clean = mine.get((rule, "none", 0))
            step = f"{1000 * clean['server_step_cpu_s_per_round']:.1f}" if clean else "—"
            rej = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())) or "0"
            lines.append(f"| {rule} | " + " | ".join(cells) + f" | {step} | {rej} / {clipped} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in records})
    attacks = ["sign_flip", "scale10", "gaussian"]
    fig, axes = plt.subplots(len(methods), len(attacks), figsize=(4.2 * len(attacks), 3.4 * len(methods)),
                             squeeze=False, sharey=True)
    for row, method in enumerate(methods):
        mine = {(r["rule"], r["attack"], r["attackers"]): r for r in records if r["method"] == method}
        for col, attack in enumerate(attacks):
            ax = axes[row][col]
            for rule in RULES:
                ys = [mine.get((rule, "none", 0)), mine.get((rule, attack, 1)), mine.get((rule, attack, 2))]
                if any(y is None for y in ys):
                    continue
                ax.plot([0, 1, 2], [100 * y["honest_accuracy"] for y in ys], marker="o", label=rule)
            ax.set_title(f"{method}: {attack}")
            ax.set_xticks([0, 1, 2])
            ax.set_xlabel(f"attackers of {AGENTS}")
            if col == 0:
                ax.set_ylabel("honest agents' accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))  # results_io: the JSON + markdown writer the benchmarks share
    raise SystemExit(main())
