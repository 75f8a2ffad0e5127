"""The run report tells the truth: wall time, one round numbering, the latest release's
head-tier accuracy labelled by release, and figures that stay readable at 150 clients (a
real run's wall time: tests/integration/operator/test_report_wall_time.py)."""

from __future__ import annotations

import io

import numpy as np

from edgepfl.coordinator.ops.report import (
    DEFAULT_TARGET_SHARES,
    PER_CLIENT_LIMIT,
    accuracy_figure,
    format_table,
    summarize,
)
from edgepfl.coordinator.progress import Progress
from edgepfl.metrics import ReleaseReports, RoundMetrics, RunSession, RunTimes


def _rows(clients: int, rounds: int, seed: int = 0) -> list[RoundMetrics]:
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(rounds + 1):
        per = {f"c{i:03d}": float(np.clip(0.3 + 0.1 * r + rng.normal(0, 0.1), 0, 1)) for i in range(clients)}
        rows.append(RoundMetrics(
            round=r, final=r == rounds, accuracy=float(np.mean(list(per.values()))), per_client=per,
            participants=[] if r == rounds else sorted(per), sampled=[] if r == rounds else sorted(per),
            evaluated=clients, dropped=[], rejected={}, aborted=False, train_loss=None, bytes_up=10, bytes_down=20,
            shared_bytes=8, seconds=1.5))
    return rows


def _reports(correct: int, total: int = 100) -> dict:
    return {"pi-1": {"tier": "head", "head": "lr", "correct": correct, "total": total, "accuracy": correct / total}}


HEAD = {
    "fedavg-r1-aaaa": ReleaseReports(round=1, reports=_reports(50)),
    "fedavg-r3-bbbb": ReleaseReports(round=3, reports=_reports(80)),  # the latest, whatever the key order
}


def test_head_tier_accuracy_is_the_latest_releases_and_labelled_with_it():
    summary = summarize(_rows(3, 4), head=HEAD)
    assert summary["head_tier"]["release"] == "fedavg-r3-bbbb" and summary["head_tier"]["accuracy"] == 0.8
    table = format_table(_rows(3, 4), summary, "fedavg")
    assert "head-tier agents, release fedavg-r3-bbbb (encoder after round 3): 80.00% overall" in table


def test_release_bytes_are_summed_over_releases_by_form_and_said(tmp_path):
    """Issue 53: release bytes were in no metrics row or summary. Each release's bytes, as the
    run directory records them (a resumed session adds its own once, however often it writes)."""
    from edgepfl.coordinator.run_dir import RunDirectory
    from edgepfl.metrics import HeadReport, read_head_metrics

    run = RunDirectory(tmp_path)
    report = {"pi-1": HeadReport.model_validate(_reports(80)["pi-1"])}
    run.write_head_reports({"r1": report}, {"r1": 1}, {"r1": {"whole": 700_000, "delta": 0, "restore": 0}})
    run.write_head_reports({"r1": report}, {"r1": 1}, {"r1": {"whole": 1_400_000, "delta": 0, "restore": 0}})
    assert read_head_metrics(tmp_path)["r1"].sent_bytes == {"whole": 1_400_000, "delta": 0, "restore": 0}
    resumed = RunDirectory(tmp_path)  # a coordinator restarted: its counts start again from 0
    resumed.write_head_reports({"r3": report}, {"r3": 3}, {"r1": {"whole": 700_000},
                                                          "r3": {"delta": 70_000, "retained": 300_000}})
    head = read_head_metrics(tmp_path)
    assert head["r1"].sent_bytes == {"whole": 2_100_000, "delta": 0, "restore": 0}
    assert head["r1"].reports == report and head["r3"].sent_bytes == {"delta": 70_000, "retained": 300_000}
    summary = summarize(_rows(3, 4), head=head)
    assert summary["release_bytes"] == {"total": 2_470_000, "whole": 2_100_000, "delta": 70_000, "restore": 0,
                                        "retained": 300_000}
    table = format_table(_rows(3, 4), summary, "fedavg")
    assert "releases sent to head agents: 2.47 MB (2.10 MB whole, 0.07 MB delta, 0.30 MB retained;" in table


def test_rejections_and_refusals_are_summed_by_reason_and_shown():
    rows = _rows(2, 3)
    rows[0] = rows[0].model_copy(update={"rejected": {"wrong_shape": 1}, "refused": {"bad_options": 1, "busy": 1}})
    rows[1] = rows[1].model_copy(update={"refused": {"busy": 2}})
    summary = summarize(rows)
    assert summary["rejected"] == {"wrong_shape": 1} and summary["refused"] == {"bad_options": 1, "busy": 3}
    table = format_table(rows, summary)
    assert "rejected messages: {'wrong_shape': 1}" in table and "refused tasks: {'bad_options': 1, 'busy': 3}" in table
    stream = io.StringIO()
    Progress(3, stream=stream).update(rows[0])
    assert "rejected 1, refused 2" in stream.getvalue()


def test_wall_time_is_the_sessions_elapsed_time_and_a_resume_is_said():
    times = RunTimes(sessions=[RunSession(started=100.0, finished=160.0),
                               RunSession(started=500.0, finished=555.5, resumed_from=2)])
    summary = summarize(_rows(2, 4), times=times)
    assert summary["wall_seconds"] == 115.5 and summary["round_seconds"] == 7.5 and summary["resumed"]
    assert "wall time 115.5s over 2 sessions (resumed); 7.5s inside rounds" in format_table(_rows(2, 4), summary)


def test_one_round_numbering_from_0_in_progress_table_and_metrics():
    rows = _rows(2, 3)
    stream = io.StringIO()
    progress = Progress(3, stream=stream)
    for row in rows:
        progress.update(row)
    labels = [line.split("[")[0].strip() for line in stream.getvalue().splitlines()]
    assert labels == ["round   0", "round   1", "round   2", "final eval"] == \
        [f"round {r.round:>3}" if not r.final else "final eval" for r in rows]
    assert "3/3" in stream.getvalue().splitlines()[2]
    table = format_table(rows, summarize(rows))
    assert [line.split()[0] for line in table.splitlines()[3:7]] == ["0", "1", "2", "final"]
    assert "final accuracy (after round 2, the last)" in table
    # accuracy rises with the round in _rows, so the best is the final evaluation's row
    assert "best accuracy (table row final)" in table
    early_best = [r.model_copy(update={"accuracy": 0.99}) if r.round == 1 else r for r in rows]
    assert "best accuracy (table row 1)" in format_table(early_best, summarize(early_best))


def test_150_clients_are_drawn_as_a_distribution_with_release_markers_and_head_accuracy():
    from matplotlib.collections import PolyCollection

    rows = _rows(150, 5)
    fig = accuracy_figure(rows, head=HEAD)
    ax, bx = fig.axes
    # no line per client: the mean, and the head-tier markers
    assert len([line for line in ax.get_lines() if len(line.get_xdata()) > 1]) <= 3
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2  # 10-90 and 25-75 percentile bands
    # the final accuracies as a 20-bin histogram, not 150 bars
    assert len(bx.patches) == 20 and sum(p.get_height() for p in bx.patches) == 150
    assert bx.get_title() == "final accuracy of 150 clients"
    # one marker per release where the next round starts, and the head tier's accuracy on it
    markers = [line for line in ax.get_lines() if list(line.get_xdata()) in ([2, 2], [4, 4])]
    assert len(markers) == 2
    diamonds = {(float(line.get_xdata()[0]), float(line.get_ydata()[0])) for line in ax.get_lines()
                if line.get_marker() == "D"}
    assert diamonds == {(2.0, 0.5), (4.0, 0.8)}
    labels = ax.get_legend_handles_labels()[1]
    assert "encoder release" in labels and "head-tier accuracy on the release" in labels


def test_few_clients_keep_their_own_lines_and_bars():
    fig = accuracy_figure(_rows(PER_CLIENT_LIMIT, 3))
    ax, bx = fig.axes
    assert len([line for line in ax.get_lines() if len(line.get_xdata()) > 1]) == PER_CLIENT_LIMIT + 1
    assert len(bx.patches) == PER_CLIENT_LIMIT


def test_a_head_report_of_an_older_run_reads_its_figures_into_values_and_recomputes_accuracy():
    from edgepfl.metrics import HeadReport

    old = {"tier": "head", "head": "lr", "correct": 7, "total": 10, "accuracy": 0.99, "fit_seconds": 1.5}
    report = HeadReport.model_validate(old)
    assert report.values == {"fit_seconds": 1.5} and report.accuracy == 0.7  # the file's 0.99 is not trusted
    assert HeadReport.model_validate(report.model_dump(mode="json")) == report


def test_bytes_to_accuracy_are_the_bytes_of_the_rows_before_the_first_that_reached_it():
    rows = [r.model_copy(update={"accuracy": a, "bytes_up": 100 * (i + 1), "bytes_down": 1000,
                                 "update_bytes": {"q8": 100 * (i + 1)}, "task_bytes": {"q4": 1000}})
            for i, (r, a) in enumerate(zip(_rows(2, 3), (0.2, 0.5, 0.7, 0.65), strict=True))]
    summary = summarize(rows, targets=[0.1, 0.6, 0.7, 0.9])
    reached = {t["target"]: (t["round"], t["bytes_up"], t["bytes_down"]) for t in summary["to_accuracy"]}
    assert reached == {0.1: (0, 0, 0), 0.6: (2, 300, 2000), 0.7: (2, 300, 2000), 0.9: (None, 1000, 4000)}
    assert summary["update_bytes"] == {"q8": 1000}
    table = format_table(rows, summary)
    assert "to accuracy 60.00%: reached at row 2, after 0.0 MB (0.0 up, 0.0 down)" in table
    assert "to accuracy 90.00%: not reached" in table and "training updates by codec: q8 0.0 MB" in table
    assert summary["task_bytes"] == {"q4": 4000} and "tasks by codec: q4 0.0 MB" in table
    # without targets: shares of the best accuracy, said so
    default = summarize(rows)
    assert [t["target"] for t in default["to_accuracy"]] == [round(0.7 * s, 4) for s in DEFAULT_TARGET_SHARES]
    assert default["targets_from"] == "best accuracy"
    assert "to accuracy 90% of the best (63.00%): reached at row 2" in format_table(rows, default)


def test_a_summary_sites_round_counts_its_updates_not_its_sites_and_the_report_says_what_the_sites_did():
    from edgepfl.metrics import SiteRoundRecord

    rows = _rows(2, 2)
    sites = {"site-a": SiteRoundRecord(sampled=40, trained=38, evaluated=40, dropped=2, clipped=1),
             "site-b": SiteRoundRecord(sampled=10, trained=10, evaluated=10, dropped=0, clipped=0)}
    rows = [r.model_copy(update={"participants": ["site-a", "site-b"], "sites": sites}) if not r.final else r
            for r in rows]
    table = format_table(rows, summarize(rows))
    assert [line.split()[2] for line in table.splitlines()[3:5]] == ["48", "48"]  # rounds 0 and 1: updates summed
    assert ("summary sites (site-a, site-b): over 2 rounds they drew 100 devices to train, summed 96 updates "
            "(2 clipped), 4 devices did not answer") in table
