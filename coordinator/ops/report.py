"""Turn a run's ``metrics.jsonl`` into a summary, a table and plots.

Rounds are numbered from 0 everywhere (``metrics.jsonl``, progress, the fleet view, this
report); the final evaluation's row has ``round`` = the number of rounds. Wall time is
the real elapsed time of the coordinator sessions (``run_times.json``), not the sum of
round times. Head-tier accuracy is the latest release's, labelled with its id;
``head_metrics.json`` keeps every release's reports.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgepfl.atomic import write_bytes, write_json
from edgepfl.metrics import (
    ReleaseReports,
    RoundMetrics,
    RunTimes,
    latest_release,
    read_head_metrics,
    read_metrics,
    read_run_times,
)

__all__ = ["accuracy_figure", "format_table", "plot_accuracy", "read_metrics", "summarize", "write_report"]

#: above this many clients the figure shows the spread of their accuracies (percentile
#: bands, a histogram) instead of a line and a bar per client
PER_CLIENT_LIMIT = 30


def summarize(rows: list[RoundMetrics], targets: Sequence[float] = (), times: RunTimes | None = None,
              head: dict[str, ReleaseReports] | None = None) -> dict[str, Any]:
    """Final and best personalized accuracy (always labelled), bytes (by direction, and the
    training updates' by codec), time; and the bytes it took to reach each accuracy of
    ``targets`` (:func:`bytes_to_accuracy`; none given: 90, 95 and 99 % of the best accuracy).

    ``times``: the run's sessions (wall time; None: unknown); ``head``: head-tier reports
    by release (the latest release's go into ``head_tier``)."""
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
        "update_bytes": _sum_counts(r.update_bytes for r in rows),
        "task_bytes": _sum_counts(r.task_bytes for r in rows),
        "round_seconds": round(sum(r.seconds for r in rows), 2),
        # in-process runs: the rows' seconds are simulated device time (run_times.json says per session)
        "round_clock": "virtual" if times and any(s.virtual_clock for s in times.sessions) else "wall",
        "wall_seconds": None if times is None or times.wall_seconds() is None else round(times.wall_seconds() or 0, 2),
        "sessions": len(times.sessions) if times else 0,
        "resumed": bool(times and any(s.resumed_from is not None for s in times.sessions)),
        "mean_round_seconds": round(sum(r.seconds for r in train_rows) / len(train_rows), 3) if train_rows else None,
        "rejected": _sum_counts(r.rejected for r in rows),
        "refused": _sum_counts(r.refused for r in rows),
        "dropped": sum(len(r.dropped) for r in rows),
    }
    private = [r.privacy for r in rows if r.privacy is not None]
    if private:
        last = private[-1]
        out["privacy"] = {"mechanism": last.mechanism, "epsilon": last.epsilon, "delta": last.delta,
                          "rounds": len(private), "noise_multiplier": last.noise_multiplier,
                          "clip_norm": last.clip_norm}
    secure = [r.secure for r in rows if r.secure is not None]
    if secure:
        out["secure_aggregation"] = {"rounds": len(secure), "unmasked": sum(s.unmasked for s in secure),
                                     "masks_removed": sum(s.recovered for s in secure),
                                     "step_bytes": sum(s.bytes_up + s.bytes_down for s in secure),
                                     "split": sum(s.groups > 1 for s in secure),
                                     "set_aside": sum(s.set_aside for s in secure),
                                     "not_unmasked": sum(s.not_unmasked for s in secure)}
    latest = latest_release(head or {})
    if latest is not None:
        release_id, entry = latest
        out["head_tier"] = {"release": release_id, "round": entry.round, "accuracy": entry.accuracy(),
                            "agents": {a: r.model_dump(mode="json") for a, r in entry.reports.items()}}
        # every release's frames sent to head agents, by form: the head tier's share of the run's bytes
        forms = {form: sum(each.sent_bytes.get(form, 0) for each in (head or {}).values())
                 for form in ("whole", "delta", "restore", "retained")}
        out["release_bytes"] = {"total": sum(forms.values()), **forms}
    if not targets and best is not None and best.accuracy:
        out["targets_from"] = "best accuracy"
        out["to_accuracy"] = [{**bytes_to_accuracy(rows, round(best.accuracy * share, 4)), "share_of_best": share}
                              for share in DEFAULT_TARGET_SHARES]
    else:
        out["to_accuracy"] = [bytes_to_accuracy(rows, t) for t in targets]
    return out


#: without targets asked for, the report's bytes-to-accuracy rows are at these shares of the best accuracy
DEFAULT_TARGET_SHARES = (0.9, 0.95, 0.99)


def bytes_to_accuracy(rows: list[RoundMetrics], target: float) -> dict[str, Any]:
    """What it took to reach ``target`` accuracy: the first row (round) whose accuracy is at
    least ``target``, and the bytes of the rows before it, by direction — the traffic that
    made the state it evaluated (DualFed's communication-cost figure). ``round`` None: never
    reached (the bytes are then the whole run's)."""
    up = down = 0
    for r in rows:
        if r.accuracy is not None and r.accuracy >= target:
            return {"target": target, "round": "final" if r.final else r.round, "bytes_up": up, "bytes_down": down,
                    "bytes": up + down}
        up, down = up + r.bytes_up, down + r.bytes_down
    return {"target": target, "round": None, "bytes_up": up, "bytes_down": down, "bytes": up + down}


def _sum_counts(dicts) -> dict[str, int]:
    total: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def format_table(rows: list[RoundMetrics], summary: dict, method: str = "") -> str:
    """A plain-text results table a person can read in a terminal."""
    lines = []
    title = f"Results{' — ' + method if method else ''}"
    lines.append(title)
    lines.append("=" * len(title))
    lines.append(f"{'round':>6} {'accuracy':>9} {'trained':>8} {'evaluated':>9} {'MB up':>8} {'MB down':>8} {'seconds':>8}")
    for r in rows:
        acc = "-" if r.accuracy is None else f"{r.accuracy:.2%}"
        label = "final" if r.final else str(r.round)
        # a summary site is one participant of many updates: the column counts updates
        trained = sum(s.trained for s in r.sites.values()) if r.sites else len(r.participants) + len(r.late)
        lines.append(f"{label:>6} {acc:>9} {trained:>8} {r.evaluated:>9} "
                     f"{r.bytes_up / 1e6:>8.2f} {r.bytes_down / 1e6:>8.2f} {r.seconds:>8.2f}")
    lines.append("")
    fa, ba = summary.get("final_accuracy"), summary.get("best_accuracy")
    last = (summary.get("rounds") or 0) - 1
    lines.append(f"final accuracy (after round {last}, the last): {'-' if fa is None else f'{fa:.2%}'}")
    # the same row label as the table: the final evaluation's row is "final", not round R
    best_round = summary.get("best_round")
    best_row = "final" if best_round is not None and best_round > last else best_round
    lines.append(f"best accuracy (table row {best_row}):  {'-' if ba is None else f'{ba:.2%}'}")
    per_client = summary.get("final_per_client") or {}
    if per_client:
        lines.append("per-client final accuracy: " + ", ".join(
            f"{a} {v:.1%}" for a, v in per_client.items() if v is not None))
    head = summary.get("head_tier")
    if head:
        acc = head.get("accuracy")
        lines.append(f"head-tier agents, release {head['release']}"
                     + (f" (encoder after round {head['round']})" if head.get("round") is not None else "")
                     + (f": {acc:.2%} overall; " if acc is not None else ": ") + ", ".join(
                         f"{a} ({r.get('head')}) {r['accuracy']:.1%}" for a, r in sorted(head["agents"].items())
                         if r.get("accuracy") is not None))
        lines.extend(f"  {a} did not install release {r.get('release_id')}: {r['refused']}"
                     for a, r in sorted(head["agents"].items()) if r.get("refused"))
    sent = summary.get("release_bytes")
    if sent and sent["total"]:
        lines.append(f"releases sent to head agents: {sent['total'] / 1e6:.2f} MB ("
                     + ", ".join(f"{n / 1e6:.2f} MB {form}" for form, n in sent.items() if form != "total" and n)
                     + "; a retained copy the broker sends on to each agent that takes it)")
    if summary.get("rejected"):
        lines.append(f"rejected messages: {summary['rejected']}")
    if summary.get("refused"):
        lines.append(f"refused tasks: {summary['refused']}")
    privacy = summary.get("privacy")
    if privacy:
        spent = "unbounded (no noise)" if privacy["epsilon"] is None else f"{privacy['epsilon']:.3f}"
        lines.append(f"differential privacy ({privacy['mechanism']}): ε = {spent} at δ = "
                     f"{privacy['delta']:g} after {privacy['rounds']} rounds (noise multiplier "
                     f"{privacy['noise_multiplier']:g}, clip {privacy['clip_norm']:g}); personal parameters and heads "
                     "are outside it")
    secure = summary.get("secure_aggregation")
    if secure:
        lines.append(f"secure aggregation: {secure['rounds']} rounds, the coordinator saw only their sums "
                     f"({secure['unmasked']} unmasked; {secure['masks_removed']} dropped devices' masks removed; "
                     f"{secure['step_bytes'] / 1e6:.1f} MB of steps)")
        if secure.get("split") or secure.get("set_aside") or secure.get("not_unmasked"):
            # older summaries have none of these: a run before groups
            lines.append(f"secure groups: {secure.get('split', 0)} rounds split into groups; "
                         f"{secure.get('set_aside', 0)} group sums past the bounds set aside; "
                         f"{secure.get('not_unmasked', 0)} groups lost to dropouts")
    summaries = [r.sites for r in rows if r.sites and not r.final]
    if summaries:
        names = sorted({site for row in summaries for site in row})
        totals = {k: sum(getattr(s, k) for row in summaries for s in row.values())
                  for k in ("sampled", "trained", "dropped", "clipped")}
        lines.append(f"summary sites ({', '.join(names)}): over {len(summaries)} rounds they drew {totals['sampled']} "
                     f"devices to train, summed {totals['trained']} updates ({totals['clipped']} clipped), "
                     f"{totals['dropped']} devices did not answer; the evaluated column counts sites")
    for reach in summary.get("to_accuracy") or []:
        share = reach.get("share_of_best")
        to = f"{share:.0%} of the best ({reach['target']:.2%})" if share else f"{reach['target']:.2%}"
        where = "not reached" if reach["round"] is None else f"reached at row {reach['round']}"
        lines.append(f"to accuracy {to}: {where}, after {reach['bytes'] / 1e6:.1f} MB "
                     f"({reach['bytes_up'] / 1e6:.1f} up, {reach['bytes_down'] / 1e6:.1f} down)")
    codecs = summary.get("update_bytes") or {}
    if set(codecs) - {"uncompressed"}:
        lines.append("training updates by codec: " + ", ".join(f"{c} {b / 1e6:.1f} MB" for c, b in sorted(codecs.items())))
    tasks = summary.get("task_bytes") or {}
    if set(tasks) - {"whole"}:
        lines.append("tasks by codec: " + ", ".join(f"{c} {b / 1e6:.1f} MB" for c, b in sorted(tasks.items())))
    wall = summary.get("wall_seconds")
    sessions = summary.get("sessions") or 0
    lines.append(f"traffic: {summary['bytes_up'] / 1e6:.1f} MB up, {summary['bytes_down'] / 1e6:.1f} MB down; "
                 + ("wall time unknown (no run_times.json)" if wall is None else f"wall time {wall:.1f}s")
                 + (f" over {sessions} sessions (resumed)" if summary.get("resumed") else "")
                 + f"; {summary['round_seconds']:.1f}s inside rounds"
                 + (" (virtual: the simulated devices' time)" if summary.get("round_clock") == "virtual" else ""))
    return "\n".join(lines)


def plot_accuracy(rows: list[RoundMetrics], path: str | Path, title: str = "",
                  head: dict[str, ReleaseReports] | None = None) -> Path:
    """Write :func:`accuracy_figure` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig = accuracy_figure(rows, title, head)
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    write_bytes(path, image.getvalue())
    plt.close(fig)
    return path


def accuracy_figure(rows: list[RoundMetrics], title: str = "", head: dict[str, ReleaseReports] | None = None):
    """Accuracy per round and the clients' final accuracies, readable at any fleet size.

    Up to :data:`PER_CLIENT_LIMIT` clients: a line per client and a bar per client. Beyond
    it: the 10-90 and 25-75 percentile bands of the clients' accuracies per round and a
    histogram of their final accuracies. Releases (``head``) are marked at their round,
    with the head tier's accuracy on each.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scored = [r for r in rows if r.accuracy is not None]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    clients = sorted({a for r in scored for a in r.per_client})
    many = len(clients) > PER_CLIENT_LIMIT
    if many:
        pts = [(r.round, [v for v in r.per_client.values() if v is not None]) for r in scored]
        pts = [(x, vs) for x, vs in pts if vs]
        xs = [x for x, _ in pts]
        for (lo, hi), shade in (((10, 90), 0.85), ((25, 75), 0.7)):
            ax.fill_between(xs, [np.percentile(vs, lo) for _, vs in pts], [np.percentile(vs, hi) for _, vs in pts],
                            color=str(shade), label=f"clients, {lo}th-{hi}th percentile", zorder=1)
    else:
        for a in clients:
            client_pts = [(r.round, r.per_client[a]) for r in scored if r.per_client.get(a) is not None]
            if client_pts:
                ax.plot(*zip(*client_pts), color="0.75", linewidth=0.8, zorder=1)
        ax.plot([], [], color="0.75", label="individual clients")
    ax.plot([r.round for r in scored], [r.accuracy for r in scored], "o-", color="C0", linewidth=2,
            label="sample-weighted personalized accuracy", zorder=2)
    for i, (release_id, entry) in enumerate(sorted((head or {}).items(), key=lambda kv: kv[1].round or -1)):
        if entry.round is None:
            continue
        # the release holds the encoder after round r: it is marked where round r + 1 starts
        ax.axvline(entry.round + 1, color="C2", linestyle="--", linewidth=1, zorder=0,
                   label="encoder release" if i == 0 else None)
        acc = entry.accuracy()
        if acc is not None:
            ax.plot([entry.round + 1], [acc], "D", color="C2", markersize=7, zorder=3,
                    label="head-tier accuracy on the release" if i == 0 else None)
            ax.annotate(release_id, (entry.round + 1, acc), textcoords="offset points", xytext=(4, -12),
                        fontsize=7, color="C2")
    ax.set_xlabel("round, from 0 (evaluated at the start of the round; last = after training)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title or "personalized accuracy per round")
    final = next((r for r in reversed(rows) if r.final), scored[-1] if scored else None)
    if final:
        values = [v for v in final.per_client.values() if v is not None]
        if many:
            bx.hist(values, bins=np.linspace(0, 1, 21), color="C0")
            bx.set_xlabel("final accuracy")
            bx.set_ylabel("clients")
            bx.set_title(f"final accuracy of {len(values)} clients")
        else:
            names = [a for a, v in final.per_client.items() if v is not None]
            bx.barh(names, [final.per_client[a] for a in names], color="C0")
            bx.set_xlim(0, 1)
            bx.set_title("final accuracy per client")
            bx.invert_yaxis()
    fig.tight_layout()
    return fig


def write_report(run_dir: str | Path, method: str = "", targets: Sequence[float] = ()) -> tuple[str, dict]:
    """summary.json + accuracy.png + results.txt in the run directory; returns (table, summary).
    ``targets``: accuracies to give the bytes to (:func:`summarize`).

    Reads the run directory only: ``metrics.jsonl``, ``head_metrics.json`` and ``run_times.json``.
    """
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir, drop_torn_tail=True)  # a crashed run reports the rounds it finished
    head = read_head_metrics(run_dir)
    summary = summarize(rows, targets, times=read_run_times(run_dir), head=head)
    write_json(run_dir / "summary.json", summary)
    if any(r.accuracy is not None for r in rows):
        plot_accuracy(rows, run_dir / "accuracy.png", title=f"{method} — personalized accuracy" if method else "",
                      head=head)
    table = format_table(rows, summary, method)
    write_bytes(run_dir / "results.txt", (table + "\n").encode())
    return table, summary
