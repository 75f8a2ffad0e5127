"""Sensor logs in CSV, cut into labelled windows: numpy and the standard library only.

A log has a header row and one row per time step: a label column, numeric channel
columns and, optionally, a segment column (a recording, a wearer, a stretch without
gaps). Rows are grouped into *runs* of consecutive rows with the same label and
segment; windows of ``window`` rows start every ``stride`` rows from each run's first
row and never leave their run, so every window has one label (the run's) and a window
never spans a label change or two recordings. A run shorter than ``window`` gives none.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..specs import CsvSpec

__all__ = ["SensorWindows", "read_csv_windows", "window_starts"]


class SensorWindows(NamedTuple):
    """What :func:`read_csv_windows` read: raw windows, their labels and what both mean."""

    #: float32 (N, C, window) raw values
    x: np.ndarray
    #: int64 (N,) indices into ``class_names``
    y: np.ndarray
    class_names: list[str]
    #: the C channel columns, in the order of ``x``'s axis 1
    channels: list[str]


def window_starts(run_length: int, window: int, stride: int) -> np.ndarray:
    """Offsets of the windows within a run of ``run_length`` rows: 0, stride, … while a whole window fits."""
    if run_length < window:
        return np.zeros(0, dtype=np.int64)
    return np.arange(0, run_length - window + 1, stride, dtype=np.int64)


def _sort_labels(labels: set[str]) -> list[str]:
    try:
        return sorted(labels, key=float)  # "2" before "10" when every label is a number
    except ValueError:
        return sorted(labels)


def _numbers(path: Path, cells: list[list[str]], lines: list[int], channels: list[str]) -> np.ndarray:
    """The channel cells as float32 (rows, C); a cell that is not a finite number is one ValueError naming it."""
    try:
        values = np.asarray(cells, dtype=np.float64)
    except ValueError:
        values = None
    if values is not None and np.isfinite(values).all() and (np.abs(values) <= np.finfo(np.float32).max).all():
        return values.astype(np.float32)
    for row, line in zip(cells, lines):
        for cell, name in zip(row, channels):
            try:
                v = float(cell)
            except ValueError:
                raise ValueError(f"{path}:{line}: column {name!r} holds {cell.strip()!r}, not a number") from None
            if not np.isfinite(np.float32(v)):
                raise ValueError(f"{path}:{line}: column {name!r} holds {cell.strip()!r}, not a finite float32")
    raise AssertionError("unreachable: some cell failed the array conversion")


def read_csv_windows(path: str | Path, spec: CsvSpec, *, labelled: bool = True) -> SensorWindows:
    """Windows of the sensor log at ``path`` as ``spec`` says: float32 (N, C, window) raw
    values of ``spec.channels`` in that order (default: every other column, in file order),
    int64 labels (N,) indexing the returned class names.

    ``labelled=False`` (a log to predict on) also takes a log without the label column:
    its rows are then one run per segment, every label 0 and the class names ``[""]``.

    Raises ``ValueError`` with one line naming the file (and line and column where there
    is one) for a missing or duplicated column, a value that is not a finite number, an
    empty label, a label outside ``spec.classes``, and a log too short for one window.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"csv sensor log not found: {path}")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{path}: not a readable CSV file ({exc})") from None
    if not rows:
        raise ValueError(f"{path}: empty; expected a header row naming the label and channel columns")
    header = [h.strip() for h in rows[0]]
    doubled = sorted({h for h in header if header.count(h) > 1})
    if doubled:
        raise ValueError(f"{path}:1: columns {doubled} appear more than once in the header")
    has_label = labelled or spec.label in header
    special = ([spec.label] if has_label else []) + ([spec.segment] if spec.segment else [])
    for role, name in (("label", spec.label if has_label else None), ("segment", spec.segment)):
        if name is not None and name not in header:
            raise ValueError(f"{path}:1: no {role} column {name!r}; the header has {header}")
    channels = list(spec.channels) if spec.channels else [h for h in header if h not in special]
    if not channels:
        raise ValueError(f"{path}:1: no channel columns besides {special}")
    for name in channels:
        if name not in header:
            raise ValueError(f"{path}:1: no channel column {name!r}; the header has {header}")
        if name in special:
            raise ValueError(f"{path}:1: column {name!r} cannot be a channel and the {spec.label!r}/segment column")
    at = {h: i for i, h in enumerate(header)}
    cols = [at[c] for c in channels]
    labels: list[str] = []
    segments: list[str] = []
    cells: list[list[str]] = []
    lines: list[int] = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(c.strip() for c in row):
            continue  # a blank line
        if len(row) != len(header):
            raise ValueError(f"{path}:{line}: {len(row)} fields, the header has {len(header)}")
        label = row[at[spec.label]].strip() if has_label else ""
        if has_label and not label:
            raise ValueError(f"{path}:{line}: the label column {spec.label!r} is empty")
        labels.append(label)
        segments.append(row[at[spec.segment]].strip() if spec.segment else "")
        cells.append([row[i] for i in cols])
        lines.append(line)
    if not cells:
        raise ValueError(f"{path}: no data rows under the header")
    values = _numbers(path, cells, lines, channels)

    names = list(spec.classes) if spec.classes and has_label else _sort_labels(set(labels))
    index = {name: i for i, name in enumerate(names)}
    unknown = next((i for i, lab in enumerate(labels) if lab not in index), None)
    if unknown is not None:
        raise ValueError(f"{path}:{lines[unknown]}: label {labels[unknown]!r} is not among csv.classes {names}")
    y_rows = np.array([index[lab] for lab in labels], dtype=np.int64)
    seg = np.array(segments)
    cuts = np.flatnonzero((y_rows[1:] != y_rows[:-1]) | (seg[1:] != seg[:-1])) + 1
    run_starts = np.concatenate([[0], cuts]).astype(np.int64)
    run_ends = np.concatenate([cuts, [len(y_rows)]]).astype(np.int64)
    starts = np.concatenate([s + window_starts(int(e - s), spec.window, spec.stride)
                             for s, e in zip(run_starts, run_ends)])
    if not len(starts):
        longest = int(np.argmax(run_ends - run_starts))
        within = "one label and segment" if spec.segment else "one label"
        raise ValueError(
            f"{path}: too few rows for one window of {spec.window}: the longest run of rows with {within} has "
            f"{int(run_ends[longest] - run_starts[longest])} (lines {lines[run_starts[longest]]}.."
            f"{lines[run_ends[longest] - 1]}); lower csv.window or log longer")
    x = values[starts[:, None] + np.arange(spec.window)]  # (N, window, C)
    return SensorWindows(np.ascontiguousarray(x.transpose(0, 2, 1)), y_rows[starts], names, channels)
