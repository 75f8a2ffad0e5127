"""Virtual time (and bytes) to a target accuracy: buffered asynchronous rounds against
synchronous ones, on an unequal simulated fleet (issue #31).

Runs ``edgepfl simulate --in-process`` on the virtual clock (``simulation:`` device
classes), so the figures are simulated device time, the same on any host. The fleet:
``--devices`` devices on Fashion-MNIST (pathological, 2 classes each), 80 % "fast"
(1 ms per training sample, log-normal spread sigma 0.5) and 20 % "slow" (5x slower,
same spread), links of 10 / 50 Mbit/s. Per method and seed:

* ``sync`` — every device trains every round; a round closes when all answered or at
  ``round_timeout_s`` with a quorum (stragglers' updates folded in late, the default);
* ``buffered`` — FedBuff: a new state every ``--buffer`` updates, at most one per device.

The accuracy curve is the same estimator for both: after each row, the mean over devices
of each device's latest held-out accuracy (a device's accuracy on the state it was last
sent). Time to target is the first cumulative virtual time at which it reaches
``--target``; bytes to target likewise. Both modes see the same number of updates per
device-second of compute, so the comparison is time, not work.

    python benchmarks/async_time_to_accuracy.py --devices 50 --seeds 0 1 2 --methods fedavg fedrep fedpick

Sized by its arguments: ``--devices 20 --seeds 0 --methods fedavg --rounds 15 --buffer 5`` runs
in minutes on a 2-core box; the issue's full comparison (50 devices, 3 seeds, three
methods) is a GPU-lease or overnight job.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time

from edgepfl.config import load_run_config
from edgepfl.coordinator.simulate import simulate
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.metrics import RoundMetrics

try:
    from results_io import write_results
except ImportError:  # run as a module
    from benchmarks.results_io import write_results

FLEET = [
    {"name": "fast", "share": 4, "seconds_per_sample": 0.001, "speed_sigma": 0.5, "uplink_mbps": 10,
     "downlink_mbps": 50},
    {"name": "slow", "share": 1, "seconds_per_sample": 0.005, "speed_sigma": 0.5, "uplink_mbps": 10,
     "downlink_mbps": 50},
]


def curve(rows: list[RoundMetrics]) -> list[tuple[float, int, float]]:
    """(cumulative virtual seconds, cumulative bytes, mean of each device's latest accuracy) per row."""
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


def run_one(method: str, mode: str, seed: int, devices: int, rounds: int, buffer: int) -> dict:
    sets = [f"method.name={method}", "data.dataset=fmnist", "data.partition.kind=pathological",
            "data.partition.classes_per_client=2", "data.samples_per_client=200", f"seed={seed}",
            f"data.seed={seed}", "round_timeout_s=20", f"asynchrony.mode={mode}", f"asynchrony.buffer_size={buffer}"]
    config = load_run_config("configs/fedavg.yaml", sets)
    config = config.model_copy(update={"simulation": config.simulation.model_validate({"devices": FLEET})})
    w0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory() as out:
        rows, _ = simulate(config, devices, out, in_process=local_trainers, rounds=rounds, progress=False)
    points = curve(rows)
    final = next(r for r in rows if r.final)
    return {"method": method, "mode": mode, "seed": seed, "rows": len(points), "curve": points,
            "final_accuracy": final.accuracy, "host_wall_s": round(time.perf_counter() - w0, 1),
            "host_cpu_s": round(time.process_time() - c0, 1)}


def markdown(result: dict) -> str:
    lines = ["# Time to accuracy: buffered vs synchronous rounds (virtual clock)", "",
             f"`{result['command']}` on {result['machine']}", "",
             f"Target: mean latest per-device accuracy {result['target']:.0%}; {result['devices']} devices "
             "(80 % fast, 20 % 5x slower, log-normal spread 0.5); FMNIST pathological, 200 samples each.", "",
             "| method | seed | mode | rows | virtual s to target | MB to target | final accuracy | host CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in result["runs"]:
        t, b = run["time_to_target"], run["bytes_to_target"]
        lines.append(f"| {run['method']} | {run['seed']} | {run['mode']} | {run['rows']} | "
                     f"{'—' if t is None else f'{t:.1f}'} | {'—' if b is None else f'{b / 1e6:.1f}'} | "
                     f"{run['final_accuracy']:.2%} | {run['host_cpu_s']} |")
    lines += ["", "| method | seed | speed-up to target (sync / buffered) | final accuracy difference (points) |",
              "| --- | --- | --- | --- |"]
    for pair in result["pairs"]:
        speed = pair["speedup"]
        lines.append(f"| {pair['method']} | {pair['seed']} | {'—' if speed is None else f'{speed:.2f}x'} | "
                     f"{pair['final_difference_points']:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=50)
    p.add_argument("--methods", nargs="*", default=["fedavg", "fedrep", "fedpick"])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30, help="synchronous rounds; buffered states: rounds x devices / buffer")
    p.add_argument("--buffer", type=int, default=10)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--out", default="benchmarks/results/async_time_to_accuracy")
    args = p.parse_args(argv)
    runs, pairs = [], []
    for method in args.methods:
        for seed in args.seeds:
            # the same number of updates in both modes: rounds x devices
            sync = run_one(method, "sync", seed, args.devices, args.rounds, args.buffer)
            buffered = run_one(method, "buffered", seed, args.devices, args.rounds * args.devices // args.buffer,
                               args.buffer)
            for run in (sync, buffered):
                run["time_to_target"], run["bytes_to_target"] = to_target(run["curve"], args.target)
                runs.append(run)
                print(method, seed, run["mode"], run["time_to_target"], run["final_accuracy"], flush=True)
            ts, tb = sync["time_to_target"], buffered["time_to_target"]
            pairs.append({"method": method, "seed": seed, "speedup": ts / tb if ts and tb else None,
                          "final_difference_points": 100 * (buffered["final_accuracy"] - sync["final_accuracy"])})
    given = sys.argv[1:] if argv is None else argv
    result = {"command": " ".join(["python benchmarks/async_time_to_accuracy.py", *given]),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "devices": args.devices,
              "target": args.target, "runs": runs, "pairs": pairs}
    write_results(result, args.out, markdown)
    return result


if __name__ == "__main__":
    main()
