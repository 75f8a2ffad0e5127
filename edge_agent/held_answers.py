"""An agent's held answers: each task's answer (and a head agent's metrics report) kept
until the coordinator's presence says it is no longer wanted (``edge_agent/agent.py``,
"Held answers"): published again on every connection or coordinator session it has not
gone out on while its round is open, dropped once the round is over or the run is done."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from edgepfl.protocol import CoordinatorMeta

from .tiers import ANSWERED_TASKS, Reply

log = logging.getLogger("edgepfl.agent")


@dataclass
class HeldAnswer:
    """An answer kept until its round is over. ``sent_on``: (connection number, coordinator
    session) it was last published on, None while it never went out."""

    reply: Reply
    sent_on: tuple[int, str] | None = None


class HeldAnswers:
    """The last :data:`~.tiers.ANSWERED_TASKS` answers, by what they are held as (a task id,
    or a report's key)."""

    def __init__(self) -> None:
        self._held: OrderedDict[str, HeldAnswer] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def hold(self, key: str, reply: Reply) -> HeldAnswer:
        """Keep ``reply`` as ``key`` (the newest; the oldest beyond the bound is forgotten)."""
        held = self._held[key] = HeldAnswer(reply)
        self._held.move_to_end(key)
        while len(self._held) > ANSWERED_TASKS:
            self._held.popitem(last=False)
        return held

    def get(self, key: str) -> HeldAnswer | None:
        return self._held.get(key)

    def drop(self, key: str) -> None:
        """Forget ``key`` (its task was closed)."""
        self._held.pop(key, None)

    def settle(self, presence: CoordinatorMeta, here: tuple[int, str | None]) -> list[HeldAnswer]:
        """What ``presence`` asks for again: each answer whose round it shows open (a metrics
        report: any round) that did not go out ``here`` (this connection number and
        coordinator session) yet; the answers of rounds that are over (a metrics report: of a
        run that is done) are forgotten, logged when they never went out."""
        again = []
        for key, held in list(self._held.items()):
            reply = held.reply
            what = f"answer to task {key}" if reply.task_id is not None else key
            per_round = reply.task_id is not None  # a task's answer is wanted in its round only
            if presence.state == "done" or (per_round and presence.round > reply.round):
                del self._held[key]
                if held.sent_on is None:
                    log.warning("dropped the held %s (round %d): the coordinator is %s", what, reply.round,
                                "done" if presence.state == "done" else f"at round {presence.round}")
            elif (presence.state == "online" and (not per_round or presence.round == reply.round)
                  and held.sent_on != here):
                log.info("publishing the %s %s (round %d): the coordinator is online %s",
                         "held" if held.sent_on is None else "re-sent", what, reply.round,
                         "in that round" if per_round else f"(round {presence.round})")
                again.append(held)
        return again
