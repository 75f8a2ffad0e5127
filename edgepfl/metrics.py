"""One round's metrics, as the round loop writes them to ``<run>/metrics.jsonl``.

The file is JSON lines, one :class:`RoundMetrics` per line (training rounds, then the
final evaluation). The coordinator appends and, on resume, truncates it; the report,
the progress line and the benchmarks read it back through :func:`read_metrics`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, computed_field, model_validator

from .aggregation import DEFAULT_MAX_WEIGHT_RATIO, capped_accuracy
from .protocol import bounded_json

__all__ = ["HEAD_METRICS_FILE", "METRICS_FILE", "RUN_TIMES_FILE", "HeadReport", "MetricsError", "ReleaseReports",
           "RoundMetrics", "RunSession", "RunTimes", "SiteRoundRecord", "latest_release", "read_head_metrics",
           "read_metrics", "read_run_times", "record_run_end", "record_run_start"]

log = logging.getLogger("edgepfl.metrics")

METRICS_FILE = "metrics.jsonl"
#: head-tier reports by release: ``{release_id: ReleaseReports}``, releases in the order published
HEAD_METRICS_FILE = "head_metrics.json"
#: when each coordinator session of the run started and finished (:class:`RunTimes`)
RUN_TIMES_FILE = "run_times.json"


class MetricsError(ValueError):
    """A metrics file that cannot be read; the message names file, line and field."""


#: fields rows gained after their first format; written only when they hold something
_LATER_FIELDS = ("late", "staleness", "trained_on", "update_bytes", "task_bytes", "privacy", "secure", "clipped_by",
                 "update_share", "sites")


class PrivacyRecord(BaseModel):
    """A trained round's share of the run's differential privacy (``privacy.mechanism``)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    mechanism: Literal["central", "distributed"] = Field(description="who added the noise (docs/SECURITY.md)")
    epsilon: float | None = Field(ge=0, description="the run's ε after this round, at delta (dp-accounting, Rényi "
                                                    "DP); null: no finite ε (noise_multiplier 0)")
    delta: float = Field(gt=0, lt=1)
    population: int = Field(ge=1, description="devices the round's sample was drawn from")
    sampled: int = Field(ge=0, description="devices sampled: the round's noised mean divides by this (Poisson: by "
                                           "the expected count, sampling_rate x population)")
    noise_multiplier: float = Field(ge=0)
    clip_norm: float = Field(gt=0, description="the clip this round's changes were clipped to")
    next_clip_norm: float | None = Field(
        None, description="adaptive clipping: the clip the next round uses, set from this round's noised count")
    sampling_rate: float | None = Field(
        None, gt=0, le=1, description="privacy.sampling poisson: each device's inclusion probability, what the "
                                      "accountant counts (add-or-remove adjacency); null: a fixed-size round "
                                      "(replace-one)")

    def event(self) -> tuple[int, int] | tuple[int, int, float]:
        """The round as :class:`edgepfl.privacy.PrivacyAccountant` counts it."""
        if self.sampling_rate is None:
            return (self.population, self.sampled)
        return (self.population, self.sampled, self.sampling_rate)


class SiteRoundRecord(BaseModel):
    """A summary site's share of a round (``sites.mode: summary``): counts, naming no device."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    sampled: int = Field(ge=0, description="its devices it drew to train")
    trained: int = Field(ge=0, description="their updates in its sum")
    evaluated: int = Field(ge=0, description="its devices whose held-out counts are in the round's accuracy")
    dropped: int = Field(ge=0, description="its devices that answered nothing in time")
    clipped: int = Field(ge=0, description="updates in its sum that a bound clipped")


class SecureRecord(BaseModel):
    """A secure round's steps (``secure_aggregation.enabled``; docs/PROTOCOL.md §19)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    key_holders: int = Field(ge=0, description="sampled agents that sent their keys in time")
    members: int = Field(ge=0, description="key holders that sealed shares to every neighbour: sent a task")
    survivors: int = Field(ge=0, description="members whose masked update is in the sum (a group set aside or not "
                                             "unmasked: not)")
    recovered: int = Field(ge=0, description="members that sent no update whose masks were removed from the sum")
    neighbours: int = Field(ge=0, description="neighbours per agent")
    threshold: int = Field(ge=0, description="shares that rebuild a secret")
    unmasked: bool = Field(description="the sum was unmasked (false: too few updates or shares; the round aborted)")
    bytes_down: int = Field(ge=0, description="coordinator -> agent bytes of the steps (in the row's bytes_down too)")
    bytes_up: int = Field(ge=0, description="agent -> coordinator bytes of the steps (in the row's bytes_up too)")
    unmask_seconds: float = Field(ge=0, description="the coordinator's time to rebuild the secrets and remove the masks")
    groups: int = Field(1, ge=1, description="secure sums the round's agents were split into "
                                             "(secure_aggregation.group_size), each unmasked and bounded on its own")
    set_aside: int = Field(0, ge=0, description="groups whose unmasked sum was past the bound every update is held to "
                                                "in the clear: left out of the round")
    not_unmasked: int = Field(0, ge=0, description="groups whose masks could not be removed (too few of their "
                                                   "members survived to reveal): left out of the round")


class RoundMetrics(BaseModel):
    """What one round (or the final evaluation) measured.

    Accuracy is evaluated at the start of a round, on the model each agent receives,
    before it trains; the ``final`` row evaluates after the last round.
    """

    model_config = ConfigDict(defer_build=True, extra="forbid")

    round: int = Field(ge=0, description="the round; for the final row, the number of rounds")
    final: bool = Field(description="the evaluation after the last round (no training)")
    accuracy: float | None = Field(description="sample-weighted held-out accuracy over evaluated agents, each "
                                   "agent's count at most aggregation.max_weight_ratio x the median")
    per_client: dict[str, float | None] = Field(description="agent -> held-out accuracy (None: no test samples)")
    participants: list[str] = Field(description="agents whose training update was aggregated, sorted")
    late: list[str] = Field(
        default_factory=list, description="agents the previous round dropped whose update came in this round and "
                                          "was folded in, discounted (stragglers.max_staleness), sorted; in a "
                                          "buffered run every update trained on an earlier state")
    staleness: dict[str, int] = Field(
        default_factory=dict, description="updates folded in, by staleness: how many rounds (buffered: states) "
                                          "before this one the state they were trained on was; '0': on time")
    trained_on: dict[str, int] = Field(
        default_factory=dict, description="each late agent -> the round (buffered: state) its update was trained "
                                          "on; a participant's is this round")
    sampled: list[str] = Field(description="agents sent a training task")
    evaluated: int = Field(ge=0, description="agents that answered (train or evaluate)")
    dropped: list[str] = Field(description="agents that did not answer before the round closed, sorted")
    rejected: dict[str, int] = Field(description="messages rejected this round, per reason")
    aborted: bool = Field(description="the global state was left unchanged (abort_reason says why)")
    abort_reason: str | None = Field(
        None, description="below_quorum (too few updates), or the closed aggregate was refused: non_finite, "
                          "diverged (moved the shared parameters more than aggregation.max_change_ratio allows)")
    rolled_back_to: int | None = Field(
        None, description="after aggregation.rollback_after aborted rounds in a row, the global state went back "
                          "to the last good one: the state after this round (-1: the initial state)")
    train_loss: float | None = Field(description="mean local training loss of the participants")
    bytes_up: int = Field(ge=0, description="agent -> coordinator bytes of the answers counted")
    bytes_down: int = Field(ge=0, description="coordinator -> agent bytes of the tasks sent")
    update_bytes: dict[str, int] = Field(
        default_factory=dict, description="the training updates' share of bytes_up, by codec (docs/COMPRESSION.md: "
                                          "q8, q4, topk+q8, topk+q4, none) or 'uncompressed'")
    privacy: PrivacyRecord | None = Field(
        None, description="a round trained under differential privacy: its sample and the run's ε after it")
    secure: SecureRecord | None = Field(None, description="a secure round: its steps, counts and bytes")
    sites: dict[str, SiteRoundRecord] = Field(
        default_factory=dict, description="a run of summary sites (sites.mode: summary): each site that answered, "
                                          "what its devices did; participants, per_client and dropped then name sites")
    task_bytes: dict[str, int] = Field(
        default_factory=dict, description="bytes_down by how the tasks' tensors travelled: 'whole', or the codec of "
                                          "a task delta (q8, q4; docs/COMPRESSION.md, \"Task deltas\")")
    shared_bytes: int = Field(ge=0, description="size of the shared parameters after the round")
    seconds: float = Field(ge=0, description="wall time of the round")
    clipped: list[str] = Field(
        default_factory=list, description="participants whose update the update bound clipped or clamped "
                                          "(aggregation: max_update_ratio with on_large_update: clip, "
                                          "max_update_vs_median, max_mean_shift, max_variance_growth), sorted")
    refused: dict[str, int] = Field(
        default_factory=dict, description="tasks their agents refused this round, per reason (docs/PROTOCOL.md §7)")

    clipped_by: dict[str, list[str]] = Field(
        default_factory=dict, description="each clipped participant -> the aggregation settings whose bound fired "
                                          "(max_update_ratio, max_update_vs_median, max_first_update_ratio, "
                                          "max_mean_shift, max_variance_growth)")
    update_share: dict[str, float] = Field(
        default_factory=dict, description="each agent whose update was folded in -> its share of the round's change "
                                          "of the shared parameters: its weight times its staleness discount over "
                                          "the sum of the updates' weights (a weighted rule's; the shares of a "
                                          "device class say how much of the model it moves)")

    def to_line(self) -> str:
        """The row as one ``metrics.jsonl`` line (with its newline)."""
        # json.dumps rather than model_dump_json: the same bytes as the rows written
        # before this model existed (and Python's own float repr)
        row = self.model_dump(mode="json")
        for key in _LATER_FIELDS:  # left out while empty: a row of an older run writes back as it was
            if not row[key]:
                del row[key]
        return json.dumps(row) + "\n"


def read_metrics(path: str | Path, *, drop_torn_tail: bool = False) -> list[RoundMetrics]:
    """The rows of a ``metrics.jsonl`` (or of ``<run dir>/metrics.jsonl``), in file order.

    ``drop_torn_tail``: a last line without its newline that does not parse is left out
    instead of raising :class:`MetricsError`. A crash (power lost) while a row was being
    appended leaves such a line; the round loop writes its row before its checkpoint, so
    that round is not in the checkpoint and a resumed run writes its row again.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} at {path}")
    text = path.read_bytes()  # decoded line by line: one bad line is one error naming it
    lines = text.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    torn = drop_torn_tail and bool(lines) and not text.endswith(b"\n")
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = bounded_json.loads(line)
        except ValueError as exc:
            if torn and number == len(lines):
                log.warning("%s: its last row was cut short by a crash; left out", path)
                break
            raise MetricsError(f"{path}:{number}: not JSON ({exc})") from None
        try:
            rows.append(RoundMetrics.model_validate(data))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
            raise MetricsError(f"{path}:{number}: {loc}: {err.get('msg')}") from None
    return rows


class HeadReport(BaseModel):
    """One agent's report on one release: what its ``metrics`` message said, with the
    accuracy the coordinator computed from the counts (the agent's ``values`` cannot
    overwrite it)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    tier: str = Field(description="the reporting agent's tier (head)")
    release_id: str | None = Field(None, description="the release the head was fitted and measured on")
    head: str | None = Field(None, description="the head kind (lr, svm, mlp, a method's own head)")
    correct: int = Field(ge=0, description="held-out samples predicted right")
    total: int = Field(ge=0, description="held-out samples evaluated")
    values: dict[str, float] = Field(default_factory=dict, description="the agent's own figures (fit time, ...)")
    refused: str | None = Field(None, description="the agent did not install the release, and why (its counts are 0)")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def accuracy(self) -> float | None:
        """``correct / total`` (None: nothing evaluated); written to the file, recomputed on reading."""
        return self.correct / self.total if self.total else None

    @model_validator(mode="before")
    @classmethod
    def _read(cls, data: Any) -> Any:
        """The accuracy is computed, never read. Reports written before ``values`` was
        nested kept the agent's figures beside the fields: read those into ``values``."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k != "accuracy"}
        if "values" not in data:
            known = set(cls.model_fields)
            data = {k: v for k, v in data.items() if k in known} | {
                "values": {k: v for k, v in data.items() if k not in known}}
        return data


class ReleaseReports(BaseModel):
    """The head-tier reports measured with one encoder release (``head_metrics.json``, one entry)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    round: int | None = Field(None, description="the last training round the released encoder includes")
    reports: dict[str, HeadReport] = Field(default_factory=dict, description="agent id -> its report")
    sent_bytes: dict[str, int] = Field(
        default_factory=dict, description="bytes of this release's frames the coordinator sent, by form: on head "
                                          "agents' task topics whole, delta, restore; retained: its retained copy "
                                          "published (the broker sends it on to each agent that takes it)")

    def accuracy(self) -> float | None:
        """Sample-weighted held-out accuracy over the agents that reported, each agent's count
        capped as a round's are (:func:`edgepfl.aggregation.capped_accuracy`)."""
        return capped_accuracy(((r.correct, r.total) for r in self.reports.values() if r.refused is None),
                               DEFAULT_MAX_WEIGHT_RATIO)


def read_head_metrics(path: str | Path) -> dict[str, ReleaseReports]:
    """``head_metrics.json`` (or ``<run dir>/head_metrics.json``) by release id; empty when absent."""
    path = Path(path)
    if path.is_dir():
        path = path / HEAD_METRICS_FILE
    if not path.exists():
        return {}
    try:
        data = bounded_json.loads(path.read_text())
        return {rid: ReleaseReports.model_validate(entry) for rid, entry in data.items()}
    except (ValueError, AttributeError) as exc:
        raise MetricsError(f"{path}: not a head-metrics file by release ({str(exc).splitlines()[0]})") from None


def latest_release(head: dict[str, ReleaseReports]) -> tuple[str, ReleaseReports] | None:
    """The release of the latest round among ``head`` (file order is not kept: JSON is written sorted)."""
    if not head:
        return None
    return max(head.items(), key=lambda item: -1 if item[1].round is None else item[1].round)


class RunSession(BaseModel):
    """One coordinator process's part of a run (a resumed run has several)."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    started: float = Field(description="Unix time the session began")
    finished: float | None = Field(None, description="Unix time it ended; None: it crashed or still runs")
    resumed_from: int | None = Field(None, description="it resumed after this round's checkpoint")
    virtual_clock: bool = Field(False, description="its rounds ran on a simulation's virtual clock: their "
                                                   "metrics rows' seconds are simulated device time, not elapsed time")
    pid: int | None = Field(None, description="the coordinator's process id (edgepfl runs tells a crashed run "
                                              "from a running one on the same host)")
    host: str | None = Field(None, description="the host name the coordinator ran on")


class RunTimes(BaseModel):
    """``run_times.json``: the real elapsed time of a run, session by session."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    sessions: list[RunSession] = Field(default_factory=list)

    def wall_seconds(self) -> float | None:
        """Elapsed time of the finished sessions (None when none finished)."""
        done = [s.finished - s.started for s in self.sessions if s.finished is not None]
        return sum(done) if done else None


def read_run_times(run_dir: str | Path) -> RunTimes:
    path = Path(run_dir) / RUN_TIMES_FILE
    return RunTimes.model_validate_json(path.read_text()) if path.exists() else RunTimes()


def record_run_start(run_dir: str | Path, resumed_from: int | None, virtual_clock: bool = False) -> None:
    """Append a session to ``run_times.json`` (atomically): a coordinator begins or resumes the run."""
    import os
    import socket
    import time

    from .atomic import write_json

    times = read_run_times(run_dir)
    if resumed_from is None:
        times = RunTimes()  # a fresh run: earlier sessions in this directory were another run's
    times.sessions.append(RunSession(started=time.time(), resumed_from=resumed_from, virtual_clock=virtual_clock,
                                     pid=os.getpid(), host=socket.gethostname()))
    write_json(Path(run_dir) / RUN_TIMES_FILE, times.model_dump(mode="json"))


def record_run_end(run_dir: str | Path) -> None:
    """Mark the current session of ``run_times.json`` finished."""
    import time

    from .atomic import write_json

    times = read_run_times(run_dir)
    if times.sessions:
        times.sessions[-1].finished = time.time()
        write_json(Path(run_dir) / RUN_TIMES_FILE, times.model_dump(mode="json"))
