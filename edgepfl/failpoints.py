"""Named points where a test may kill this process, to prove that a crash anywhere leaves
state that resumes (the ``failpoint`` idea of FreeBSD and etcd, reduced to one action).

``EDGEPFL_FAILPOINT=<name>`` (or ``<name>:<n>``, the n-th time the point is reached, from
1) makes the process send itself SIGKILL at that point: no ``finally``, no ``atexit``, no
buffered write flushed, as when the power goes. Unset (always, outside tests), a point
costs one environment lookup. The points are listed in :data:`POINTS`, so a test can kill
at each one and a misspelt name fails at once instead of never firing.
"""

from __future__ import annotations

import os
import signal

ENV = "EDGEPFL_FAILPOINT"

#: every failpoint in the code, with where it sits
POINTS = {
    "atomic.written": "a file's new contents are written and synced under a temporary name, not yet renamed",
    "atomic.renamed": "a file was renamed into place; its directory is not yet synced",
    "checkpoint.tensors_written": "a checkpoint's new tensor file is on disk; its state.json still names the old one",
    "checkpoint.committed": "a checkpoint's state.json names the new tensor file; the old one is not yet removed",
    "round.row_appended": "a round's metrics row is appended; its good state and checkpoint are not yet written",
    "round.good_state_kept": "a round's good state is written; the checkpoint that names it is not yet",
    "round.checkpointed": "a round's checkpoint is written; older good states are not yet removed",
    "site.tasks_sent": "a site aggregator sent its devices a round's tasks and has not answered the central "
                       "coordinator (a site that dies mid-round)",
    "agent.train_task": "a trainer agent took a training task and has not begun training it (a device that dies "
                        "mid-round)",
}

_hits: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Kill this process here if ``EDGEPFL_FAILPOINT`` names this point (and hit count)."""
    armed = os.environ.get(ENV)
    if armed is None:
        return
    point, _, nth = armed.partition(":")
    if name not in POINTS or point not in POINTS:
        raise ValueError(f"unknown failpoint {name if name not in POINTS else point!r} (known: {', '.join(POINTS)})")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == (int(nth) if nth else 1):
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["ENV", "POINTS", "failpoint"]
