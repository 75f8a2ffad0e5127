"""The transport's cost: a FedAvg round over MQTT vs in-process, in CPU-seconds and wall time.

    python benchmarks/round_overhead.py --agents 8 --rounds 6 --repeats 2 --out benchmarks/results/round_overhead

Both paths run the same config (FedAvg, Fashion-MNIST, the small CNN) and seed, in one
invocation and interleaved (in-process, MQTT, in-process, MQTT, …), so a load change on
a shared machine hits both. The robust figure is **CPU-seconds per round summed over
every process** — this one (the coordinator, and the in-process agents), the agent
processes and the Mosquitto broker — sampled from ``/proc`` at each round boundary
(a new row in ``metrics.jsonl``). CPU time does not depend on how many other jobs share
the cores; wall time does, and is reported beside it. Round 0 (agents build their
model) and the final evaluation-only round are left out: the figures cover rounds
1..R-1, whose sum telescopes exactly whatever the sampling jitter at each boundary.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgepfl.config import RunConfig, parse_config  # noqa: E402
from edgepfl.coordinator.simulate import simulate  # noqa: E402
from edgepfl.edge_agent.tiers import local_trainers  # noqa: E402
from edgepfl.metrics import RoundMetrics  # noqa: E402

from results_io import write_results  # noqa: E402

CONFIG = {
    "federation": "bench",
    "method": {"name": "fedavg"},
    "model": {"arch": "cnn", "feature_dim": 128},
    "train": {"epochs": 1, "batch_size": 50, "lr": 0.05},
    "data": {"dataset": "fmnist", "samples_per_client": 800, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "round_timeout_s": 300,
}
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of user + system) of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


class CpuMeter:
    """Total CPU-seconds of this process and all its descendants, snapshotted whenever
    ``metrics.jsonl`` in ``run_dir`` gains a row (one snapshot per round boundary).

    Descendants are found by walking /proc's parent links once a second; dead ones keep
    the last CPU figure read, so a process that exits between two samples is counted up
    to its last sample (agents exit only after the run, after the last boundary).
    """

    def __init__(self, run_dir: Path, interval_s: float = 0.1):
        self.run_dir = run_dir
        self.interval_s = interval_s
        self.snapshots: list[float] = []
        self._last: dict[int, float] = {}
        self._pid_set: set[int] = set()
        self._pids_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> CpuMeter:
        self.snapshots = [self.total()]
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _descendants(self) -> set[int]:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                st = _stat(int(entry))
                if st is not None:
                    parents[int(entry)] = st[0]
        tree = {os.getpid()}
        grew = True
        while grew:
            new = {pid for pid, parent in parents.items() if parent in tree} - tree
            tree |= new
            grew = bool(new)
        return tree

    def total(self) -> float:
        for pid in self._pids():
            st = _stat(pid)
            if st is not None:
                self._last[pid] = st[1]
        return sum(self._last.values())

    def _pids(self) -> set[int]:
        now = time.monotonic()
        if now - self._pids_at > 1.0:
            self._pid_set = self._descendants()
            self._pids_at = now
        return self._pid_set

    def _loop(self) -> None:
        metrics = self.run_dir / "metrics.jsonl"
        rows = 0
        while not self._stop.wait(self.interval_s):
            try:
                n = metrics.read_text().count("\n") if metrics.exists() else 0
            except OSError:
                continue
            if n > rows:
                self.snapshots.append(self.total())
                rows = n


def measure(rows: list[RoundMetrics], cpu: list[float], wall: float) -> dict:
    """Rounds 1..R-1 (not round 0, not the final evaluation)."""
    train = [r for r in rows if not r.final]
    steady = [r.seconds for r in train[1:]]
    # snapshots[0] is before round 0; snapshots[k + 1] is when round k's row appeared
    per_round_cpu = [b - a for a, b in zip(cpu[1:len(train)], cpu[2:len(train) + 1])]
    per_agent_up = [r.bytes_up / len(r.participants) for r in train if r.participants]
    per_agent_down = [r.bytes_down / max(1, len(r.participants)) for r in train if r.participants]
    return {
        "round0_seconds": train[0].seconds,
        "median_round_seconds": statistics.median(steady),
        "round_seconds": steady,
        "cpu_seconds_per_round": (cpu[len(train)] - cpu[1]) / len(steady) if len(cpu) > len(train) else None,
        "round_cpu_seconds": per_round_cpu,
        "bytes_up_per_agent_round": statistics.median(per_agent_up),
        "bytes_down_per_agent_round": statistics.median(per_agent_down),
        "shared_param_bytes": train[0].shared_bytes,
        "final_accuracy": rows[-1].accuracy,
        "total_wall_seconds": wall,
    }


def run_once(config: RunConfig, agents: int, out: Path, *, in_process: bool, url: str, threads: int | None) -> dict:
    meter = CpuMeter(out).start()
    t = time.perf_counter()
    try:
        rows, _ = simulate(config, agents, out, in_process=local_trainers if in_process else None, broker=url,
                           progress=False, threads=threads, fresh=False)
    finally:
        meter.stop()
    return measure(rows, meter.snapshots, time.perf_counter() - t)


def markdown(result: dict) -> str:
    lines = [
        f"Command: `{result['command']}`  ",
        f"{result['agents']} agents, {result['rounds']} rounds, FedAvg, FMNIST small CNN; "
        f"{'everything pinned to one core' if result['one_core'] else 'both cores'}; "
        f"load average {result['machine']['load_before'][0]:.2f} before, {result['load_after'][0]:.2f} after.",
        "",
        "| path | repeat | CPU-s / round (all processes) | median wall s / round | bytes up / agent / round | final accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        m = run["result"]
        lines.append(f"| {run['path']} | {run['repeat']} | {m['cpu_seconds_per_round']:.3f} | "
                     f"{m['median_round_seconds']:.3f} | {m['bytes_up_per_agent_round']:,.0f} | "
                     f"{m['final_accuracy']:.4f} |")
    s = result["summary"]
    lines += ["", f"MQTT / in-process, CPU-seconds per round: **{s['cpu_ratio']:.3f}x**; "
                  f"median wall time per round: {s['wall_ratio']:.3f}x; "
                  f"bytes up per agent per round / shared parameter bytes: {s['bytes_ratio_up']:.4f}x, "
                  f"down: {s['bytes_ratio_down']:.4f}x.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved pairs (in-process, MQTT)")
    ap.add_argument("--out", default="benchmarks/results/round_overhead")
    ap.add_argument("--one-core", action="store_true",
                    help="also pin this process, the broker and every agent to CPU 0")
    args = ap.parse_args()
    # One torch thread per agent on both paths: identical arithmetic (the final accuracy
    # must agree to the digit) and no OpenMP spin-waiting inflating either path's CPU time.
    threads = 1
    if args.one_core:
        os.sched_setaffinity(0, {0})  # inherited by the agent and broker processes
    config: RunConfig = parse_config(RunConfig, dict(CONFIG, rounds=args.rounds), "benchmark config")
    work = Path(tempfile.mkdtemp(prefix="edgepfl-bench-"))
    result: dict = {"command": " ".join(["python", "benchmarks/round_overhead.py"] + sys.argv[1:]),
                    "agents": args.agents, "one_core": args.one_core, "rounds": args.rounds, "config": CONFIG,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                "load_before": os.getloadavg()}, "runs": []}
    from edgepfl.testing import MosquittoBroker

    with MosquittoBroker() as broker:
        for repeat in range(args.repeats):
            for path in ("in-process", "mqtt"):
                out = work / f"{path}-{repeat}"
                print(f"{path} #{repeat} ...", file=sys.stderr)
                m = run_once(config, args.agents, out, in_process=path == "in-process", url=broker.url,
                             threads=threads)
                result["runs"].append({"path": path, "repeat": repeat, "result": m})

    def mean(path: str, key: str) -> float:
        return statistics.fmean(r["result"][key] for r in result["runs"] if r["path"] == path)

    mq_up = mean("mqtt", "bytes_up_per_agent_round")
    shared = result["runs"][0]["result"]["shared_param_bytes"]
    result["summary"] = {
        "cpu_ratio": mean("mqtt", "cpu_seconds_per_round") / mean("in-process", "cpu_seconds_per_round"),
        "wall_ratio": mean("mqtt", "median_round_seconds") / mean("in-process", "median_round_seconds"),
        "bytes_ratio_up": mq_up / shared,
        "bytes_ratio_down": mean("mqtt", "bytes_down_per_agent_round") / shared,
    }
    result["load_after"] = os.getloadavg()
    write_results(result, args.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
