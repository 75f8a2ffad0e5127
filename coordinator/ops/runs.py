"""``edgepfl runs``: the runs in a folder, and one run followed as it goes.

::

    edgepfl runs [--dir runs]                 # one line per run: method, rounds, accuracy, state
    edgepfl runs --follow runs/fleet          # its metrics rows as the coordinator writes them

Read from the run directories alone (``metrics.jsonl``, ``run_times.json``, the checkpoint's
``state.json``): it works on the coordinator's machine with or without a coordinator
running, and publishes nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from edgepfl.metrics import MetricsError, RoundMetrics, RunTimes, read_metrics, read_run_times
from edgepfl.state import CheckpointError, read_checkpoint_meta

#: how often ``--follow`` looks for new rows
FOLLOW_EVERY_S = 1.0


def run_state(times: RunTimes) -> str:
    """``running``, ``done``, ``stopped`` (its last session ended before the final evaluation
    is decided by the caller), ``crashed`` (its process is gone without saying so) or
    ``unknown`` (another machine's, still open)."""
    if not times.sessions:
        return "unknown"
    last = times.sessions[-1]
    if last.finished is not None:
        return "done"
    if last.pid is None or last.host != socket.gethostname():
        return "unknown"
    try:
        os.kill(last.pid, 0)
    except ProcessLookupError:
        return "crashed"
    except PermissionError:  # another user's process: it exists
        pass
    return "running"


def _rows(run: Path) -> list[RoundMetrics]:
    path = run / "metrics.jsonl"
    return read_metrics(path, drop_torn_tail=True) if path.is_file() else []


def list_runs(folder: Path) -> str:
    """One line per run directory under ``folder`` (newest first)."""
    runs = sorted((d for d in Path(folder).iterdir() if (d / "metrics.jsonl").is_file() or (d / "checkpoint").is_dir()),
                  key=lambda d: d.stat().st_mtime, reverse=True) if Path(folder).is_dir() else []
    if not runs:
        return f"no runs in {folder}"
    lines = [f"{'run':<28} {'method':<10} {'rounds':>7} {'accuracy':>9}  {'state':<8} started"]
    for run in runs:
        try:
            meta = read_checkpoint_meta(run / "checkpoint")
            rows = _rows(run)
            times = read_run_times(run)
        except (CheckpointError, MetricsError, ValueError) as exc:
            lines.append(f"{run.name:<28} unreadable: {exc}")
            continue
        trained = [r for r in rows if not r.final]
        final = next((r for r in rows if r.final), None)
        shown = final or (trained[-1] if trained else None)
        accuracy = f"{100 * shown.accuracy:.2f}%" if shown is not None and shown.accuracy is not None else "-"
        state = run_state(times)
        if state == "done" and final is None:
            state = "stopped"
        started = time.strftime("%Y-%m-%d %H:%M", time.localtime(times.sessions[0].started)) if times.sessions else "-"
        method = meta.run.method.name if meta is not None else "-"
        lines.append(f"{run.name:<28} {method:<10} {len(trained):>7} {accuracy:>9}{'*' if final else ' '} "
                     f"{state:<8} {started}")
    lines.append("(* the final evaluation)")
    return "\n".join(lines)


def format_row(row: RoundMetrics) -> str:
    """A metrics row as one line."""
    accuracy = f"{100 * row.accuracy:.2f}%" if row.accuracy is not None else "-"
    what = "final evaluation" if row.final else f"round {row.round}"
    extra = f", aborted: {row.abort_reason}" if row.aborted else ""
    return (f"{what:<18} accuracy {accuracy:>7}  {len(row.participants):>4} trained, {len(row.dropped):>3} dropped"
            f"  {row.bytes_up + row.bytes_down:>12,d} bytes  {row.seconds:7.1f} s{extra}")


def follow_run(run: Path, out: Callable[[str], None] = print, every_s: float = FOLLOW_EVERY_S,
               stop: Callable[[], bool] = lambda: False) -> int:
    """Print ``run``'s metrics rows, those written so far and each new one, until its session
    ends (0) or ``stop()``; 3 when ``run`` is no run directory."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file() and not (run / "run_times.json").is_file():
        out(f"{run} is no run directory (no metrics.jsonl or run_times.json yet)")
        return 3
    shown = 0
    while True:
        times = read_run_times(run)
        rows = _rows(run)
        for row in rows[shown:]:
            out(format_row(row))
        shown = len(rows)
        state = run_state(times)
        if state in ("done", "crashed") or stop():
            out(f"the run is {state if state != 'done' or any(r.final for r in rows) else 'stopped'}")
            return 0
        time.sleep(every_s)
