"""research/slow_class_tasks.py: when each device class reports, read from metrics rows."""

from __future__ import annotations

from types import SimpleNamespace

from script_loader import load_script

slow_class_tasks = load_script("slow_class_tasks")


def row(seconds: float, per_client: dict[str, float | None], final: bool = False) -> SimpleNamespace:
    return SimpleNamespace(seconds=seconds, per_client=per_client, final=final)


def test_the_kth_report_is_timed_per_device_and_the_class_accuracy_is_what_it_holds_then():
    classes = {"a": "fast", "b": "fast", "s": "slow"}
    rows = [row(1.0, {"a": 0.1, "b": 0.2}),          # t = 1: both fast devices' first report
            row(2.0, {"a": 0.6, "s": 0.05}),         # t = 3: a's second, s's first
            row(3.0, {"b": 0.7, "s": None}),         # t = 6: b's second; s has no test samples
            row(4.0, {"s": 0.5}),                    # t = 10: s's second
            row(9.0, {"a": 0.0, "b": 0.0, "s": 0.0}, final=True)]  # the final evaluation is not a report
    reports = slow_class_tasks.class_reports(rows, classes)
    fast, slow = reports["fast"], reports["slow"]
    assert [(r["k"], r["median_time_s"], r["devices"]) for r in fast] == [(1, 1.0, 2), (2, 4.5, 2)]
    assert fast[0]["class_accuracy"] == 0.15
    assert fast[1]["class_accuracy"] == 0.65  # at t = 6 (the first row at or after 4.5): a 0.6, b 0.7
    assert [(r["k"], r["median_time_s"], r["class_accuracy"]) for r in slow] == [(1, 3.0, 0.05), (2, 10.0, 0.5)]
