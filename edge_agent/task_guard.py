"""Which tasks a trainer agent may act on, beyond a valid signature.

A signed task is still refused when it is not for this agent (``recipient``), when a
newer task was already seen (tasks are ordered by the run's ``epoch``, then the
``round``), or when it is past its deadline. The newest (epoch, round) per federation
is written atomically to the state directory, so a restarted agent cannot be fed old
tasks either. ``docs/PROTOCOL.md`` §10 states the rules.
"""

from __future__ import annotations

import logging
from pathlib import Path

from edgepfl.atomic import write_json
from edgepfl.protocol import Message, TaskMeta, bounded_json
from edgepfl.protocol.clock import wall_time

log = logging.getLogger("edgepfl.agent")

ORDER_FILE = "task_order.json"
#: How far the agent's clock may be from the coordinator's before a task's deadline is
#: misjudged: tasks are accepted up to ``created + 2 * deadline_s + MAX_CLOCK_SKEW_S``
#: (the coordinator collects answers for at most twice its round timeout).
MAX_CLOCK_SKEW_S = 300.0


def recipient_refusal(message: Message, agent_id: str, *, strict: bool) -> tuple[str, str] | None:
    """(``wrong_recipient``, detail) when a frame from the coordinator (a task, a nack) is
    addressed to another agent or, when ``strict`` (a pinned coordinator key), to nobody."""
    recipient, kind = message.header.recipient, message.type.value
    if recipient is not None and recipient != agent_id:
        return "wrong_recipient", f"{kind} for {recipient}"
    if strict and recipient is None:
        return "wrong_recipient", f"signed {kind} names no recipient"
    return None


class TaskGuard:
    """Refuses tasks for another agent and, when ``strict`` (a pinned coordinator key),
    unaddressed, older or expired ones. :meth:`refusal` is asked first, :meth:`accept` records
    the task as the newest seen."""

    def __init__(self, agent_id: str, state_dir: str | Path, *, strict: bool):
        self.agent_id = agent_id
        self.strict = strict
        self.path = Path(state_dir) / ORDER_FILE
        self._newest: dict[str, tuple[int, int]] = {}
        if self.path.is_file():
            try:
                self._newest = {f: (int(e), int(r)) for f, (e, r) in bounded_json.loads(self.path.read_text()).items()}
            except (ValueError, TypeError, AttributeError) as exc:
                # Unreadable: refuse nothing we cannot order rather than crash; say so.
                log.error("%s is unreadable (%s); task order starts afresh", self.path, exc)

    def refusal(self, message: Message, now: float | None = None) -> tuple[str, str] | None:
        """(reason, detail) when the task must be ignored, else None."""
        h, meta = message.header, message.meta_as(TaskMeta)
        misaddressed = recipient_refusal(message, self.agent_id, strict=self.strict)
        if misaddressed is not None or not self.strict:
            return misaddressed
        order = (meta.epoch, h.round)
        newest = self._newest.get(h.federation)
        if newest is not None and order < newest:
            return "stale", f"task of run {meta.epoch} round {h.round}, already at run {newest[0]} round {newest[1]}"
        now = wall_time() if now is None else now
        late = now - (h.created + 2 * meta.deadline_s + MAX_CLOCK_SKEW_S)
        if late > 0:
            return "expired", (f"task of round {h.round} is {late:.0f}s past its deadline by this device's clock, "
                               f"which reads {now - h.created:.0f}s after the task was made (a new task: the "
                               "device's clock is that far ahead)")
        return None

    def accept(self, message: Message) -> None:
        """Record the task's (epoch, round) as the newest of its federation, durably."""
        order = (message.meta_as(TaskMeta).epoch, message.header.round)
        federation = message.header.federation
        if order > self._newest.get(federation, (-1, -1)):
            self._newest[federation] = order
            write_json(self.path, {f: list(o) for f, o in self._newest.items()})
