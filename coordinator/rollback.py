"""When a run goes back to its last good state (``aggregation.rollback_after``).

A round is *aborted* when its aggregate is not adopted (below quorum, not finite, moved
the shared parameters too far). After ``rollback_after`` aborted rounds in a row the run
goes back to the last good state: the state the last adopted round was trained from,
kept on disk by :class:`~.run_dir.RunDirectory`. What the policy knows (the streak and
which good state exists) is checkpointed with the state, so a resumed run continues the
same count.
"""

from __future__ import annotations

import logging

from edgepfl.methods import ServerState
from edgepfl.state import CheckpointError, CheckpointMeta

from .run_dir import RunDirectory

log = logging.getLogger("edgepfl.coordinator")


class RollbackPolicy:
    """Counts aborted rounds in a row; keeps and restores the last good state."""

    def __init__(self, rollback_after: int | None, run_dir: RunDirectory):
        self.rollback_after = rollback_after
        self.run_dir = run_dir
        #: training rounds aborted in a row
        self.aborted_streak = 0
        #: the last good state is the one after this round (``checkpoint/good-<round>/``); None: none kept
        self.good_round: int | None = None
        #: the round whose aggregate made the current state (None: none since the run started or
        #: resumed, or the state was rolled back): what a summary site keeps its records of
        self.last_adopted: int | None = None

    def restore(self, meta: CheckpointMeta) -> None:
        """Continue the count of a checkpointed run."""
        self.aborted_streak, self.good_round = meta.aborted_streak, meta.good_round

    def adopted(self, round: int) -> None:
        """``round``'s aggregate was adopted: the streak ends."""
        self.aborted_streak, self.last_adopted = 0, round

    def keep_good_state(self, state: ServerState, meta: CheckpointMeta) -> None:
        """A round trained from ``state`` (the state after ``meta.round``) was adopted: it is
        the last good state. A no-op without ``rollback_after``: nothing would read it."""
        if self.rollback_after is None:
            return
        self.run_dir.save_good_state(state, meta)
        self.good_round = meta.round

    def aborted(self, round: int, reason: str) -> tuple[int, ServerState] | None:
        """Count an aborted round; after ``rollback_after`` in a row, the last good state to
        go back to, with the round it is the state after (None: keep the current state)."""
        self.aborted_streak += 1
        if self.rollback_after is None or self.aborted_streak < self.rollback_after:
            return None
        streak, self.aborted_streak = self.aborted_streak, 0
        good = self.good_round
        state = None
        if good is not None:
            try:
                state = self.run_dir.load_good_state(good)
            except CheckpointError as exc:
                log.error("round %d: the last good state (good-%d) cannot be read: %s", round, good, exc)
        if good is None or state is None:
            log.error("round %d: %d rounds in a row aborted (last: %s) and no earlier good state to go back to; "
                      "going on with the current state", round, streak, reason)
            return None
        # Now at the good state: nothing older is kept, so a further run of aborts only says so.
        self.good_round = self.last_adopted = None
        log.error("round %d: %d rounds in a row aborted (last: %s); rolled back to the last good state, "
                  "the global state after round %d", round, streak, reason, good)
        return good, state


__all__ = ["RollbackPolicy"]
