"""How many agents one coordinator serves: the real coordinator, Mosquitto and virtual agents.

    python benchmarks/capacity.py --agents 10 100 1000 5000 --rounds 4 --out benchmarks/results/capacity
    python benchmarks/capacity.py --agents 1000 --fraction 0.1 --eval-fraction 0.1 --out ...

Per fleet size N it starts a Mosquitto sized for N (``max_queued_messages 0``: a
restarting coordinator must get every agent's retained status; the fd limit raised to
the hard limit, which the broker inherits), N virtual agents (``benchmarks/loadgen.py``:
one MQTT connection each, ``--local-work-s`` of simulated work per task), then the
real ``edgepfl coordinator`` process on a FedAvg run (the model from ``--arch`` /
``--feature-dim``; ``min_agents`` = N, so round 0 starts with everyone), and measures:

* round time (the coordinator's own ``seconds`` per row of ``metrics.jsonl``);
* coordinator CPU-seconds per agent-round: user + system time of the coordinator
  process from ``/proc/<pid>/stat``, snapshotted when each row appears, divided by the
  tasks of the round (CPU time does not depend on the other jobs sharing the cores,
  wall time does: both are reported);
* peak RSS of the coordinator and of the broker (``VmHWM`` from ``/proc/<pid>/status``)
  up to the final evaluation's row (the coordinator's report after it, which imports
  matplotlib, is left out);
* bytes per round (down: tasks; up: answers, as the coordinator counts them).

Round 0 (the coordinator's first round, with its warm-up) and the final
evaluation-only round are left out of the per-round figures: they cover rounds 1..R-1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import LoadGenerator, raise_fd_limit  # noqa: E402

from edgepfl.metrics import read_metrics  # noqa: E402
from edgepfl.testing import MosquittoBroker  # noqa: E402

from results_io import write_results  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def peak_rss_bytes(pid: int) -> int | None:
    """``VmHWM``: the process's peak resident set so far."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Meter:
    """Samples the coordinator's CPU at every new metrics row, and both processes' peak RSS
    until the last row (the final evaluation's) is written: what the coordinator does after
    the rounds (its report, with matplotlib) is not the fleet's cost."""

    def __init__(self, coordinator: int, broker: int, metrics: Path, rows: int, interval_s: float = 0.05):
        self.coordinator, self.broker, self.metrics = coordinator, broker, metrics
        self.rows = rows
        self.interval_s = interval_s
        self.cpu_at_row: list[float] = []  # CPU-seconds when row i appeared
        self.cpu_start = cpu_seconds(coordinator) or 0.0
        self.peak = {"coordinator": 0, "broker": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> Meter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        last_cpu = self.cpu_start
        while not self._stop.is_set():
            cpu = cpu_seconds(self.coordinator)
            if cpu is not None:
                last_cpu = cpu
            for name, pid in (("coordinator", self.coordinator), ("broker", self.broker)):
                rss = peak_rss_bytes(pid)
                if rss:
                    self.peak[name] = max(self.peak[name], rss)
            rows = self._rows()
            while len(self.cpu_at_row) < rows:
                self.cpu_at_row.append(last_cpu)
            if rows >= self.rows:
                return
            time.sleep(self.interval_s)

    def _rows(self) -> int:
        try:
            with self.metrics.open("rb") as fh:
                return sum(1 for _ in fh)
        except OSError:
            return 0


def run_config(n: int, args: argparse.Namespace, federation: str) -> dict:
    return {
        "federation": federation,
        "method": {"name": "fedavg"},
        "model": {"arch": args.arch, "feature_dim": args.feature_dim},
        "input_shape": [1, 28, 28],
        "num_classes": 10,
        "device": "cpu",
        "rounds": args.rounds,
        "fraction": args.fraction,
        "eval_fraction": args.eval_fraction,
        "min_agents": n,
        "expected_agents": n,
        # the default quorum: a round closes at its timeout even if an agent lost its task
        "quorum": 0.5,
        "round_timeout_s": args.round_timeout_s,
        "wait_for_agents_s": 600,
    }


def run_metered(coordinator: Sequence[str], config_path: Path, broker: MosquittoBroker, run_dir: Path, rounds: int,
                timeout_s: float, what: str) -> Meter:
    """Run the coordinator command on ``config_path`` against ``broker`` until it exits (killed
    after ``timeout_s``), its output in ``run_dir/out`` and its log beside; its :class:`Meter`.
    RuntimeError naming ``what`` (the fleet) when it does not exit 0."""
    assert broker._proc is not None
    with open(run_dir / "coordinator.log", "w") as log:
        proc = subprocess.Popen(
            [*coordinator, "--log-level", "warning", "coordinator", "--config",
             str(config_path), "--broker", broker.url, "--out", str(run_dir / "out")],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
        meter = Meter(proc.pid, broker._proc.pid, run_dir / "out" / "metrics.jsonl", rounds + 1).start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        meter.stop()
    if code != 0:
        raise RuntimeError(f"coordinator exited {code} at {what}; see {run_dir / 'coordinator.log'}")
    return meter


def measure(n: int, args: argparse.Namespace, work: Path,
            coordinator: Sequence[str] = (sys.executable, "-m", "edgepfl.cli")) -> dict:
    """One fleet of ``n`` virtual agents and the coordinator command ``coordinator`` (the
    ``edgepfl`` command line, or one that runs it with something changed: ``exact_sum_cost.py``)."""
    federation = f"cap{n}"
    run_dir = work / f"n{n}"
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "run.yaml"
    config_path.write_text(yaml.safe_dump(run_config(n, args, federation)))
    raise_fd_limit()  # the broker started next inherits it
    with MosquittoBroker(max_queued_messages=0, extra_config="max_connections -1") as broker:
        assert broker._proc is not None
        started = time.monotonic()
        with LoadGenerator(broker.url, federation, n, processes=args.processes, local_work_s=args.local_work_s,
                           log_dir=run_dir) as gen:
            connect_s = time.monotonic() - started
            meter = run_metered(coordinator, config_path, broker, run_dir, args.rounds, args.timeout_s, f"N={n}")
            stats = gen.stop()
    rows = read_metrics(run_dir / "out" / "metrics.jsonl")
    training = [r for r in rows if not r.final and r.round >= 1]
    cpu = meter.cpu_at_row
    per_round = []
    for row in training:
        i = rows.index(row)
        tasks = row.evaluated + len(row.dropped)
        per_round.append({
            "round": row.round, "seconds": row.seconds, "cpu_s": round(cpu[i] - cpu[i - 1], 3), "tasks": tasks,
            "bytes_down": row.bytes_down, "bytes_up": row.bytes_up, "participants": len(row.participants),
            "evaluated": row.evaluated, "dropped": len(row.dropped),
        })
    tasks = sum(r["tasks"] for r in per_round)
    cpu_total = sum(r["cpu_s"] for r in per_round)
    return {
        "agents": n,
        "fraction": args.fraction,
        "eval_fraction": args.eval_fraction,
        "connect_s": round(connect_s, 1),
        "round_s": round(sum(r["seconds"] for r in per_round) / len(per_round), 3),
        "coordinator_cpu_s_per_round": round(cpu_total / len(per_round), 3),
        "coordinator_cpu_ms_per_agent_round": round(1000 * cpu_total / tasks, 3),
        "coordinator_peak_rss_mb": round(meter.peak["coordinator"] / 2**20, 1),
        "broker_peak_rss_mb": round(meter.peak["broker"] / 2**20, 1),
        "bytes_per_round": round(sum(r["bytes_down"] + r["bytes_up"] for r in per_round) / len(per_round)),
        "shared_bytes": rows[-1].shared_bytes,
        "rounds": per_round,
        "loadgen": stats,
    }


def markdown(result: dict) -> str:
    lines = [
        f"Capacity: FedAvg, {result['model']}, {result['rounds']} rounds (per-round figures: rounds 1..R-1), "
        f"{result['local_work_s']} s local work, {result['processes']} loadgen processes; {result['machine']}",
        "",
        "| agents | fraction | eval_fraction | round s (wall) | coordinator CPU s / round | CPU ms / agent-round "
        "| coordinator peak RSS MB | broker peak RSS MB | MB / round | connect s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['agents']} | {r['fraction']} | {r['eval_fraction']} | {r['round_s']} | "
            f"{r['coordinator_cpu_s_per_round']} | {r['coordinator_cpu_ms_per_agent_round']} | "
            f"{r['coordinator_peak_rss_mb']} | {r['broker_peak_rss_mb']} | {r['bytes_per_round'] / 1e6:.1f} | "
            f"{r['connect_s']} |")
    return "\n".join(lines) + "\n"


def add_fleet_arguments(ap: argparse.ArgumentParser, timeout_s: float, per: str) -> None:
    """The options of a virtual fleet's run (:func:`measure`), shared with the scripts built on it."""
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--eval-fraction", type=float, default=1.0)
    ap.add_argument("--arch", default="cnn")
    ap.add_argument("--feature-dim", type=int, default=32)
    ap.add_argument("--local-work-s", type=float, default=0.1)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--round-timeout-s", type=float, default=180)
    ap.add_argument("--timeout-s", type=float, default=timeout_s, help=per)
    ap.add_argument("--out", default=None, help="results path without suffix (.json and .md are written)")
    ap.add_argument("--work", default=None, help="where runs and logs go (default: a temporary directory)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--rounds", type=int, default=4)
    add_fleet_arguments(ap, timeout_s=1800, per="per fleet size")
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="edgepfl-capacity-"))
    runs = []
    for n in args.agents:
        run = measure(n, args, work)
        print(json.dumps({k: v for k, v in run.items() if k != "rounds"}), flush=True)
        runs.append(run)
    result = {
        "command": "python benchmarks/capacity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": f"{args.arch} feature_dim {args.feature_dim}",
        "rounds": args.rounds,
        "local_work_s": args.local_work_s,
        "processes": args.processes,
        "machine": f"{platform.node()}: {os.cpu_count()} cores shared with other jobs, {platform.python_version()}",
        "runs": runs,
    }
    if args.out:
        write_results(result, args.out, markdown)
    else:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
