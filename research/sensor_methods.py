"""FedAvg against the personalized methods on a sensor fleet: real BasicMotions windows, each
device with its own activity mix and its own sensor gain, over several seeds.

The setting of examples/sensors: BasicMotions (a smartwatch's accelerometer + gyroscope, 6
channels x 100 samples, 4 activities; the 80 windows of both splits as one pool, read from the
sensors extra's sktime wheel) over ``--devices`` devices, Dirichlet(``--alpha``) label skew
and ``shift: [gain]`` (every device its own per-channel gain and offset). The encoder is the
example's own model (``examples/sensors/my_model.py``, ``model.arch: my_model:build``). Each
(method, seed) is one federation with the in-process simulator (the coordinator's round loop
and the trainer runtime of ``edgepfl simulate --in-process``); the seed moves the partition,
the gains, the initialization and the training. The number is the final personalized
accuracy: each device's held-out windows (``test_fraction`` 0.25) under its own model, pooled.

Usage (about 5 minutes on 2 cores, most of it RepPer's per-device head selection)::

    .venv/bin/python research/sensor_methods.py --seeds 0 1 2

Writes ``research/results/sensor_methods.json`` (command, config, every run's final and
per-device accuracy) and ``research/results/sensor_methods.md`` (mean ± std over seeds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: `python research/<script>.py`
sys.path.insert(0, str(ROOT / "examples" / "sensors"))  # the example's my_model, as its PYTHONPATH does
RESULTS = ROOT / "research" / "results"

METHODS = ["fedavg", "fedrep", "repper"]


def run_config(method: str, seed: int, args):
    from edgepfl.config import RunConfig, parse_config

    return parse_config(RunConfig, {
        "federation": "sensor-methods",
        "method": {"name": method},
        "model": {"arch": "my_model:build", "feature_dim": 32, "norm": "none"},
        "train": {"epochs": args.epochs, "batch_size": 8, "lr": args.lr, "optimizer": "adam", "weight_decay": 0.0},
        "data": {"dataset": "ts", "name": "BasicMotions", "num_clients": args.devices, "seed": seed,
                 "partition": {"kind": "dirichlet", "alpha": args.alpha, "shift": ["gain"]}},
        "rounds": args.rounds, "min_agents": args.devices, "device": "cpu", "seed": seed,
    }, "research/sensor_methods.py")


def run_one(config, out: Path) -> dict:
    """One in-process federation; its summary (final accuracy, per device)."""
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.ops.report import write_report
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape
    from edgepfl.edge_agent.tiers import local_trainers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    agents = local_trainers(config, agent_ids(config.data.num_clients), out)
    Coordinator(config, LocalFleet(agents, config.federation), out, progress=False, **data_shape(config)).run()
    _, summary = write_report(out, config.method.name)
    return summary


def table(runs: list[dict], seeds: list[int]) -> str:
    lines = ["| method | final accuracy, mean ± std | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|---|" + "---|" * len(seeds)]
    for method in METHODS:
        accs = [r["final_accuracy"] for r in runs if r["method"] == method]
        if not accs:
            continue
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        lines.append(f"| {method} | {100 * statistics.mean(accs):.1f} ± {100 * spread:.1f} % | "
                     + " | ".join(f"{100 * a:.1f}" for a in accs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--out", type=Path, default=RESULTS / "sensor_methods")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for method in args.methods:
            for seed in args.seeds:
                config = run_config(method, seed, args)
                started = time.perf_counter()
                summary = run_one(config, Path(work) / f"{method}-s{seed}")
                runs.append({"method": method, "seed": seed, "final_accuracy": summary["final_accuracy"],
                             "final_per_client": summary["final_per_client"],
                             "seconds": round(time.perf_counter() - started, 1)})
                print(f"{method:8s} seed {seed}: {100 * summary['final_accuracy']:.1f}% "
                      f"({runs[-1]['seconds']} s)", flush=True)
    command = "python research/sensor_methods.py " + " ".join(sys.argv[1:] if argv is None else argv)
    record = {"command": command.strip(), "config": run_config(args.methods[0], args.seeds[0], args).model_dump(mode="json"),
              "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    text = (f"# Sensor fleet: FedAvg vs personalized methods on BasicMotions\n\n"
            f"{args.devices} devices, Dirichlet({args.alpha}) label skew + per-device sensor gain, "
            f"{args.rounds} rounds, the example's 1-D CNN; final personalized accuracy on the devices' "
            f"held-out windows.\n\nCommand: `{record['command']}`\n\n{table(runs, args.seeds)}\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
