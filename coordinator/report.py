"""Turn a run's ``metrics.jsonl`` into a summary, a table and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgepfl.atomic import write_json
from edgepfl.metrics import RoundMetrics, read_metrics

__all__ = ["format_table", "plot_accuracy", "read_metrics", "summarize", "write_report"]


def summarize(rows: list[RoundMetrics], target: float | None = None) -> dict[str, Any]:
    """Final and best personalized accuracy (always labelled), bytes, time; optionally
    the cumulative bytes sent until ``target`` accuracy was first reached."""
    # (accuracy, row) pairs: the filter narrows the accuracy to float for max's key.
    scored = [(r.accuracy, r) for r in rows if r.accuracy is not None]
    final = next((r for r in reversed(rows) if r.final), scored[-1][1] if scored else None)
    best = max(scored, key=lambda pair: pair[0])[1] if scored else None
    train_rows = [r for r in rows if not r.final]
    out: dict[str, Any] = {
        "rounds": len(train_rows),
        "final_accuracy": final.accuracy if final else None,
        "final_round": final.round if final else None,
        "best_accuracy": best.accuracy if best else None,
        "best_round": best.round if best else None,
        "final_per_client": dict(final.per_client) if final else {},
        "bytes_up": sum(r.bytes_up for r in rows),
        "bytes_down": sum(r.bytes_down for r in rows),
        "seconds": round(sum(r.seconds for r in rows), 2),
        "mean_round_seconds": round(sum(r.seconds for r in train_rows) / len(train_rows), 3) if train_rows else None,
        "rejected": _sum_counts(r.rejected for r in rows),
        "dropped": sum(len(r.dropped) for r in rows),
    }
    if target is not None:
        sent = 0
        out["target_accuracy"] = target
        out["bytes_to_target"] = None
        for r in rows:
            if r.accuracy is not None and r.accuracy >= target:
                out["bytes_to_target"] = sent
                break
            sent += r.bytes_up + r.bytes_down
    return out


def _sum_counts(dicts) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def format_table(rows: list[RoundMetrics], summary: dict, method: str = "", head_reports: dict | None = None) -> str:
    """A plain-text results table a person can read in a terminal."""
    lines = []
    title = f"Results{' — ' + method if method else ''}"
    lines.append(title)
    lines.append("=" * len(title))
    lines.append(f"{'round':>6} {'accuracy':>9} {'trained':>8} {'evaluated':>9} {'MB up':>8} {'MB down':>8} {'seconds':>8}")
    for r in rows:
        acc = "-" if r.accuracy is None else f"{r.accuracy:.2%}"
        label = "final" if r.final else str(r.round)
        lines.append(f"{label:>6} {acc:>9} {len(r.participants):>8} {r.evaluated:>9} "
                     f"{r.bytes_up / 1e6:>8.2f} {r.bytes_down / 1e6:>8.2f} {r.seconds:>8.2f}")
    lines.append("")
    fa, ba = summary.get("final_accuracy"), summary.get("best_accuracy")
    lines.append(f"final accuracy (after round {summary.get('rounds')}): {'-' if fa is None else f'{fa:.2%}'}")
    lines.append(f"best accuracy (round {summary.get('best_round')}):  {'-' if ba is None else f'{ba:.2%}'}")
    per_client = summary.get("final_per_client") or {}
    if per_client:
        lines.append("per-client final accuracy: " + ", ".join(
            f"{a} {v:.1%}" for a, v in per_client.items() if v is not None))
    if head_reports:
        lines.append("head-tier agents: " + ", ".join(
            f"{a} ({r.get('head')}) {r['accuracy']:.1%}" for a, r in sorted(head_reports.items())
            if r.get("accuracy") is not None))
    if summary.get("rejected"):
        lines.append(f"rejected messages: {summary['rejected']}")
    lines.append(f"traffic: {summary['bytes_up'] / 1e6:.1f} MB up, {summary['bytes_down'] / 1e6:.1f} MB down; "
                 f"wall time {summary['seconds']:.1f}s")
    return "\n".join(lines)


def plot_accuracy(rows: list[RoundMetrics], path: str | Path, title: str = "") -> Path:
    """Accuracy per round (federation mean and each client) and final per-client bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    scored = [r for r in rows if r.accuracy is not None]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    clients = sorted({a for r in scored for a in r.per_client})
    for a in clients:
        pts = [(r.round, r.per_client[a]) for r in scored if r.per_client.get(a) is not None]
        if pts:
            ax.plot(*zip(*pts), color="0.75", linewidth=0.8, zorder=1)
    ax.plot([r.round for r in scored], [r.accuracy for r in scored], "o-", color="C0", linewidth=2,
            label="sample-weighted personalized accuracy", zorder=2)
    ax.plot([], [], color="0.75", label="individual clients")
    ax.set_xlabel("round (evaluated at the start of the round; last = after training)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "personalized accuracy per round")
    final = next((r for r in reversed(rows) if r.final), scored[-1] if scored else None)
    if final:
        names = [a for a, v in final.per_client.items() if v is not None]
        bx.barh(names, [final.per_client[a] for a in names], color="C0")
        bx.set_xlim(0, 1)
        bx.set_title("final accuracy per client")
        bx.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path, method: str = "", head_reports: dict | None = None) -> tuple[str, dict]:
    """summary.json + accuracy.png + results.txt in the run directory; returns (table, summary)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    summary = summarize(rows)
    if head_reports:
        summary["head_tier"] = head_reports
    write_json(run_dir / "summary.json", summary)
    if any(r.accuracy is not None for r in rows):
        plot_accuracy(rows, run_dir / "accuracy.png", title=f"{method} — personalized accuracy" if method else "")
    table = format_table(rows, summary, method, head_reports)
    (run_dir / "results.txt").write_text(table + "\n")
    return table, summary
