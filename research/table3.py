"""RepPer's Table 3 at the paper's shape, over seeds: IoT clients that only fit heads.

RepPer (paper 003, §6.4, Table 3) trains a global encoder with FedAvg, LG-FedAvg, FedRep and
RepPer, then lets clients too weak to train fit an SVM, an LR or an MLP head on it. Here:
``--trainers`` clients (the paper's 20) train with a fraction ``--fraction`` per round (the
paper's C = 0.2) on Dirichlet(``--alpha``) Fashion-MNIST; ``--new`` IoT clients of the same
partition never train and fit each head on the exported ONNX encoder offline, exactly as a
torch-free device does (``edgepfl fit-head``). Each seed is one run of
``research/heads_new_clients.py`` (the data partition, the initial model and the client
sampling all follow the seed); this script runs them and reports, per head kind:

* the mean new-client accuracy over seeds (mean ± std),
* the paired difference to the FedAvg encoder (per seed, mean over the same new clients of
  method − FedAvg; mean ± std over seeds; new clients ahead), and in how many seeds the
  method's mean is above FedAvg's (``research/seed_stats.py``).

Usage (what research/RESULTS.md records)::

    .venv/bin/python research/table3.py --seeds 0,1,2 --rounds 30 --epochs 2 --jobs 2

Writes ``research/results/table3/seed<k>.json|md`` per seed and ``table3.json|md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "research"))
RESULTS = ROOT / "research" / "results" / "table3"

from seed_stats import seed_table  # noqa: E402

METHODS = ["fedavg", "lgfedavg", "fedrep", "repper"]
HEADS = ["svm", "lr", "mlp"]
PAPER = {"fedavg": (72.64, 68.66, 68.79), "lgfedavg": (74.64, 59.82, 60.05), "fedrep": (73.03, 70.71, 71.14),
         "repper": (86.22, 82.67, 83.78)}  # Table 3, (MLP, SVM, LR), CIFAR-10


def records(per_seed: dict[int, dict]) -> dict[str, list[dict]]:
    """seed_stats records per head kind: one per (method, seed), its new clients' accuracies."""
    out: dict[str, list[dict]] = {k: [] for k in HEADS}
    for seed, result in per_seed.items():
        for entry in result["table"]:
            for kind in HEADS:
                head = entry["heads"].get(kind)
                if head is not None:
                    out[kind].append({"method": entry["method"], "seed": seed, "final_accuracy": head["mean"],
                                      "final_per_client": head["per_client"]})
    return out


def markdown(command: str, args: argparse.Namespace, per_seed: dict[int, dict], wall: float) -> str:
    recs = records(per_seed)
    lines = [
        "# RepPer Table 3 at the paper's shape: heads of IoT clients that never train",
        "",
        f"Command: `{command}`  ",
        f"Fashion-MNIST, small CNN, Dirichlet alpha {args.alpha} over {args.trainers + args.new} clients of "
        f"{args.samples_per_client} samples (75 % train / 25 % test); clients 0-{args.trainers - 1} train "
        f"({args.fraction:g} of them per round, {args.rounds} rounds, {args.epochs} local epochs, lr {args.lr}, "
        f"method defaults otherwise); the other {args.new} fit each head on the exported ONNX encoder offline "
        f"and are scored on their own test split. Seeds {','.join(str(s) for s in per_seed)}; "
        f"wall time {wall:.0f} s on a shared 2-core machine.",
        "",
        "Paper (CIFAR-10, ResNet, 100 rounds, 10 epochs), MLP / SVM / LR: "
        + "; ".join(f"{m} {a:.2f} / {b:.2f} / {c:.2f}" for m, (a, b, c) in PAPER.items()) + ".",
    ]
    for kind in HEADS:
        lines += ["", f"## {kind.upper()} head", ""]
        lines += seed_table(recs[kind], [*METHODS, "init"], references=("fedavg",))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--trainers", type=int, default=20)
    p.add_argument("--new", type=int, default=10)
    p.add_argument("--fraction", type=float, default=0.2)
    p.add_argument("--samples-per-client", type=int, default=800)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--work", default="/tmp/edgepfl-table3")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--collect-only", action="store_true", help="only aggregate the per-seed results in --out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    flags = ["--methods", args.methods, "--rounds", str(args.rounds), "--epochs", str(args.epochs), "--lr", str(args.lr),
             "--trainers", str(args.trainers), "--new", str(args.new), "--fraction", str(args.fraction),
             "--samples-per-client", str(args.samples_per_client), "--alpha", str(args.alpha), "--jobs", str(args.jobs)]
    start = time.perf_counter()
    for seed in seeds:
        if args.collect_only:
            break
        print(f"seed {seed}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "research" / "heads_new_clients.py"), *flags, "--seed", str(seed),
                        "--work", f"{args.work}/seed{seed}", "--out", str(out / f"seed{seed}")], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    per_seed = {s: json.loads((out / f"seed{s}.json").read_text()) for s in seeds if (out / f"seed{s}.json").is_file()}
    wall = sum(r["wall_seconds"] for r in per_seed.values()) if args.collect_only else time.perf_counter() - start
    command = "python research/table3.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                                          if k not in ("work", "out", "collect_only"))
    text = markdown(command, args, per_seed, wall)
    (out / "table3.md").write_text(text)
    (out / "table3.json").write_text(json.dumps({"command": command, "seeds": list(per_seed), "wall_seconds": wall,
                                                  "records": records(per_seed)}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
