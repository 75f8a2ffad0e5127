"""One round's metrics, as the round loop writes them to ``<run>/metrics.jsonl``.

The file is JSON lines, one :class:`RoundMetrics` per line (training rounds, then the
final evaluation). The coordinator appends and, on resume, truncates it; the report,
the progress line and the benchmarks read it back through :func:`read_metrics`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["METRICS_FILE", "MetricsError", "RoundMetrics", "read_metrics"]

METRICS_FILE = "metrics.jsonl"


class MetricsError(ValueError):
    """A metrics file that cannot be read; the message names file, line and field."""


class RoundMetrics(BaseModel):
    """What one round (or the final evaluation) measured.

    Accuracy is evaluated at the start of a round, on the model each agent receives,
    before it trains; the ``final`` row evaluates after the last round.
    """

    model_config = ConfigDict(extra="forbid")

    round: int = Field(ge=0, description="the round; for the final row, the number of rounds")
    final: bool = Field(description="the evaluation after the last round (no training)")
    accuracy: float | None = Field(description="sample-weighted held-out accuracy over evaluated agents")
    per_client: dict[str, float | None] = Field(description="agent -> held-out accuracy (None: no test samples)")
    participants: list[str] = Field(description="agents whose training update was aggregated, sorted")
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
    shared_bytes: int = Field(ge=0, description="size of the shared parameters after the round")
    seconds: float = Field(ge=0, description="wall time of the round")
    clipped: list[str] = Field(
        default_factory=list, description="participants whose update moved past aggregation.max_update_ratio and "
                                          "was clipped onto it (on_large_update: clip), sorted")

    def to_line(self) -> str:
        """The row as one ``metrics.jsonl`` line (with its newline)."""
        # json.dumps rather than model_dump_json: the same bytes as the rows written
        # before this model existed (and Python's own float repr)
        return json.dumps(self.model_dump(mode="json")) + "\n"


def read_metrics(path: str | Path) -> list[RoundMetrics]:
    """The rows of a ``metrics.jsonl`` (or of ``<run dir>/metrics.jsonl``), in file order."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} at {path}")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise MetricsError(f"{path}:{number}: not JSON ({exc})") from None
        try:
            rows.append(RoundMetrics.model_validate(data))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
            raise MetricsError(f"{path}:{number}: {loc}: {err.get('msg')}") from None
    return rows
