"""Heads on held-out new clients over each method's exported encoder (RepPer's Table 3, small).

For each method: a federation of ``--trainers`` clients trains for ``--rounds`` rounds
with the in-process simulator (the same coordinator round loop and trainer runtime as
``edgepfl simulate --in-process``) on Fashion-MNIST partitioned over
``trainers + new`` clients (Dirichlet alpha 0.5, ``--samples-per-client`` each); only
partitions ``0 .. trainers-1`` take part. The run's encoder is exported with
:func:`edgepfl.export.onnx_export.export_run`; then for each of the ``--new`` partitions that never
took part, :func:`edgepfl.export.fit_head.fit_head` fits an ``svm``, ``lr`` and ``mlp`` head on the
ONNX encoder's features of the client's train split and scores it on the client's test
split (plus the method's own device head, ``dualfed`` / ``fedpick``, where the release
offers one). The ``init`` row is the same CNN at random initialization, exported the same
way: the floor that training the encoder has to beat.

Each method runs in its own process (``--jobs`` at a time, ``OMP_NUM_THREADS=1``), writing
``<work>/<method>.json``; the parent collects them.

Usage::

    .venv/bin/python research/heads_new_clients.py --rounds 10 --jobs 2

Writes ``research/results/edge_heads_new_clients.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: `python research/<script>.py`
RESULTS = ROOT / "research" / "results"

METHODS = ["fedavg", "repper", "dualfed", "fedpick", "fedpac", "fedrir", "fedper", "fedrep"]


def run_config(method: str, args) -> RunConfig:  # noqa: F821
    from edgepfl.config import DataSpec, MethodSpec, ModelSpec, PartitionSpec, RunConfig, TrainConfig

    return RunConfig(
        federation="heads-bench", method=MethodSpec(name=method), model=ModelSpec(arch="cnn"),
        train=TrainConfig(epochs=args.epochs, batch_size=50, lr=args.lr, momentum=0.5),
        data=DataSpec(dataset="fmnist", num_clients=args.trainers + args.new, samples_per_client=args.samples_per_client,
                      partition=PartitionSpec(kind="dirichlet", alpha=args.alpha), seed=args.seed),
        rounds=args.rounds, min_agents=args.trainers, device="cpu", seed=args.seed, fraction=args.fraction,
    )


def train(config, trainers: int, out: Path) -> dict:
    """The in-process simulation over partitions 0..trainers-1 only; returns the run summary.

    ``edgepfl.coordinator.simulate.simulate`` sizes the partition to the fleet; here the data spec
    keeps ``trainers + new`` partitions so the new clients' data exists but never trains.
    """
    import shutil

    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.ops.report import write_report
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape
    from edgepfl.edge_agent.tiers import local_trainers

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    agents = local_trainers(config, agent_ids(trainers), out)
    Coordinator(config, LocalFleet(agents, config.federation), out, progress=False, **data_shape(config)).run()
    _, summary = write_report(out, config.method.name)
    return summary


def export_init(config, out: Path) -> Path:
    """The untrained encoder (FedAvg's model at initialization) exported like a run's."""
    import torch

    from edgepfl.config import MethodSpec
    from edgepfl.coordinator.simulate import data_shape
    from edgepfl.export.onnx_export import build_from_meta, export_state
    from edgepfl.state import CheckpointMeta

    fedavg = config.model_copy(update={"method": MethodSpec(name="fedavg")})
    torch.manual_seed(config.seed)
    meta = CheckpointMeta(round=-1, run=fedavg.run_spec(**data_shape(config)), data_spec=config.data)
    method, model = build_from_meta(meta)
    export_state(method.init_server(model), meta, out)
    return out


def heads_on_new_clients(config, export: Path, trainers: int, new: int) -> list[dict]:
    """Fit every applicable head on each new client's train split; score on its test split."""
    from edgepfl.data import load_client_data
    from edgepfl.export.fit_head import Dataset, fit_head
    from edgepfl.export.predict import OnnxEncoder
    from edgepfl.methods import get_method

    encoder = OnnxEncoder.from_dir(export, threads=1)
    kinds = get_method(encoder.manifest.run.method.name).head_kinds  # the generic heads and the method's own
    rows = []
    for index in range(trainers, trainers + new):
        d = load_client_data(config.data, index)
        data = Dataset(d.x_train, d.y_train, d.x_test, d.y_test, list(d.class_names), federation_classes=True)
        for kind in kinds:
            _, report = fit_head(encoder, data, kind, export_dir=export)
            report.update(client=index, classes_in_train=int(len(set(d.y_train.tolist()))))
            rows.append(report)
    return rows


def one(method: str, args) -> None:
    """Train (or initialize), export and score heads for one method; writes <work>/<method>.json."""
    from edgepfl.export.onnx_export import export_run
    from edgepfl.protocol import read_manifest

    work = Path(args.work)
    config = run_config("fedavg" if method == "init" else method, args)
    start = time.perf_counter()
    result: dict = {"method": method}
    if method == "init":
        export = export_init(config, work / "export-init")
        result["train_seconds"] = 0.0
    else:
        summary = train(config, args.trainers, work / f"run-{method}")
        result["train_seconds"] = round(time.perf_counter() - start, 1)
        result["trainers_final_accuracy"] = summary.get("final_accuracy")
        result["mean_round_seconds"] = summary.get("mean_round_seconds")
        export = work / f"export-{method}"
        export_run(work / f"run-{method}", export)
    manifest = read_manifest(export / "manifest.json")
    result["feature_dim"] = manifest.feature_dim
    result["batchnorm"] = manifest.batchnorm.statistics
    t = time.perf_counter()
    result["heads"] = heads_on_new_clients(config, export, args.trainers, args.new)
    result["heads_seconds"] = round(time.perf_counter() - t, 1)
    (work / f"{method}.json").write_text(json.dumps(result, indent=2))
    print(f"{method}: done in {time.perf_counter() - start:.0f} s", flush=True)


def aggregate(results: list[dict]) -> list[dict]:
    """Per method and head: mean (and per-client) test accuracy over the new clients."""
    table = []
    for r in results:
        by_kind: dict[str, list[dict]] = {}
        for row in r["heads"]:
            by_kind.setdefault(row["head"], []).append(row)
        entry = {"method": r["method"], "trainers_final_accuracy": r.get("trainers_final_accuracy"),
                 "train_seconds": r["train_seconds"], "feature_dim": r["feature_dim"], "batchnorm": r["batchnorm"],
                 "heads": {}}
        for kind, rows in by_kind.items():
            accs = [x["validation_accuracy"] for x in rows]
            entry["heads"][kind] = {"mean": statistics.fmean(accs), "per_client": {str(x["client"]): x["validation_accuracy"]
                                                                                    for x in rows}}
        table.append(entry)
    return table


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [
        "# Heads on held-out new clients, per method's exported encoder",
        "",
        f"Command: `{result['command']}`  ",
        f"Fashion-MNIST, small CNN (128 features), Dirichlet alpha {a['alpha']} over {a['trainers'] + a['new']} clients "
        f"of {a['samples_per_client']} samples (75% train / 25% test each); clients 0-{a['trainers'] - 1} train for "
        f"{a['rounds']} rounds ({a['epochs']} local epoch, lr {a['lr']}, method defaults otherwise); clients "
        f"{a['trainers']}-{a['trainers'] + a['new'] - 1} never take part and fit heads on the ONNX encoder offline. "
        f"Test accuracy on each new client's own test split, mean over the {a['new']} new clients. "
        f"Wall time {result['wall_seconds']:.0f} s with {a['jobs']} processes, OMP_NUM_THREADS=1, on a shared 2-core "
        f"machine (load average {result['loadavg_start']} at start, {result['loadavg_end']} at end).",
        "",
        "| encoder | SVM | LR | MLP | method's own head | trainers' final acc. (own method) | train s |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in result["table"]:
        h = e["heads"]
        own = [f"{k} {h[k]['mean']:.4f}" for k in ("dualfed", "fedpick") if k in h]
        tf = e["trainers_final_accuracy"]
        lines.append(f"| {e['method']} | {h['svm']['mean']:.4f} | {h['lr']['mean']:.4f} | {h['mlp']['mean']:.4f} "
                     f"| {', '.join(own) or '-'} | {'-' if tf is None else f'{tf:.4f}'} | {e['train_seconds']:.0f} |")
    lines += ["", "Per-client accuracies are in the JSON file. `init` = the CNN at random initialization "
              "(BatchNorm statistics calibrated), no training."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(["init", *METHODS]))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--samples-per-client", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, default=1.0, help="share of the trainers sampled per round")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work", default="/tmp/edgepfl-heads-bench")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--collect-only", action="store_true", help="only aggregate existing <work>/<method>.json")
    parser.add_argument("--out", default=str(RESULTS / "edge_heads_new_clients"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.one:
        one(args.one, args)
        return
    methods = args.methods.split(",")
    flags = [f"--rounds {args.rounds}", f"--epochs {args.epochs}", f"--lr {args.lr}", f"--trainers {args.trainers}",
             f"--new {args.new}", f"--samples-per-client {args.samples_per_client}", f"--alpha {args.alpha}",
             f"--seed {args.seed}", f"--jobs {args.jobs}"] + ([f"--fraction {args.fraction}"] if args.fraction != 1.0 else [])
    command = "python research/heads_new_clients.py --methods " + ",".join(methods) + " " + " ".join(flags)
    if Path(args.out).resolve() != (RESULTS / "edge_heads_new_clients").resolve():
        command += f" --out {os.path.relpath(args.out, ROOT)}"
    loadavg_start = [round(v, 2) for v in os.getloadavg()]
    start = time.perf_counter()
    if not args.collect_only:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        pending, running = list(methods), []
        child = [sys.executable, __file__, *" ".join(flags).split(), "--work", str(work)]
        while pending or running:
            while pending and len(running) < args.jobs:
                m = pending.pop(0)
                (work / f"{m}.json").unlink(missing_ok=True)
                log = open(work / f"{m}.log", "w")
                running.append((m, subprocess.Popen([*child, "--one", m], env=env, stdout=log, stderr=subprocess.STDOUT)))
            time.sleep(2)
            for m, p in list(running):
                if p.poll() is not None:
                    running.remove((m, p))
                    print(f"{m}: exit {p.returncode}", flush=True)
    results = [json.loads((work / f"{m}.json").read_text()) for m in methods if (work / f"{m}.json").is_file()]
    missing = [m for m in methods if not (work / f"{m}.json").is_file()]
    result = {"command": command, "args": vars(args) | {"methods": methods}, "missing": missing,
              "wall_seconds": time.perf_counter() - start, "loadavg_start": loadavg_start,
              "loadavg_end": [round(v, 2) for v in os.getloadavg()], "table": aggregate(results), "raw": results}
    result["args"].pop("one", None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if missing:
        print(f"missing (failed, see {work}/<method>.log): {missing}", file=sys.stderr)


if __name__ == "__main__":
    main()
