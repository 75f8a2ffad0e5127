"""Time (and bytes) to a target accuracy: buffered asynchronous rounds against synchronous
ones, on an unequal fleet.

The fleet is ``configs/unequal_fleet.yaml``: Fashion-MNIST, pathological (2 classes per
device, 200 samples each), 80 % "fast" devices (1 ms per training sample) and 20 % "slow"
ones (5 ms, and a slower link), every device with a log-normal spread of speed (sigma 0.5)
and its own on/off periods (online 120 s, offline 10 s on average). Per method and seed:

* ``sync`` — every online device trains every round; a round closes when all answered, or
  when everyone still owing an answer is offline, or at ``round_timeout_s`` with a quorum
  (a straggler's update is folded into the next round, discounted: the default);
* ``buffered`` — FedBuff: every device trains continuously on the newest state it was
  sent; a new state every ``--buffer`` updates, at most one per device.

Both modes get the same time: the synchronous run trains ``--rounds`` rounds, the buffered
one as many states as fit in the time that took (``time_budget_s``). The accuracy is the
same estimator for both: after each metrics row, the mean over devices of
each device's latest held-out accuracy (measured on the state it was last sent). Time to
target is the first (virtual) time at which it reaches ``--target``, bytes to target
likewise, and the final accuracy is the run's final evaluation (every device, the last
state).

Two paths, one profile:

* ``--path in-process`` (default): ``edgepfl simulate --in-process`` on the virtual clock;
  the times are simulated device time, the same on any host at any load.
* ``--path mqtt``: a broker, the coordinator and one ``edgepfl agent`` process per device,
  each paced to its device (``simulation.pace_processes``: compute and links; availability
  is not imposed on processes, so ``--always-online`` drops it from the profile for both
  paths); the times are wall-clock seconds. Small fleets only: every agent is a process.

    python benchmarks/async_time_to_accuracy.py --devices 50 --seeds 0 1 2 --methods fedavg fedrep fedpick
    python benchmarks/async_time_to_accuracy.py --path mqtt --devices 8 --always-online --seconds-per-sample 0.005 ...

The first runs in about an hour on a 2-core box (two processes: ``--methods`` split, then
``benchmarks/async_time_to_accuracy.py --merge OUT1 OUT2 --out OUT``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from edgepfl.config import RunConfig, load_run_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.metrics import RoundMetrics

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

FLEET_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "unequal_fleet.yaml"


def curve(rows: list[RoundMetrics]) -> list[tuple[float, int, float]]:
    """(cumulative seconds, cumulative bytes, mean of each device's latest accuracy) per row."""
    latest: dict[str, float] = {}
    t, sent, points = 0.0, 0, []
    for row in rows:
        if row.final:
            continue
        t += row.seconds
        sent += row.bytes_up + row.bytes_down
        latest.update({a: acc for a, acc in row.per_client.items() if acc is not None})
        points.append((t, sent, sum(latest.values()) / len(latest) if latest else 0.0))
    return points


def to_target(points: list[tuple[float, int, float]], target: float) -> tuple[float | None, int | None]:
    for t, sent, acc in points:
        if acc >= target:
            return t, sent
    return None, None


def fleet_config(args: argparse.Namespace, method: str, mode: str, seed: int) -> RunConfig:
    sets = [f"method.name={method}", f"seed={seed}", f"data.seed={seed}", f"asynchrony.mode={mode}",
            f"asynchrony.buffer_size={args.buffer}", *args.set, *(args.buffered_set if mode == "buffered" else [])]
    config = load_run_config(FLEET_CONFIG, sets)
    devices = []
    for device in config.simulation.devices:
        update: dict = {}
        if args.always_online:
            update.update(mean_online_s=None, mean_offline_s=None)
        if args.seconds_per_sample is not None:  # the fast class's; the others keep their ratio to it
            update["seconds_per_sample"] = (device.seconds_per_sample / config.simulation.devices[0].seconds_per_sample
                                            * args.seconds_per_sample)
        devices.append(device.model_copy(update=update))
    simulation = config.simulation.model_copy(update={"devices": devices, "pace_processes": args.path == "mqtt"})
    return config.model_copy(update={"simulation": simulation})


def run_one(args: argparse.Namespace, method: str, mode: str, seed: int, budget: float | None = None) -> dict:
    config = fleet_config(args, method, mode, seed)
    rounds = args.rounds
    if budget is not None:  # as many states as fit in the time the synchronous run took
        config = config.model_copy(update={"time_budget_s": budget})
        rounds = args.rounds * args.devices * 10 // args.buffer
    w0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        if args.path == "mqtt":
            rows, _ = simulate(config, args.devices, out, rounds=rounds, progress=False, threads=1,
                               **({"broker": args.broker} if args.broker else {}))
        else:
            # one torch thread: two runs side by side on two cores do not spin against each other
            rows, _ = simulate(config, args.devices, out, in_process=local_trainers, rounds=rounds, progress=False,
                               threads=1)
    points = curve(rows)
    final = next(r for r in rows if r.final)
    stale = [int(k) for row in rows for k, n in row.staleness.items() for _ in range(n)]
    return {"method": method, "mode": mode, "seed": seed, "rows": len(points), "curve": points,
            "final_accuracy": final.accuracy, "updates": len(stale),
            "mean_staleness": sum(stale) / len(stale) if stale else 0.0,
            "rejected": {k: sum(r.rejected.get(k, 0) for r in rows if not r.final)
                         for k in sorted({k for r in rows if not r.final for k in r.rejected})},
            "host_wall_s": round(time.perf_counter() - w0, 1), "host_cpu_s": round(time.process_time() - c0, 1)}


def buffered_variant(result: dict) -> str:
    """How a result's buffered runs were set: the buffer and any buffered-only overrides."""
    return " ".join([f"buffer {result['buffer']}", *result.get("buffered_set", [])])


def markdown(result: dict) -> str:
    unit = "virtual s" if result["path"] == "in-process" else "wall s"
    lines = ["# Time to accuracy: buffered vs synchronous rounds", "",
             f"`{result['command']}` on {result['machine']}", "",
             f"Path: {result['path']}. Target: mean latest per-device accuracy "
             + (f"{result['target']:.0%}" if result["target"] is not None
                else f"{result['target_fraction']:.0%} of the synchronous run's final accuracy") + "; "
             f"{result['devices']} devices of `configs/unequal_fleet.yaml`"
             + (" without availability periods" if result["always_online"] else "")
             + (f", {result['seconds_per_sample']} s per sample on a fast device" if result["seconds_per_sample"]
                else "") + f"; a buffered state per {result['buffer']} updates.", "",
             f"| method | seed | mode | rows | updates | mean staleness | {unit} to target | MB to target | "
             f"final accuracy | host CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in result["runs"]:
        t, b = run["time_to_target"], run["bytes_to_target"]
        lines.append(f"| {run['method']} | {run['seed']} | {run['mode']} | {run['rows']} | {run['updates']} | "
                     f"{run['mean_staleness']:.2f} | {'—' if t is None else f'{t:.1f}'} | "
                     f"{'—' if b is None else f'{b / 1e6:.1f}'} | {run['final_accuracy']:.2%} | {run['host_cpu_s']} |")
    lines += ["", "| method | seed | buffered runs | target | speed-up to target (sync / buffered) | "
              "bytes to target (buffered / sync) | final accuracy difference (points) |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for pair in result["pairs"]:
        speed, ratio = pair["speedup"], pair["bytes_ratio"]
        lines.append(f"| {pair['method']} | {pair['seed']} | {pair.get('buffered', '')} | {pair['target']:.2%} | "
                     f"{'—' if speed is None else f'{speed:.2f}x'} | "
                     f"{'—' if ratio is None else f'{ratio:.2f}'} | {pair['final_difference_points']:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", choices=["in-process", "mqtt"], default="in-process")
    p.add_argument("--devices", type=int, default=50)
    p.add_argument("--methods", nargs="*", default=["fedavg", "fedrep", "fedpick"])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30, help="synchronous rounds; buffered: the same time")
    p.add_argument("--buffer", type=int, default=25, help="updates per buffered state (at most the fleet's size)")
    p.add_argument("--target", type=float, default=None, help="an accuracy to reach (default: --target-fraction)")
    p.add_argument("--target-fraction", type=float, default=0.95,
                   help="the target as a share of the synchronous run's final accuracy (methods end far apart)")
    p.add_argument("--always-online", action="store_true", help="drop the availability periods (both paths)")
    p.add_argument("--seconds-per-sample", type=float, default=None,
                   help="a fast device's pace (the slow class keeps its ratio); for paced processes, slower than "
                        "this host really is")
    p.add_argument("--broker", default=None, help="--path mqtt: a broker URL (default: the embedded one)")
    p.add_argument("--set", action="append", default=[], help="a run-config override, key=value (repeatable)")
    p.add_argument("--buffered-set", action="append", default=[],
                   help="a run-config override for the buffered runs only, key=value (repeatable)")
    p.add_argument("--out", default="benchmarks/results/async_time_to_accuracy")
    p.add_argument("--merge", nargs="*", default=None, metavar="OUT",
                   help="write one result from earlier runs' OUT.json files (same settings) instead of running")
    args = p.parse_args(argv)
    if args.merge:
        parts = [json.loads(Path(out).with_suffix(".json").read_text()) for out in args.merge]
        result = {**parts[0], "command": " && ".join(part["command"] for part in parts),
                  "runs": [r for part in parts for r in part["runs"]],
                  "pairs": [{"buffered": buffered_variant(part), **pair} for part in parts for pair in part["pairs"]]}
        write_results(result, args.out, markdown)
        return result
    runs, pairs = [], []
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["python benchmarks/async_time_to_accuracy.py", *given]),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "path": args.path,
              "devices": args.devices, "buffer": args.buffer, "target": args.target,
              "target_fraction": args.target_fraction, "always_online": args.always_online,
              "seconds_per_sample": args.seconds_per_sample, "set": args.set, "buffered_set": args.buffered_set,
              "runs": runs, "pairs": pairs}
    for method in args.methods:
        for seed in args.seeds:
            sync = run_one(args, method, "sync", seed)
            buffered = run_one(args, method, "buffered", seed, budget=sync["curve"][-1][0])
            target = args.target if args.target is not None else args.target_fraction * sync["final_accuracy"]
            for run in (sync, buffered):
                run["target"] = target
                run["time_to_target"], run["bytes_to_target"] = to_target(run["curve"], target)
                runs.append(run)
                print(method, seed, run["mode"], f"target {target:.4f}", run["time_to_target"],
                      run["final_accuracy"], flush=True)
            (ts, bs), (tb, bb) = (to_target(r["curve"], target) for r in (sync, buffered))
            pairs.append({"method": method, "seed": seed, "target": target, "buffered": buffered_variant(result),
                          "speedup": ts / tb if ts and tb else None,
                          "bytes_ratio": bb / bs if bs and bb else None,
                          "final_difference_points": 100 * (buffered["final_accuracy"] - sync["final_accuracy"])})
            write_results(result, args.out, markdown)  # after every pair: a long grid keeps what it measured
    return result


if __name__ == "__main__":
    main()
