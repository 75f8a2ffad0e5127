"""One enrolled device of four poisons the federation: the attacks below against the
aggregation rules, each with the defaults a user gets, on digits and Fashion-MNIST.

The attacker is ``agent-00`` of an in-process FedAvg fleet: a real trainer runtime whose
data, announced sample count or upload is corrupted, so every poisoned frame goes through
the coordinator's gate, the weight cap (``aggregation.max_weight_ratio``: a count weighs
at most twice the round's median announced count), the update bound
(``max_update_ratio`` 10) and the rule, exactly as an MQTT agent's would. The rules are
the library's with their default options; only ``aggregation.rule`` changes. Strategies:

* ``noise_2^24``: an update of random noise at 0.9 x the update bound (the largest change
  the bound lets through), announcing 2^24 training samples;
* ``label_flip_2^24``: trains honestly on its data with every label y made C - 1 - y,
  announcing 2^24 samples;
* ``backdoor_2^24``: half of its training images carry a trigger (a bright 3 x 3 corner)
  and the label 0, announcing 2^24 samples; also measured: the attack success rate, the
  share of honest devices' held-out images of another class that the trigger turns into 0;
* ``sign_flip``: its honest change, reversed;
* ``alie`` (a little is enough, Baruch et al. 2019): it trains four times on bootstrap
  resamples of its own data (one device's estimate of the honest updates' spread), and
  sends their coordinate-wise mean minus ``ALIE_Z`` standard deviations: a change that
  sits inside the honest spread in every coordinate, all of it pulling one way; its true count;
* ``buffered_<attack>``: the attack in buffered rounds (``asynchrony.mode: buffered``,
  ``BUFFERED_SIZE`` updates a state, each device at most one of them), against
  ``buffered_none`` and ``buffered_excluded`` as its references;
* ``scale_10``: its honest change x 10;
* ``scale_1e6``: its honest change x 10^6;
* ``noise``, ``label_flip``: the first two with the attacker's true count, to tell what
  the inflated count adds from what any one device of four can do;
* ``excluded``: no attacker, the three honest devices alone (the stricter reference: the
  attacker's own data may help or hurt the others' accuracy).

``--method``: the method every device runs (default FedAvg); under a personalized method
the rule aggregates only the shared part, and the honest accuracy is each device's own
(personal head included).

The number reported is the honest devices' accuracy on their own held-out data after the
last round (the final evaluation), against the same rule's clean run (no attacker).

    OMP_NUM_THREADS=1 python research/poisoning.py --datasets digits fmnist
    python research/poisoning.py --table          # the table from the JSONs
    python research/poisoning.py --summary grid-fedavg-s0 grid-fedavg-s1 …   # the seeds' costs, one table

Writes ``research/results/poisoning/<tag>/<dataset>__<rule>__<strategy>.json`` and the
table ``research/results/poisoning/<tag>.{json,md}`` (``--tag``, default ``defaults``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "research" / "results"
OUT_DIR = RESULTS / "poisoning"
AGENTS = 4
INFLATED = 2**24
TARGET = 0  # the backdoor's label
RULES = ["mean", "clipped_mean", "median", "trimmed_mean", "multi_krum", "centered_clip"]
STRATEGIES = ["none", "excluded", "noise_2^24", "label_flip_2^24", "backdoor_2^24", "sign_flip", "alie",
              "buffered_none", "buffered_excluded", "buffered_label_flip_2^24", "buffered_sign_flip",
              "scale_10", "scale_1e6", "noise", "label_flip"]
#: a little is enough: how many standard deviations its change sits from its estimate of the
#: honest mean. Baruch et al.'s z for n = 4, one attacker, is 0 (no shift); 1 is the value
#: their own experiments show moving the mean and Krum without being singled out.
ALIE_Z = 1.0
#: bootstrap trainings the ALIE attacker estimates the honest spread from
ALIE_RESAMPLES = 4
#: buffered rows: updates folded into a state (3 of 4 devices: the smallest buffer the
#: default rule treats robustly, so one attacker is at most one vote of three)
BUFFERED_SIZE = 3


#: per dataset: the model and training its clean FedAvg run learns steadily with (FMNIST: the
#: product's CNN and configs/fedavg.yaml's SGD; its MLP at lr 0.05 swung between 6 and 69 %)
PROTOCOLS = {
    "digits": {"model": {"arch": "mlp", "feature_dim": 64}, "train": {"lr": 0.05, "epochs": 2, "batch_size": 32},
               "data": {}},
    "fmnist": {"model": {"arch": "cnn", "feature_dim": 128},
               "train": {"lr": 0.01, "momentum": 0.5, "weight_decay": 5e-4, "epochs": 2, "batch_size": 50},
               "data": {"samples_per_client": 600}},
}


def base_strategy(strategy: str) -> str:
    """The attack itself: ``buffered_label_flip_2^24`` -> ``label_flip_2^24``."""
    return strategy.removeprefix("buffered_")


def run_config(dataset: str, rule: str, rounds: int, seed: int, aggregation: dict | None = None,
               method: str = "fedavg", buffered: bool = False) -> dict:
    protocol = PROTOCOLS[dataset]
    # buffered: as many states as a synchronous run has rounds, each of BUFFERED_SIZE updates
    asynchrony = {"asynchrony": {"mode": "buffered", "buffer_size": BUFFERED_SIZE}} if buffered else {}
    return {**asynchrony,
        "federation": "poisoning", "method": {"name": method},
        "model": protocol["model"], "train": protocol["train"],
        "data": {"dataset": dataset, "num_clients": AGENTS, "seed": seed, **protocol["data"]},
        "rounds": rounds, "fraction": 1.0, "seed": seed, "device": "cpu",
        "round_timeout_s": 3600, "aggregation": {**(aggregation or {}), "rule": rule},
        # compute costs no virtual time: the simulator times an answer by the count it announces,
        # and an attacker's inflated count is no slower to send than an honest one
        "simulation": {"devices": [{"name": "device", "share": 1.0, "seconds_per_sample": 0.0}]},
    }


def trigger(x: np.ndarray) -> np.ndarray:
    """``x`` (N, C, H, W, normalized) with its bottom-right 3 x 3 pixels at the batch's brightest value."""
    out = x.copy()
    out[:, :, -3:, -3:] = x.max()
    return out


def poisoned_data(strategy: str, data, seed: int):
    """The attacker's data: labels flipped, half its images triggered, or as it is; and its
    announced sample count inflated to 2^24 where the strategy says so."""
    from dataclasses import replace

    from edgepfl.data.client import ClientData

    x, y = data.x_train, data.y_train
    if strategy.startswith("label_flip"):
        y = (data.num_classes - 1 - y).astype(y.dtype)
    elif strategy.startswith("backdoor"):
        rng = np.random.default_rng(seed)
        chosen = rng.random(len(y)) < 0.5
        x = x.copy()
        x[chosen] = trigger(x[chosen])
        y = np.where(chosen, TARGET, y).astype(y.dtype)
    poisoned = replace(data, x_train=x, y_train=y)
    if not strategy.endswith("2^24"):
        return poisoned

    class Inflated(ClientData):
        @property
        def num_train(self) -> int:  # what its status and updates announce
            return INFLATED

    return Inflated(**{f: getattr(poisoned, f) for f in poisoned.__dataclass_fields__})


def poisoned_runtime(strategy: str, bound_ratio: float):
    """A TrainerRuntime whose training uploads are corrupted after honest training."""
    from dataclasses import replace

    from edgepfl.edge_agent.trainer import TrainerRuntime

    class Poisoned(TrainerRuntime):
        def _resampled_uploads(self, task) -> list[dict[str, np.ndarray]]:
            """ALIE_RESAMPLES uploads trained on bootstrap resamples of this device's data,
            from the task's state; the device's saved files are as they were afterwards."""
            self.state_dir.mkdir(parents=True, exist_ok=True)  # the first task may come before any file
            files = {p: p.read_bytes() for p in self.state_dir.iterdir() if p.is_file()}
            full, rng = self.data, np.random.default_rng([task.meta.seed, 1])
            uploads = []
            try:
                for _ in range(ALIE_RESAMPLES):
                    pick = rng.integers(0, full.num_train, full.num_train)
                    self.data = replace(full, x_train=full.x_train[pick], y_train=full.y_train[pick])
                    uploads.append(super().handle(task)[1])
            finally:
                self.data = full
                for p in self.state_dir.iterdir():
                    if p.is_file() and p not in files:
                        p.unlink()
                for p, raw in files.items():
                    p.write_bytes(raw)
            return uploads

        def handle(self, task):
            training = task.meta.kind == "train"
            resampled = self._resampled_uploads(task) if training and strategy == "alie" else []
            meta, upload = super().handle(task)
            if meta.kind != "train" or strategy not in ("noise_2^24", "noise", "sign_flip", "scale_10", "scale_1e6",
                                                        "alie"):
                return meta, upload
            sent = task.tensors
            learned = [k for k, v in upload.items() if k in sent and v.dtype.kind == "f"
                       and not k.endswith(("running_mean", "running_var"))]
            out = dict(upload)
            if strategy == "alie":
                for k in learned:
                    stack = np.stack([u[k].astype(np.float64) for u in resampled])
                    out[k] = (stack.mean(0) - ALIE_Z * stack.std(0)).astype(upload[k].dtype)
                return meta, out
            if strategy.startswith("noise"):
                rng = np.random.default_rng(task.meta.seed)
                noise = {k: rng.normal(0.0, 1.0, upload[k].shape) for k in learned}
                norm = np.sqrt(sum(float(np.sum(n ** 2)) for n in noise.values()))
                ref = np.sqrt(sum(float(np.sum(sent[k].astype(np.float64) ** 2)) for k in learned))
                scale = 0.9 * bound_ratio * max(1.0, ref) / norm
                for k in learned:
                    out[k] = (sent[k].astype(np.float64) + scale * noise[k]).astype(upload[k].dtype)
                return meta, out
            factor = {"sign_flip": -1.0, "scale_10": 10.0, "scale_1e6": 1e6}[strategy]
            for k in learned:
                g = sent[k].astype(np.float64)
                out[k] = (g + factor * (upload[k].astype(np.float64) - g)).astype(upload[k].dtype)
            return meta, out

    return Poisoned


def run_one(dataset: str, rule: str, strategy: str, rounds: int, seed: int, runs_root: Path,
            aggregation: dict | None = None, method: str = "fedavg") -> dict:
    import torch

    from edgepfl.config import RunConfig, parse_config
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import agent_ids, data_shape
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.tiers import TrainerTier
    from edgepfl.protocol.clock import simulated_time
    from edgepfl.simulation import FleetTiming

    torch.set_num_threads(1)
    buffered, attack = strategy.startswith("buffered_"), base_strategy(strategy)
    cfg = run_config(dataset, rule, rounds, seed, aggregation, method, buffered)
    try:
        config = parse_config(RunConfig, cfg, f"poisoning {dataset}/{rule}")
    except Exception as exc:  # a rule that refuses this fleet: a row of its own
        return {"dataset": dataset, "rule": rule, "strategy": strategy, "refused": str(exc).splitlines()[-1]}
    out = runs_root / f"{dataset}__{rule}__{strategy}"
    shutil.rmtree(out, ignore_errors=True)
    ids = agent_ids(AGENTS)
    tiers = {}
    for i, agent in enumerate(ids):
        if attack == "excluded" and i == 0:
            continue  # the honest devices alone, their data as in every other run
        data, state_dir = load_client_data(config.data, i), out / "agents" / agent
        attacker = i == 0 and attack != "none"
        if attacker:
            data = poisoned_data(attack, data, seed)
        tier = TrainerTier(agent, data, str(state_dir), "cpu")
        if attacker:
            tier.runtime = poisoned_runtime(attack, config.aggregation.max_update_ratio or 10.0)(
                agent, data, state_dir, "cpu")
        tiers[agent] = tier
    fleet = LocalFleet(tiers, config.federation, FleetTiming(config.simulation, list(tiers), config.seed),
                       epochs=config.train.epochs)
    t0 = time.monotonic()
    with simulated_time(fleet.clock.now):  # as edgepfl simulate --in-process: frames stamped in virtual time
        rows = Coordinator(config, fleet, out, progress=False, **data_shape(config)).run()
    honest = ids[1:]
    final = rows[-1]
    correct = total = 0
    for agent in honest:
        n, acc = tiers[agent].runtime.data.num_test, final.per_client.get(agent)
        if acc is not None:
            correct += acc * n
            total += n
    record = {
        "dataset": dataset, "rule": rule, "strategy": strategy, "rounds": rounds, "seed": seed, "agents": AGENTS,
        "method": method,
        "config": cfg, "honest_accuracy": correct / total if total else None,
        "accuracy_curve": [r.accuracy for r in rows if r.accuracy is not None],
        "rejected": {k: sum(r.rejected.get(k, 0) for r in rows) for k in sorted({k for r in rows for k in r.rejected})},
        "clipped": sum(len(r.clipped) for r in rows), "aborted_rounds": sum(r.aborted for r in rows),
        "wall_seconds": round(time.monotonic() - t0, 1),
    }
    if attack.startswith("backdoor"):
        record["attack_success"] = backdoor_success(tiers, honest)
    return record


def backdoor_success(tiers: dict, honest: list[str]) -> float:
    """Share of the honest devices' held-out images of a class other than the target that the
    trigger makes their final model (the last state each received) call the target."""
    import torch

    hits = total = 0
    for agent in honest:
        runtime = tiers[agent].runtime
        data, model = runtime.data, runtime.model
        keep = data.y_test != TARGET
        x = torch.from_numpy(trigger(data.x_test[keep]))
        model.eval()
        with torch.no_grad():
            predicted = model(x).argmax(1).numpy()
        hits += int((predicted == TARGET).sum())
        total += int(keep.sum())
    return hits / total if total else float("nan")


# ---------------------------------------------------------------------- the grid and the table
def result_path(tag: str, dataset: str, rule: str, strategy: str) -> Path:
    return OUT_DIR / tag / f"{dataset}__{rule}__{strategy.replace('^', '')}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["digits", "fmnist"])
    p.add_argument("--rules", nargs="+", default=RULES)
    p.add_argument("--strategies", nargs="+", default=STRATEGIES)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--method", default="fedavg", help="the method every device runs (the attacker's too)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs-root", default=str(REPO / "runs" / "poisoning"))
    p.add_argument("--skip-done", action="store_true", help="keep runs whose result JSON exists")
    p.add_argument("--table", action="store_true", help="only write the table from the JSONs")
    p.add_argument("--aggregation", action="append", default=[], metavar="KEY=VALUE",
                   help="an aggregation setting on top of the defaults (repeatable), e.g. max_weight_ratio=1")
    p.add_argument("--tag", default="defaults", help="results go to research/results/poisoning/<tag>/")
    p.add_argument("--summary", nargs="+", metavar="TAG",
                   help="only write research/results/poisoning/summary.{json,md}: per method, dataset and rule, "
                        "each attack's cost over the seeds of these tags (one tag per method and seed)")
    args = p.parse_args(argv)
    import yaml

    if args.summary:
        from results_io import write_results

        runs = [json.loads(f.read_text()) for tag in args.summary for f in sorted((OUT_DIR / tag).glob("*.json"))]
        write_results({"tags": args.summary, "runs": runs}, OUT_DIR / "summary", summary_markdown)
        return 0

    aggregation = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.aggregation)}
    if not args.table:
        for dataset in args.datasets:
            for rule in args.rules:
                for strategy in args.strategies:
                    path = result_path(args.tag, dataset, rule, strategy)
                    if args.skip_done and path.exists():
                        continue
                    record = run_one(dataset, rule, strategy, args.rounds, args.seed, Path(args.runs_root),
                                     aggregation, args.method)
                    record["command"] = (f"OMP_NUM_THREADS=1 python research/poisoning.py --datasets {dataset} "
                                         f"--method {args.method} "
                                         f"--rules {rule} --strategies {strategy} --rounds {args.rounds} "
                                         f"--seed {args.seed} --tag {args.tag}"
                                         + "".join(f" --aggregation {a}" for a in args.aggregation))
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(record, indent=2) + "\n")
                    said = record.get("refused") or (f"honest {record['honest_accuracy']:.4f} rejected "
                                                     f"{record['rejected']} ({record['wall_seconds']} s)")
                    print(f"{dataset:7s} {rule:13s} {strategy:16s} {said}", flush=True)
    from results_io import write_results

    write_results({"tag": args.tag, "aggregation": aggregation,
                   "runs": [json.loads(p.read_text()) for p in sorted((OUT_DIR / args.tag).glob("*.json"))]},
                  OUT_DIR / args.tag, markdown)
    return 0


#: the attacks the summary reports, beside the two references (clean: no attacker; excluded)
SUMMARY_ATTACKS = ["noise_2^24", "label_flip_2^24", "sign_flip", "alie", "backdoor_2^24", "buffered_label_flip_2^24",
                   "buffered_sign_flip"]


def summary_markdown(result: dict) -> str:
    """Per method, dataset and rule: the clean accuracy over the seeds, and each attack's
    cost against the better of clean and attacker-excluded (same rule, same seed; a buffered
    attack: the buffered clean and excluded runs), as the worst over the seeds and their
    mean; backdoor: its success, the largest over the seeds."""
    by = {}
    for r in result["runs"]:
        if "honest_accuracy" in r and r["honest_accuracy"] is not None:
            by[(r.get("method", "fedavg"), r["dataset"], r["rule"], r["strategy"], r["seed"])] = r
    combos = sorted({(m, d, rule) for m, d, rule, _, _ in by}, key=lambda c: (c[0], c[1], RULES.index(c[2])))
    lines = ["Points lost to one attacker of four against the better of the clean run and the run without it "
             "(same rule, same seed; buffered: the buffered runs): worst over the seeds (mean); "
             "clean: the honest devices' accuracy without an attacker, mean over the seeds (min-max); "
             "backdoor: its success, the largest over the seeds.", "",
             "| method | dataset | rule | seeds | clean | " + " | ".join(a.replace("_2^24", " @2^24")
                                                                          for a in SUMMARY_ATTACKS) + " |",
             "|---|---|---|---|---|" + "---|" * len(SUMMARY_ATTACKS)]
    for method, dataset, rule in combos:
        seeds = sorted({s for m, d, ru, _, s in by if (m, d, ru) == (method, dataset, rule)})
        clean = [by[(method, dataset, rule, "none", s)]["honest_accuracy"] for s in seeds
                 if (method, dataset, rule, "none", s) in by]
        cells = []
        for attack in SUMMARY_ATTACKS:
            costs, success = [], []
            mode = "buffered_" if attack.startswith("buffered_") else ""
            for s in seeds:
                refs = [by[k]["honest_accuracy"] for k in ((method, dataset, rule, mode + "none", s),
                                                           (method, dataset, rule, mode + "excluded", s)) if k in by]
                run = by.get((method, dataset, rule, attack, s))
                if run is None or not refs:
                    continue
                costs.append(100 * (max(refs) - run["honest_accuracy"]))
                if "attack_success" in run:
                    success.append(100 * run["attack_success"])
            if not costs:
                cells.append("—")
            elif attack.startswith("backdoor"):
                cells.append(f"{max(costs):.1f} ({np.mean(costs):.1f}); success {max(success):.0f} %")
            else:
                cells.append(f"{max(costs):.1f} ({np.mean(costs):.1f})")
        span = f"{100 * np.mean(clean):.1f} ({100 * min(clean):.1f}-{100 * max(clean):.1f})" if clean else "—"
        lines.append(f"| {method} | {dataset} | {rule} | {len(seeds)} | {span} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(result: dict) -> str:
    runs = {(r["dataset"], r["rule"], r["strategy"]): r for r in result["runs"]}
    lines = []
    for dataset in sorted({d for d, _, _ in runs}):
        rounds = next(r.get("rounds") for (d, _, _), r in runs.items() if d == dataset and "rounds" in r)
        settings = ", ".join(f"{k}: {v}" for k, v in result["aggregation"].items()) or "default aggregation settings"
        arch = PROTOCOLS[dataset]["model"]["arch"].upper()
        method = next((r.get("method", "fedavg") for (d, _, _), r in runs.items() if d == dataset), "fedavg")
        lines += [f"### {dataset}: honest devices' accuracy (%) after {rounds} rounds, 1 attacker of {AGENTS} "
                  f"({method}, {arch}, {settings}; excluded: the 3 honest devices alone; "
                  "backdoor: accuracy / attack success)", "",
                  "| rule | " + " | ".join(s.replace("_2^24", " @2^24") for s in STRATEGIES) + " |",
                  "|---|" + "---|" * len(STRATEGIES)]
        for rule in RULES:
            cells = []
            for strategy in STRATEGIES:
                r = runs.get((dataset, rule, strategy))
                if r is None:
                    cells.append("—")
                elif "refused" in r:
                    cells.append("refused")
                else:
                    cell = f"{100 * r['honest_accuracy']:.1f}"
                    if "attack_success" in r:
                        cell += f" / {100 * r['attack_success']:.0f}"
                    cells.append(cell)
            lines.append(f"| {rule} | " + " | ".join(cells) + " |")
        refused = {r["rule"]: r["refused"] for (d, _, _), r in runs.items() if d == dataset and "refused" in r}
        lines += [""] + [f"{rule} refused: {why}" for rule, why in sorted(refused.items())] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "benchmarks"))  # results_io: the JSON + markdown writer the benchmarks share
    raise SystemExit(main())
