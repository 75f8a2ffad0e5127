"""A run's directory: everything the coordinator writes, behind one object.

::

    <out>/checkpoint/             the state after the last completed round (state.json and the tensor file it names)
    <out>/checkpoint/good-<r>/    the last good state: the one round r + 1 was adopted from (rollback)
    <out>/metrics.jsonl           one row per round, appended; the final evaluation last
    <out>/head_metrics.json       head-tier reports by release
    <out>/releases/               exported encoder releases
    <out>/run_times.json          the coordinator sessions of this run

The round loop says *what* to keep (:class:`RunDirectory`'s methods name the records);
this module says *where* and *in which order*, which is what makes a crash at any point
leave a directory that resumes.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

from edgepfl.atomic import make_dirs, naming_errors, open_for_append, write_bytes, write_json
from edgepfl.failpoints import failpoint
from edgepfl.methods import ServerState
from edgepfl.metrics import (
    HEAD_METRICS_FILE,
    METRICS_FILE,
    HeadReport,
    ReleaseReports,
    RoundMetrics,
    read_head_metrics,
    read_metrics,
    record_run_end,
    record_run_start,
)
from edgepfl.state import CheckpointMeta, load_checkpoint, save_checkpoint

log = logging.getLogger("edgepfl.coordinator")


class RunDirectory:
    """The files of one run under ``root`` (created on :meth:`open`)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        #: each release's sent bytes as the run's earlier sessions recorded them (read at this
        #: session's first write): this session's counts are added to them, once
        self._bytes_before: dict[str, dict[str, int]] | None = None

    @property
    def checkpoint_dir(self) -> Path:
        return self.root / "checkpoint"

    @property
    def metrics_path(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def releases_dir(self) -> Path:
        return self.root / "releases"

    def good_state_dir(self, round: int | None) -> Path:
        """Where the good state of ``round`` (the state after it) is kept."""
        return self.checkpoint_dir / f"good-{round}"

    # ---------------------------------------------------------------- sessions
    def open(self, resumed_from: int | None, virtual_clock: bool = False) -> None:
        """A coordinator session begins (``resumed_from``: the checkpointed round it continues after;
        ``virtual_clock``: its rounds' seconds are a simulation's)."""
        make_dirs(self.root)
        record_run_start(self.root, resumed_from, virtual_clock)

    def close(self) -> None:
        record_run_end(self.root)

    # ---------------------------------------------------------------- states
    def load_checkpoint(self) -> tuple[ServerState, CheckpointMeta] | None:
        """The checkpointed state and what it records, or None for a fresh run."""
        return load_checkpoint(self.checkpoint_dir)

    def save_checkpoint(self, state: ServerState, meta: CheckpointMeta) -> None:
        """Checkpoint ``state`` as of ``meta.round``; then drop every good state but the one ``meta`` names."""
        save_checkpoint(self.checkpoint_dir, state, meta)
        failpoint("round.checkpointed")
        # Only now, with the checkpoint naming the current good state, may older ones go.
        keep = self.good_state_dir(meta.good_round).name
        for stale in self.checkpoint_dir.glob("good-*"):
            if stale.name != keep:
                shutil.rmtree(stale, ignore_errors=True)

    def save_good_state(self, state: ServerState, meta: CheckpointMeta) -> None:
        """Keep ``state`` (the state after ``meta.round``) as a good state to roll back to.
        Written before the checkpoint that names it, so a crash between the two leaves the
        checkpoint naming the older good state, still on disk."""
        save_checkpoint(self.good_state_dir(meta.round), state, meta)

    def load_good_state(self, round: int) -> ServerState | None:
        """The good state after ``round``; None when it is not on disk. Raises
        :class:`~edgepfl.state.CheckpointError` when it is there but unreadable."""
        found = load_checkpoint(self.good_state_dir(round))
        return found[0] if found is not None else None

    # ---------------------------------------------------------------- metrics rows
    def append_row(self, row: RoundMetrics) -> None:
        with naming_errors(self.metrics_path), open_for_append(self.metrics_path) as fh:
            fh.write(row.to_line().encode())
            fh.flush()

    def drop_rows_from(self, start_round: int) -> None:
        """Drop rows a resumed run writes again: those of ``start_round`` on, a torn last
        row (its round is not in the checkpoint) and the final evaluation's."""
        if not self.metrics_path.exists():
            return
        rows = read_metrics(self.metrics_path, drop_torn_tail=True)
        keep = [row for row in rows if row.round < start_round and not row.final]
        write_bytes(self.metrics_path, "".join(row.to_line() for row in keep).encode())

    # ---------------------------------------------------------------- head reports
    def write_head_reports(self, reports_by_release: Mapping[str, Mapping[str, HeadReport]],
                           release_rounds: Mapping[str, int],
                           sent_bytes: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Every release's head-tier reports, by release id; those of the run's earlier
        sessions are kept. ``release_rounds``: the training round each release of this
        session was exported after; ``sent_bytes``: what this session sent of each release to
        head agents, by form (added to what earlier sessions recorded)."""
        try:
            head = read_head_metrics(self.root)
        except ValueError as exc:  # an older run's file: replaced
            log.warning("%s", exc)
            head = {}
        if self._bytes_before is None:
            self._bytes_before = {rid: dict(entry.sent_bytes) for rid, entry in head.items()}
        for release_id in {*reports_by_release, *(sent_bytes or {})}:
            entry = head.get(release_id)
            reports = reports_by_release.get(release_id, entry.reports if entry else {})
            total = dict(self._bytes_before.get(release_id, {}))
            for form, n in (sent_bytes or {}).get(release_id, {}).items():
                total[form] = total.get(form, 0) + n
            head[release_id] = ReleaseReports(round=release_rounds.get(release_id, entry.round if entry else None),
                                              reports=dict(reports), sent_bytes=total)
        write_json(self.root / HEAD_METRICS_FILE, {k: v.model_dump(mode="json") for k, v in head.items()})


__all__ = ["RunDirectory"]
