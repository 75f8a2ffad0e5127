"""A whole head device under a memory cap: the head agent, its fit child, ``serve`` and
``predict`` in one memory cgroup, at several caps, with the page cache warm and cold.

The scenario is ``tests/head_device.py``'s (the 150 MB test runs it once): a live FedAvg
federation on Fashion-MNIST (Mosquitto on loopback, two trainer agents, the coordinator)
releases its encoder; a head agent from a torch-free ``[agent]`` environment, holding about
3,700 of its own images in a ``.npz``, installs it, fits an SVM head in its fit child and
reports; ``serve`` and ``predict`` then run beside it. Each cell is one run in a new cgroup:

* ``warm``: the environment's libraries are in the page cache already (charged elsewhere),
  so the cap bounds what the processes allocate: the issue's measurement;
* ``cold``: the page cache is emptied first (``/proc/sys/vm/drop_caches``), so every
  library page the device reads is charged to its cgroup, as on a board after boot; under
  a tight cap the kernel then evicts and reads library pages again (slower, not killed).

Per cell: whether the report arrived, seconds from the agent's start to it, whether serve
and predict answered, the cgroup's peak (``memory.max_usage_in_bytes`` / ``memory.peak``),
the most anonymous memory sampled every 50 ms, and the kernel's OOM kills.

Needs root (cgroups, drop_caches), Mosquitto, Fashion-MNIST and this checkout's ``[train]``
environment (the coordinator and trainers).

Usage::

    .venv/bin/python benchmarks/device_memory.py                       # builds the [agent] venv
    .venv/bin/python benchmarks/device_memory.py --venv /tmp/light --caps 150,160,none

Writes ``benchmarks/results/device_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/ (the scenario and its helpers)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import write_results  # noqa: E402

MB = 10**6


def agent_venv(path: Path) -> Path:
    """A torch-free environment with this checkout's wheel and ``[agent]``: its ``bin``."""
    if not (path / "bin" / "edgepfl").exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", f"{REPO}[agent]"], check=True)
    return path / "bin"


def measure(venv_bin: Path, caps: list[int | None], caches: list[str]) -> list[dict]:
    from edgepfl.testing.brokers import MosquittoBroker

    from tests.head_device import run_head_device
    from tests.memory_cgroup import new_memory_cgroup

    rows = []
    broker = MosquittoBroker()
    broker.start()
    try:
        for cache in caches:
            for cap in caps:
                group = new_memory_cgroup(cap)
                with tempfile.TemporaryDirectory(prefix="device-memory-") as work:
                    try:
                        run = run_head_device(venv_bin, group, broker.url, Path(work), drop_page_cache=cache == "cold")
                    finally:
                        group.remove()
                row = {
                    "cache": cache, "cap_mb": cap / MB if cap else None,
                    "reported": run.report is not None,
                    "accuracy": run.report["accuracy"] if run.report else None,
                    "install_s": round(run.install_seconds, 1) if run.install_seconds else None,
                    "serve": run.serve is not None, "predict": run.predict_lines,
                    "peak_mib": round(run.peak_bytes / 2**20, 1),
                    "anon_peak_mib": round(run.anon_peak_bytes / 2**20, 1),
                    "oom_kills": run.oom_kills, "agent_survived": run.agent_survived,
                }
                rows.append(row)
                print(row, flush=True)
    finally:
        broker.stop()
    return rows


def markdown(result: dict) -> str:
    lines = [
        "# A whole head device under a memory cap (issue 53)", "",
        f"Command: `{result['command']}` ({result['when']}; {result['host']}).", "",
        "Head agent + fit child (SVM, C cross-validated) + `serve` + `predict` in one memory cgroup; "
        "about 3,700 Fashion-MNIST images of the device's own; `warm`: libraries already in the page cache, "
        "`cold`: page cache emptied first (every library page charged to the device).", "",
        "| page cache | cap | reported | start to report | serve / predict | peak | anonymous peak | OOM kills |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cap = f"{r['cap_mb']:.0f} MB" if r["cap_mb"] else "none"
        reported = f"yes ({r['accuracy']:.3f})" if r["reported"] else "**no**"
        took = f"{r['install_s']} s" if r["install_s"] else "–"
        served = f"{'yes' if r['serve'] else 'no'} / {r['predict']}"
        lines.append(f"| {r['cache']} | {cap} | {reported} | {took} | {served} | {r['peak_mib']} MiB | "
                     f"{r['anon_peak_mib']} MiB | {r['oom_kills']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=None, help="a torch-free [agent] environment (default: built)")
    parser.add_argument("--caps", default="150,160,none", help="caps in MB (10^6 bytes), 'none' for no cap")
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or both")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "device_memory"))
    ns = parser.parse_args(argv)
    try:
        caps = [None if c.strip() == "none" else int(float(c) * MB) for c in ns.caps.split(",")]
    except ValueError:
        print(f"device_memory: --caps must be numbers or 'none', got {ns.caps!r}", file=sys.stderr)
        return 2
    caches = [c.strip() for c in ns.cache.split(",")]
    if not set(caches) <= {"warm", "cold"} or os.geteuid() != 0:
        print("device_memory: --cache takes warm and/or cold, and the script needs root (cgroups)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="device-venv-") as tmp:
        venv_bin = agent_venv(ns.venv or Path(tmp) / "venv")
        rows = measure(venv_bin, caps, caches)
    result = {"command": "python benchmarks/device_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host": f"{platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}", "rows": rows}
    write_results(result, ns.out, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
