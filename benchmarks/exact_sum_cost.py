"""What the exact sum costs the coordinator per update: the fused sum against the split one
and the fused sum of the code before secure aggregation, interleaved.

    python benchmarks/exact_sum_cost.py --agents 1000 --rounds 3 --repeats 2 --out benchmarks/results/exact_sum_cost

Secure aggregation split the streaming rules' exact sum (``edgepfl.aggregation.exact``) into
``contribution()`` (every key's grid integers) and ``add_total()`` (fold them in); the
clear path now folds each key's integers in as soon as they are made again. The arms differ
in ``_ExactSum.add`` alone, swapped into the same code:

* ``before``: the fused ``add`` of the last commit before the split (:data:`BEFORE`), its
  module read from git and loaded by path;
* ``fused``: this tree's ``add``;
* ``split``: ``add_total(contribution(...))``, what the clear path did after the split.

Each arm interleaved with the others repeat by repeat:

1. **in process**: CPU-seconds (``time.process_time``) per ``Mean.add`` on the capacity
   benchmark's CNN (``arch: cnn``, ``feature_dim`` 32, 342 kB of shared parameters), the
   default update bound included; the arms' aggregates must be the same bits;
2. **end to end**: ``capacity.py``'s run (the real ``edgepfl coordinator`` process, a real
   Mosquitto, ``--agents`` virtual agents of ``loadgen.py``) per arm: coordinator
   CPU-seconds per agent-round (user + system time of its process) beside wall seconds per
   round, rounds 1..R-1;
3. **the same words**: one untimed run per arm at ``--check-agents`` whose coordinator adds
   every update to a twin sum with the ``before`` arm's ``add`` as well; each mean it takes
   must find both sums' integers equal (final states cannot be compared across runs: the
   virtual agents' updates differ from run to run).
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import capacity  # noqa: E402

from edgepfl.aggregation import AggregationSpec  # noqa: E402
from edgepfl.aggregation.exact import _ExactSum  # noqa: E402

from results_io import write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
#: the last commit whose exact sum was fused, before secure aggregation split it
BEFORE = "bc5d848a4c9db8d7644307c0a9eb5ede5c40c876"
ARMS = ("before", "fused", "split")
#: the line a checking coordinator ends its log with (:func:`coordinator_with`)
CHECKED = "exact-sum check:"


def _split_add(self: _ExactSum, params, weight: int, factor: float = 1.0) -> None:
    self.add_total(self.contribution(params, weight, factor), weight)


def exact_sum_add(arm: str) -> Callable:
    """The ``_ExactSum.add`` of ``arm``."""
    if arm == "fused":
        return _ExactSum.add
    if arm == "split":
        return _split_add
    source = subprocess.run(["git", "show", f"{BEFORE}:edgepfl/aggregation.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="edgepfl-before-")) / "aggregation_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("aggregation_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["aggregation_before"] = module  # its pydantic model resolves names in its own module
    spec.loader.exec_module(module)
    return module._ExactSum.add


def coordinator_with(arm: str, argv: list[str], check: bool = False) -> int:
    """Run the ``edgepfl`` command ``argv`` with ``arm``'s exact sum (a child of ``measure``).

    With ``check`` (not timed: it sums everything twice) every update the coordinator adds
    is also added to a twin sum by the ``before`` arm's ``add``, and each mean the
    coordinator takes must find both sums' words equal; the number checked is logged last."""
    add = exact_sum_add(arm)
    if not check:
        _ExactSum.add = add  # type: ignore[method-assign]
    else:
        before, mean = exact_sum_add("before"), _ExactSum.mean
        checked = {"sums": 0, "updates": 0}

        def twin(self: _ExactSum) -> _ExactSum:
            if "_twin" not in vars(self):
                self._twin = _ExactSum(self.reference)  # type: ignore[attr-defined]
            return self._twin  # type: ignore[attr-defined]

        def add_both(self: _ExactSum, params, weight: int, factor: float = 1.0) -> None:
            add(self, params, weight, factor)
            before(twin(self), params, weight, factor)
            checked["updates"] += 1

        def checked_mean(self: _ExactSum):
            other = twin(self)
            same = all(np.array_equal(self.low[k], other.low[k]) and np.array_equal(self.high[k], other.high[k])
                       for k in self.reference) and self.total_weight == other.total_weight
            if not same:
                raise AssertionError(f"the {arm} exact sum differs from the sum before secure aggregation")
            checked["sums"] += 1
            return mean(self)

        _ExactSum.add, _ExactSum.mean = add_both, checked_mean  # type: ignore[method-assign]
        atexit.register(lambda: print(f"{CHECKED} {json.dumps(checked)}", file=sys.stderr, flush=True))
    from edgepfl.cli import main

    return main(argv)


def cnn_reference() -> dict[str, np.ndarray]:
    from edgepfl.models import SplitModel
    from edgepfl.specs import ModelSpec

    model = SplitModel.build(ModelSpec(arch="cnn", feature_dim=32), (1, 28, 28), 10)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def in_process(repeats: int, updates: int) -> dict:
    """Median CPU-ms per ``Mean.add`` per arm over interleaved repeats, and whether the arms agree bit for bit."""
    reference = cnn_reference()
    rng = np.random.default_rng(0)
    batch = [{k: (v + rng.normal(0, 0.01, v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v + 1
              for k, v in reference.items()} for _ in range(updates)]
    adds = {arm: exact_sum_add(arm) for arm in ARMS}
    fused = _ExactSum.add
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    digests: dict[str, set[str]] = {arm: set() for arm in ARMS}
    try:
        for repeat in range(repeats):
            for arm in ARMS[repeat % len(ARMS):] + ARMS[:repeat % len(ARMS)]:  # no arm always first
                _ExactSum.add = adds[arm]  # type: ignore[method-assign]
                rule = AggregationSpec().build()
                rule.begin(reference)
                started = time.process_time()
                for update in batch:
                    rule.add(update, 100)
                times[arm].append((time.process_time() - started) / len(batch))
                result = rule.result()
                digests[arm].add(hashlib.sha256(b"".join(result[k].tobytes() for k in sorted(result))).hexdigest())
    finally:
        _ExactSum.add = fused  # type: ignore[method-assign]
    return {
        "updates": updates, "repeats": repeats,
        "cpu_ms_per_add": {arm: round(1000 * statistics.median(t), 4) for arm, t in times.items()},
        "min_cpu_ms_per_add": {arm: round(1000 * min(t), 4) for arm, t in times.items()},
        "identical": len(set().union(*digests.values())) == 1,
    }


def checked_runs(args: argparse.Namespace, work: Path) -> dict:
    """One untimed run per arm whose coordinator sums every update with the arm's ``add`` and
    the ``before`` one side by side (:func:`coordinator_with`): the sums of real rounds must be
    the same words. (Final states cannot be compared across runs: the virtual agents' updates
    differ from run to run.)"""
    out = {}
    for arm in ARMS[1:]:
        where = work / f"check-{arm}"
        command = (sys.executable, str(Path(__file__).resolve()), "--coordinator-with", arm, "--check", "--")
        capacity.measure(args.check_agents, args, where, coordinator=command)
        log = (where / f"n{args.check_agents}" / "coordinator.log").read_text().splitlines()
        line = next(x for x in reversed(log) if x.startswith(CHECKED))
        out[arm] = json.loads(line.removeprefix(CHECKED))
        print(f"{arm}: {out[arm]}", flush=True)
    return out


def end_to_end(args: argparse.Namespace, work: Path) -> dict:
    """capacity.py's run per arm and repeat, interleaved."""
    runs = []
    for repeat in range(args.repeats):
        for arm in ARMS:
            where = work / f"{arm}-{repeat}"
            command = (sys.executable, str(Path(__file__).resolve()), "--coordinator-with", arm, "--")
            run = capacity.measure(args.agents, args, where, coordinator=command)
            runs.append({"arm": arm, "repeat": repeat, **{k: v for k, v in run.items() if k != "loadgen"}})
            print(f"{arm} #{repeat}: {run['coordinator_cpu_ms_per_agent_round']} CPU ms / agent-round, "
                  f"{run['round_s']} s / round", flush=True)
    summary = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        cpu = sum(r["coordinator_cpu_s_per_round"] * len(r["rounds"]) for r in mine)
        tasks = sum(t["tasks"] for r in mine for t in r["rounds"])
        summary[arm] = {"cpu_ms_per_agent_round": round(1000 * cpu / tasks, 3),
                        "round_s": round(statistics.mean(r["round_s"] for r in mine), 3),
                        "per_repeat_cpu_ms": [r["coordinator_cpu_ms_per_agent_round"] for r in mine]}
    return {"runs": runs, "summary": summary, "checked": checked_runs(args, work)}


def markdown(result: dict) -> str:
    micro, e2e = result["in_process"], result["end_to_end"]
    base = micro["cpu_ms_per_add"]["before"]
    lines = [f"Exact sum: fused (this tree) / split / fused before secure aggregation ({BEFORE[:7]}); {result['machine']}",
             "", f"In process: CPU ms per `Mean.add` on the CNN (342 kB), median of {micro['repeats']} interleaved "
             f"repeats of {micro['updates']} updates; aggregates bit-identical: **{micro['identical']}**", "",
             "| arm | CPU ms / add (median) | vs before | fastest repeat | vs before |",
             "| --- | ---: | ---: | ---: | ---: |"]
    fastest = micro["min_cpu_ms_per_add"]["before"]
    for arm in ARMS:
        ms, low = micro["cpu_ms_per_add"][arm], micro["min_cpu_ms_per_add"][arm]
        lines.append(f"| {arm} | {ms:.3f} | {ms / base - 1:+.1%} | {low:.3f} | {low / fastest - 1:+.1%} |")
    if e2e is not None:
        base = e2e["summary"]["before"]["cpu_ms_per_agent_round"]
        checked = ", ".join(f"{arm}: {c['sums']} sums of {c['updates']} updates" for arm, c in e2e["checked"].items())
        lines += ["", f"End to end: {result['agents']} virtual agents, {result['rounds']} rounds (rounds 1..R-1), "
                  f"{result['repeats']} interleaved repeats. Same words as the sum before, in a checking run at "
                  f"{result['check_agents']} agents: {checked}", "",
                  "| arm | coordinator CPU ms / agent-round | vs before | per repeat | wall s / round |",
                  "| --- | ---: | ---: | --- | ---: |"]
        for arm in ARMS:
            s = e2e["summary"][arm]
            lines.append(f"| {arm} | {s['cpu_ms_per_agent_round']:.3f} | {s['cpu_ms_per_agent_round'] / base - 1:+.1%} "
                         f"| {', '.join(f'{x:.3f}' for x in s['per_repeat_cpu_ms'])} | {s['round_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--coordinator-with"]:
        check = argv[2] == "--check"
        return coordinator_with(argv[1], argv[3 + check:], check)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="end-to-end runs per arm")
    ap.add_argument("--check-agents", type=int, default=100, help="agents of the untimed checking runs")
    ap.add_argument("--micro-repeats", type=int, default=15)
    ap.add_argument("--micro-updates", type=int, default=50)
    ap.add_argument("--skip-end-to-end", action="store_true")
    capacity.add_fleet_arguments(ap, timeout_s=900, per="per run")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="edgepfl-exact-sum-"))
    load = os.getloadavg()[0]
    micro = in_process(args.micro_repeats, args.micro_updates)
    print(micro, flush=True)
    e2e = None if args.skip_end_to_end else end_to_end(args, work)
    result = {
        "command": "python benchmarks/exact_sum_cost.py " + " ".join(argv),
        "agents": args.agents, "rounds": args.rounds, "repeats": args.repeats, "check_agents": args.check_agents,
        "machine": f"{platform.node()}: {os.cpu_count()} cores shared with other jobs, load {load:.1f} before, "
                   f"{os.getloadavg()[0]:.1f} after, Python {platform.python_version()}",
        "in_process": micro, "end_to_end": e2e,
    }
    if args.out:
        write_results(result, args.out, markdown)
    else:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
