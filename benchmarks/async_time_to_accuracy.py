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
  sent; a new state every ``--buffer`` updates, at most one per device;
* ``budget`` — buffered, each device sent at most one task per ``--task-interval`` seconds
  (``asynchrony.min_task_interval_s``; default the synchronous run's median round time, so
  a device sends about as often as in sync): the setting for a metered link.

Every mode gets the same time: the synchronous run trains ``--rounds`` rounds, the buffered
ones as many states as fit in the time that took (``time_budget_s``). The accuracy is the
same estimator for all: after each metrics row, the mean over devices of each device's
latest held-out accuracy (measured on the state it was last sent: what the device holds),
counted only once every device class of the fleet (fast, slow, sleepy) has reported at
least once (buffered rounds hear from the fast devices first: a mean over them alone is not
the fleet's). The target is ``--target-fraction`` of where the synchronous run's curve ends
(the same estimator at the end of the shared time), not of its final evaluation: that
evaluation sends the last state to every device, sleepers included, while along the curve a
sleepy device holds the state of its last round, so a target taken from it may lie above
everything the synchronous run's curve reaches. Time to target is the first (virtual) time
from which the curve stays at or above the target to the run's end, bytes to target the
bytes by then; ``naive`` is the first touch by whoever had reported, the estimator of
earlier tables. Per run also: each device class's mean share of a state's change (the rows'
``update_share``) and the updates clipped. The final accuracy is the run's final evaluation
(every device, the last state).

Two paths, one profile:

* ``--path in-process`` (default): ``edgepfl simulate --in-process`` on the virtual clock;
  the times are simulated device time, the same on any host at any load.
* ``--path mqtt``: a broker, the coordinator and one ``edgepfl agent`` process per device,
  each paced to its device (``simulation.pace_processes``: compute and links; availability
  is not imposed on processes, so ``--always-online`` drops it from the profile for both
  paths); the times are wall-clock seconds. Small fleets only: every agent is a process.

    python benchmarks/async_time_to_accuracy.py --devices 50 --seeds 0 1 2 --methods fedavg fedrep fedpick
    python benchmarks/async_time_to_accuracy.py --fleet configs/sleepy_fleet.yaml --devices 40 --buffer 10 \
        --modes buffered budget --methods fedrep fedpick --seeds 0 1 2
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
from collections.abc import Mapping
from pathlib import Path

from edgepfl.config import RunConfig, load_run_config
from edgepfl.coordinator.simulate import agent_ids, simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.metrics import RoundMetrics
from edgepfl.simulation import FleetTiming

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

FLEET_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "unequal_fleet.yaml"


def curve(rows: list[RoundMetrics], classes: Mapping[str, str] | None = None
          ) -> list[tuple[float, int, float | None]]:
    """(cumulative seconds, cumulative bytes, mean of each device's latest accuracy) per row;
    with ``classes`` (device -> its class), the accuracy is None until a device of every
    class has reported once (a mean over the fast devices alone is not the fleet's: buffered
    rounds hear from them first)."""
    latest: dict[str, float] = {}
    t, sent, points = 0.0, 0, []
    everyone = set((classes or {}).values())
    for row in rows:
        if row.final:
            continue
        t += row.seconds
        sent += row.bytes_up + row.bytes_down
        latest.update({a: acc for a, acc in row.per_client.items() if acc is not None})
        whole = classes is None or {classes[a] for a in latest if a in classes} == everyone
        points.append((t, sent, sum(latest.values()) / len(latest) if latest and whole else None))
    return points


def curve_end(points: list[tuple[float, int, float | None]]) -> float | None:
    """Where a curve ends: its last defined accuracy."""
    return next((acc for _, _, acc in reversed(points) if acc is not None), None)


def to_target(points: list[tuple[float, int, float | None]], target: float) -> tuple[float | None, int | None]:
    """The first point from which the whole fleet's accuracy stays at or above ``target``
    (a curve that touches it once and falls back has not reached it)."""
    reached = None
    for t, sent, acc in points:
        if acc is None or acc < target:
            reached = None
        elif reached is None:
            reached = (t, sent)
    return reached if reached is not None else (None, None)


def naive_to_target(points: list[tuple[float, int, float | None]], target: float) -> tuple[float | None, int | None]:
    """The estimator this benchmark used before: the first touch, whoever had reported."""
    for t, sent, acc in points:
        if acc is not None and acc >= target:
            return t, sent
    return None, None


def device_classes(config: RunConfig) -> dict[str, str]:
    """Each device of a simulated run (the names ``simulate`` gives them) -> its class's name,
    as the fleet's profile assigns them."""
    agents = agent_ids(config.data.num_clients)
    return {a: d.profile.name for a, d in FleetTiming(config.simulation, agents, config.seed).devices.items()}


def class_shares(rows: list[RoundMetrics], classes: dict[str, str]) -> dict[str, float]:
    """Per device class, its devices' mean share of a state's change (the rows' update_share)."""
    trained = [row for row in rows if not row.final and row.update_share]
    shares: dict[str, float] = {name: 0.0 for name in sorted(set(classes.values()))}
    for row in trained:
        for agent, share in row.update_share.items():
            shares[classes[agent]] += share / len(trained)
    return {k: round(v, 4) for k, v in shares.items()}


def fleet_config(args: argparse.Namespace, method: str, mode: str, seed: int,
                 interval: float | None = None) -> RunConfig:
    buffered = mode != "sync"
    sets = [f"method.name={method}", f"seed={seed}", f"data.seed={seed}",
            f"asynchrony.mode={'buffered' if buffered else 'sync'}", f"asynchrony.buffer_size={args.buffer}",
            f"data.num_clients={args.devices}", *args.set, *(args.buffered_set if buffered else []),
            *([f"asynchrony.min_task_interval_s={interval}"] if interval else [])]
    config = load_run_config(args.fleet, sets)
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


def run_one(args: argparse.Namespace, method: str, mode: str, seed: int, budget: float | None = None,
            interval: float | None = None) -> dict:
    """One run; ``interval``: buffered, each device's min_task_interval_s."""
    config = fleet_config(args, method, mode, seed, interval)
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
    final = next(r for r in rows if r.final)
    classes = device_classes(config)
    points = curve(rows, classes)
    stale = [int(k) for row in rows for k, n in row.staleness.items() for _ in range(n)]
    sync_rounds = sorted(r.seconds for r in rows if not r.final)
    return {"method": method, "mode": mode, "seed": seed, "rows": len(points), "curve": points,
            "curve_any": curve(rows),
            "final_accuracy": final.accuracy, "evaluated": sorted(final.per_client),
            "curve_end": curve_end(points), "updates": len(stale),
            "mean_staleness": sum(stale) / len(stale) if stale else 0.0, "interval_s": interval,
            "median_row_s": sync_rounds[len(sync_rounds) // 2] if sync_rounds else None,
            "class_share": class_shares(rows, classes),
            "clipped": sum(len(r.clipped) for r in rows if not r.final),
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
             f"Path: {result['path']}. Fleet: {result['devices']} devices of `{result.get('fleet', FLEET_CONFIG.name)}`"
             + (" without availability periods" if result["always_online"] else "")
             + (f", {result['seconds_per_sample']} s per sample on a fast device" if result["seconds_per_sample"]
                else "") + f"; a buffered state per {result['buffer']} updates. Target: "
             + (f"{result['target']:.0%}" if result["target"] is not None
                else f"{result['target_fraction']:.0%} of " + (
                    "where the synchronous run's curve ends" if result.get("target_basis") == "curve"
                    else "the synchronous run's final accuracy"))
             + ". Accuracy: the whole fleet's mean latest per-device accuracy, counted only once "
             + ("every device class has" if result.get("target_basis") == "curve"
                else "every device the synchronous run's final evaluation heard has")
             + " reported. Time to target: the first point from which it stays at or above the target to "
               "the run's end "
               "(`naive`: the first touch by whoever had reported, the estimator of earlier tables). "
               "`class share`: each device class's mean share of a state's change (update_share).", "",
             f"| method | seed | mode | rows | updates | mean staleness | {unit} to target | MB to target | "
             f"naive {unit} | curve's end | final accuracy | class share | clipped | host CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in result["runs"]:
        t, b, n = run["time_to_target"], run["bytes_to_target"], run.get("naive_time_to_target")
        end = run.get("curve_end")
        share = ", ".join(f"{k} {v:.1%}" for k, v in run.get("class_share", {}).items())
        mode = run["mode"] + (f" ({run['interval_s']:.1f} s)" if run.get("interval_s") else "")
        lines.append(f"| {run['method']} | {run['seed']} | {mode} | {run['rows']} | {run['updates']} | "
                     f"{run['mean_staleness']:.2f} | {'—' if t is None else f'{t:.1f}'} | "
                     f"{'—' if b is None else f'{b / 1e6:.1f}'} | {'—' if n is None else f'{n:.1f}'} | "
                     f"{'—' if end is None else f'{end:.2%}'} | "
                     f"{run['final_accuracy']:.2%} | {share} | {run.get('clipped', 0)} | {run['host_cpu_s']} |")
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
    p.add_argument("--fleet", type=Path, default=FLEET_CONFIG, help="the fleet's run config (configs/...)")
    p.add_argument("--modes", nargs="*", default=["buffered"], choices=["buffered", "budget"],
                   help="besides sync: buffered (FedBuff) and budget (buffered, each device at most one task per "
                        "--task-interval)")
    p.add_argument("--task-interval", type=float, default=None,
                   help="budget mode's asynchrony.min_task_interval_s (default: the synchronous run's median "
                        "round time: each device sends about as often as in sync)")
    p.add_argument("--devices", type=int, default=50)
    p.add_argument("--methods", nargs="*", default=["fedavg", "fedrep", "fedpick"])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30, help="synchronous rounds; buffered: the same time")
    p.add_argument("--buffer", type=int, default=25, help="updates per buffered state (at most the fleet's size)")
    p.add_argument("--target", type=float, default=None, help="an accuracy to reach (default: --target-fraction)")
    p.add_argument("--target-fraction", type=float, default=0.95,
                   help="the target as a share of where the synchronous run's whole-fleet curve ends (methods end "
                        "far apart)")
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
              "fleet": str(args.fleet.resolve().relative_to(FLEET_CONFIG.parents[1])) if args.fleet.resolve()
              .is_relative_to(FLEET_CONFIG.parents[1]) else str(args.fleet),
              "devices": args.devices, "buffer": args.buffer, "target": args.target,
              "target_fraction": args.target_fraction, "target_basis": "curve", "always_online": args.always_online,
              "seconds_per_sample": args.seconds_per_sample, "set": args.set, "buffered_set": args.buffered_set,
              "runs": runs, "pairs": pairs}
    for method in args.methods:
        for seed in args.seeds:
            sync = run_one(args, method, "sync", seed)
            target = args.target if args.target is not None else args.target_fraction * sync["curve_end"]
            others = []
            for mode in args.modes:
                interval = None
                if mode == "budget":
                    interval = args.task_interval if args.task_interval is not None else sync["median_row_s"]
                others.append(run_one(args, method, mode, seed, budget=sync["curve"][-1][0],
                                      interval=interval))
            for run in (sync, *others):
                run["target"] = target
                run["time_to_target"], run["bytes_to_target"] = to_target(run["curve"], target)
                run["naive_time_to_target"], _ = naive_to_target(run.pop("curve_any"), target)
                runs.append(run)
                print(method, seed, run["mode"], f"target {target:.4f}", run["time_to_target"],
                      run["bytes_to_target"], run["final_accuracy"], run["class_share"], flush=True)
            ts, bs = sync["time_to_target"], sync["bytes_to_target"]
            for run in others:
                tb, bb = run["time_to_target"], run["bytes_to_target"]
                pairs.append({"method": method, "seed": seed, "target": target,
                              "buffered": buffered_variant(result) + (
                                  f" interval {run['interval_s']:.1f} s" if run["interval_s"] else ""),
                              "speedup": ts / tb if ts and tb else None,
                              "bytes_ratio": bb / bs if bs and bb else None,
                              "final_difference_points": 100 * (run["final_accuracy"] - sync["final_accuracy"])})
            write_results(result, args.out, markdown)  # after every pair: a long grid keeps what it measured
    return result


if __name__ == "__main__":
    main()
