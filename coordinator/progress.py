"""One line per round on stderr: a bar, participants, accuracy so far.

Rounds are numbered from 0, as ``metrics.jsonl``, the report and the fleet view number
them; the bar's ``k/N`` counts the rounds done.
"""

from __future__ import annotations

import sys

from edgepfl.metrics import RoundMetrics


class Progress:
    def __init__(self, rounds: int, enabled: bool = True, stream=None, width: int = 20):
        self.rounds = rounds
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.best: float | None = None

    def note(self, text: str) -> None:
        if self.enabled:
            print(f"  {text}", file=self.stream, flush=True)

    def update(self, row: RoundMetrics) -> None:
        acc = row.accuracy
        if acc is not None:
            self.best = acc if self.best is None else max(self.best, acc)
        if not self.enabled:
            return
        done = min(self.rounds, row.round + (0 if row.final else 1))
        filled = int(self.width * done / max(1, self.rounds))
        bar = "#" * filled + "." * (self.width - filled)
        label = "final eval" if row.final else f"round {row.round:>3}"
        acc_s = "  n/a " if acc is None else f"{acc:6.2%}"
        best_s = "" if self.best is None else f" (best {self.best:6.2%})"
        extra = []
        if row.dropped:
            extra.append(f"dropped {len(row.dropped)}")
        if row.rejected:
            extra.append(f"rejected {sum(row.rejected.values())}")
        if row.refused:
            extra.append(f"refused {sum(row.refused.values())}")
        if row.aborted:
            extra.append(f"ABORTED ({(row.abort_reason or 'below_quorum').replace('_', ' ')})")
        if row.rolled_back_to is not None:
            extra.append(f"ROLLED BACK to the state after round {row.rolled_back_to}")
        print(f"{label} [{bar}] {done}/{self.rounds} trained {len(row.participants):>3}/{len(row.sampled):<3} "
              f"evaluated {row.evaluated:>3}  acc {acc_s}{best_s}  {row.seconds:6.2f}s"
              + (("  " + ", ".join(extra)) if extra else ""), file=self.stream, flush=True)
