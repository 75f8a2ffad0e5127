"""Round wall time over MQTT vs in-process, and bytes per agent per round vs the
shared-parameter bytes (issue 2's transport budget).

    python benchmarks/round_overhead.py --agents 8 --rounds 6 --out benchmarks/results/round_overhead.json

Both runs use the same config (FedAvg, Fashion-MNIST, the small CNN) and seed. Round 0
is reported separately (agents build their model on their first task) and the final
evaluation-only row is left out; the figure is the median of rounds 1..R-1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgepfl.config import RunConfig, parse_config  # noqa: E402
from edgepfl.coordinator.simulate import simulate  # noqa: E402
from edgepfl.metrics import RoundMetrics  # noqa: E402

CONFIG = {
    "federation": "bench",
    "method": {"name": "fedavg"},
    "model": {"arch": "cnn", "feature_dim": 128},
    "train": {"epochs": 1, "batch_size": 50, "lr": 0.05},
    "data": {"dataset": "fmnist", "samples_per_client": 800, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "round_timeout_s": 300,
}


def measure(rows: list[RoundMetrics]) -> dict:
    train = [r for r in rows if not r.final]
    steady = [r.seconds for r in train[1:]]
    per_agent_up = [r.bytes_up / len(r.participants) for r in train if r.participants]
    per_agent_down = [r.bytes_down / max(1, len(r.participants)) for r in train if r.participants]
    return {
        "round0_seconds": train[0].seconds,
        "median_round_seconds": statistics.median(steady),
        "round_seconds": steady,
        "bytes_up_per_agent_round": statistics.median(per_agent_up),
        "bytes_down_per_agent_round": statistics.median(per_agent_down),
        "shared_param_bytes": train[0].shared_bytes,
        "final_accuracy": rows[-1].accuracy,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--broker", default="mosquitto", help="mosquitto (started here), embedded, or mqtt://host:port")
    ap.add_argument("--out", default="benchmarks/results/round_overhead.json")
    ap.add_argument("--one-core", action="store_true",
                    help="pin this process, the broker and every agent to CPU 0 with one torch thread: both paths "
                         "get identical compute, so the ratio isolates the transport's cost")
    args = ap.parse_args()
    threads = None
    if args.one_core:
        os.sched_setaffinity(0, {0})  # inherited by the agent and broker processes
        threads = 1
    config: RunConfig = parse_config(RunConfig, dict(CONFIG, rounds=args.rounds), "benchmark config")
    work = Path(tempfile.mkdtemp(prefix="edgepfl-bench-"))
    result = {"command": " ".join(["python"] + sys.argv), "agents": args.agents, "one_core": args.one_core,
              "rounds": args.rounds, "config": CONFIG, "machine": {"cpus": os.cpu_count(),
              "platform": platform.platform(), "load_before": os.getloadavg()}}

    t = time.perf_counter()
    rows, _ = simulate(config, args.agents, work / "in-process", in_process=True, progress=False, threads=threads)
    result["in_process"] = measure(rows) | {"total_seconds": time.perf_counter() - t}

    broker, url = None, args.broker
    if args.broker == "mosquitto":
        from edgepfl.testing import MosquittoBroker

        broker = MosquittoBroker()
        url = broker.start()
    try:
        t = time.perf_counter()
        rows, _ = simulate(config, args.agents, work / "mqtt", broker=url, progress=False, threads=threads)
        result["mqtt"] = measure(rows) | {"total_seconds": time.perf_counter() - t, "broker": args.broker}
    finally:
        if broker:
            broker.stop()
    ip, mq = result["in_process"], result["mqtt"]
    result["ratio_mqtt_over_in_process"] = mq["median_round_seconds"] / ip["median_round_seconds"]
    result["bytes_ratio_up"] = mq["bytes_up_per_agent_round"] / mq["shared_param_bytes"]
    result["bytes_ratio_down"] = mq["bytes_down_per_agent_round"] / mq["shared_param_bytes"]
    result["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("config",)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
