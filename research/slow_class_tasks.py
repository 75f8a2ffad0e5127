"""What sets the whole fleet's time to target (#52 item 4)? Per device class, when its
devices report for the k-th time, and what they report then, in synchronous, budgeted and
FedBuff rounds of the same fleet and seed.

A device's reported accuracy is measured on the state it was sent, with the personal part
it holds (FedRep: the head it trained on its earlier tasks), so a class whose devices have
trained few times holds the whole-fleet curve down however good the shared encoder is. The
question this answers: is the budgeted mode's speed-up on the unequal fleet bounded by how
often its slow devices can train (their own task time, which no buffered schedule shortens),
or by the bytes it may spend?

Runs ``benchmarks/async_time_to_accuracy.py`` (the same runs, the same estimator) with its
simulation wrapped to keep each run's metrics rows, then per run and class: the median over
the class's devices of the time of its k-th report, and the class's mean latest accuracy
at that time.

    OMP_NUM_THREADS=1 python research/slow_class_tasks.py --seeds 0 1 2 -- --modes buffered budget \\
        --methods fedrep --set train.max_grad_norm=1

Everything after ``--`` goes to the benchmark. About 6 minutes a seed on one core. Writes
research/results/slow_class_tasks.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import async_time_to_accuracy as bench  # noqa: E402

from results_io import write_results  # noqa: E402

REPORTS = 6  # the k-th report, k = 1 .. REPORTS


def class_reports(rows: list, classes: dict[str, str]) -> dict[str, list[dict]]:
    """Per class, for k = 1 .. REPORTS: the median time of its devices' k-th report (only
    devices that reported k times), how many did, and the class's mean latest accuracy then."""
    latest: dict[str, float] = {}
    when: dict[str, list[float]] = {}
    at_time: list[tuple[float, dict[str, float]]] = []
    t = 0.0
    for row in rows:
        if row.final:
            continue
        t += row.seconds
        for agent, accuracy in row.per_client.items():
            if accuracy is None:
                continue
            latest[agent] = accuracy
            when.setdefault(agent, []).append(t)
        at_time.append((t, dict(latest)))
    out: dict[str, list[dict]] = {}
    for name in sorted(set(classes.values())):
        members = [a for a, c in classes.items() if c == name]
        series = []
        for k in range(1, REPORTS + 1):
            times = [when[a][k - 1] for a in members if len(when.get(a, [])) >= k]
            if not times:
                break
            moment = statistics.median(times)
            held = next(seen for tt, seen in at_time if tt >= moment)
            accs = [held[a] for a in members if a in held]
            series.append({"k": k, "devices": len(times), "of": len(members), "median_time_s": round(moment, 2),
                           "class_accuracy": round(sum(accs) / len(accs), 4) if accs else None})
        out[name] = series
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", type=Path, default=REPO / "research" / "results" / "slow_class_tasks")
    args = p.parse_args(ours)
    captured: list[tuple[object, list]] = []
    simulate = bench.simulate

    def keeping(config, *a, **k):
        rows, rest = simulate(config, *a, **k)
        captured.append((config, rows))
        return rows, rest

    bench.simulate = keeping
    runs = []
    try:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as scratch:
                result = bench.main([*theirs, "--seeds", str(seed), "--out", str(Path(scratch) / "bench")])
            for run, (config, rows) in zip(result["runs"], captured, strict=True):
                runs.append({key: run[key] for key in ("method", "mode", "seed", "interval_s", "target",
                                                       "time_to_target", "bytes_to_target")}
                            | {"classes": class_reports(rows, bench.device_classes(config))})
                print(runs[-1]["mode"], seed, runs[-1]["time_to_target"], flush=True)
            captured.clear()
    finally:
        bench.simulate = simulate
    write_results({"command": "python research/slow_class_tasks.py " + " ".join(argv), "runs": runs},
                  args.out, markdown)
    return 0


def markdown(result: dict) -> str:
    lines = ["# When each device class reports, per mode", "", f"`{result['command']}`", "",
             "Per run and class: the median time (virtual s) of its devices' k-th report / the class's mean "
             "latest accuracy then (devices that reported k times, of the class). Time to target: the "
             "benchmark's whole-fleet estimator.", "",
             "| seed | mode | time to target (s) | MB to target | class | " + " | ".join(
                 f"k = {k}" for k in range(1, REPORTS + 1)) + " |",
             "|---|---|---|---|---|" + "---|" * REPORTS]
    for run in result["runs"]:
        mode = run["mode"] + (f" ({run['interval_s']:.1f} s)" if run.get("interval_s") else "")
        t, b = run["time_to_target"], run["bytes_to_target"]
        for name, series in run["classes"].items():
            cells = [f"{s['median_time_s']:.1f} / {100 * s['class_accuracy']:.1f} % ({s['devices']}/{s['of']})"
                     if s["class_accuracy"] is not None else "—" for s in series]
            cells += ["—"] * (REPORTS - len(cells))
            lines.append(f"| {run['seed']} | {mode} | {'—' if t is None else f'{t:.1f}'} | "
                         f"{'—' if b is None else f'{b / 1e6:.0f}'} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
