"""A round's bookkeeping: the tasks sent, who still owes an answer, and the closed rounds
whose stragglers' late updates are still taken. The gate checks answers against them; the
round drivers open and close them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

from edgepfl.aggregation import staleness_weight
from edgepfl.methods import Method, ServerState
from edgepfl.protocol import UplinkSpec
from edgepfl.protocol.secagg import SecAggTask
from edgepfl.protocol.site import SiteOrders

#: the most copies of one task a round sends (a lost task goes again on each reconnect up to
#: this): statuses forged with ever higher connection numbers on an unsigned deployment
#: cannot make the coordinator publish the model without bound
MAX_TASK_COPIES = 2

#: how long, as a share of its deadline, a round waits for one agent alone before that
#: agent's refusal or rejected answer, ending the wait, counts as a miss: a refusal sent at
#: once (a clock ahead, a busy device) costs the round nothing worth benching for, one held
#: back until just before the deadline costs the round its wait (:meth:`RoundTasks.held_up_by`)
PATIENCE_SHARE = 0.25


@dataclass(frozen=True)
class Task:
    """One task sent this round."""

    agent_id: str
    task_id: str
    kind: str
    #: the training samples the agent's status announced when the task was sent: an answer
    #: may claim no more (None: whatever the registry holds when the answer arrives)
    announced: int | None = None
    #: the agent's session and broker connection number when the task was last sent (its last
    #: birth's, None: not announced): a birth of that session on a later connection means the
    #: task may have been lost with the old one (PROTOCOL.md §10)
    session: str | None = None
    connection: int | None = None
    #: how many times the task was sent again (at most :data:`MAX_TASK_COPIES`)
    copies: int = 0
    #: the codec the task asked the update's change to be compressed with (None: uncompressed)
    uplink: UplinkSpec | None = None
    #: a secure round's task (protocol 1.9): sent again with it; its answer is a masked vector,
    #: which only the round's sum can check
    secagg: SecAggTask | None = None
    #: a site aggregator's task: the orders for its devices (protocol 1.13)
    site: SiteOrders | None = None

    def lost_with_connection(self, session: str | None, connection: int | None) -> bool:
        """Whether a birth of ``session`` on connection ``connection`` came after a connection
        this task may have been lost with (the same process, a later connection). Only known
        numbers are compared: a task sent when the agent's status had none (made before it
        heard a 1.3 coordinator) may have gone out on the very connection its first numbered
        status comes from (after a broker restart, every agent's), and a copy would only cost
        it a download."""
        if self.session is None or self.connection is None or connection is None or session != self.session:
            return False
        return connection > self.connection


class RoundTasks:
    """The tasks sent in one round (one per agent) and the agents that have not answered yet.

    ``weight_cap`` is the most weight one training update of the round may carry
    (:func:`edgepfl.aggregation.weight_cap` of the counts its sampled agents announced;
    None: no cap): fixed when the round opens, so an update's weight depends on that update
    and the round alone, never on what arrived before it.
    """

    def __init__(self, round: int, weight_cap: int | None = None, sampled: Iterable[str] = (), *,
                 patience_s: float = 0.0, now: Callable[[], float] | None = None) -> None:
        self.round = round
        self.weight_cap = weight_cap
        #: the agents sampled to train: a secure round asks them for steps before their tasks are sent
        self.sampled = frozenset(sampled)
        #: set once the round stopped collecting: a later answer is ``stale``
        self.closed = False
        #: set once every task of the round was sent and its answers are collected (a round that
        #: waits for one agent alone waits for that agent): :meth:`start_collecting`
        self.all_sent = False
        #: how long the round may wait for one agent alone before a non-answer ending that
        #: wait is a miss (:meth:`held_up_by`), in the seconds of ``now``
        self.patience_s = patience_s
        self._now = now
        self._alone_since: float | None = None
        self._tasks: dict[str, Task] = {}
        self._waiting: set[str] = set()

    def start_collecting(self) -> None:
        """Every task is sent: from here on the round waits for the answers alone."""
        self.all_sent = True
        self._note_alone()

    def held_up_by(self, agent_id: str) -> bool:
        """Whether the agent just ended the round's wait as the last agent it waited for, every
        task being sent, after the round had waited for it alone at least :attr:`patience_s`.
        (Asked by the inbox when what ended the wait was no answer the round could use.)"""
        if not self.all_sent or self._waiting or not self.answered(agent_id) or self._alone_since is None:
            return False
        return self._now is None or self._now() - self._alone_since >= self.patience_s

    def _note_alone(self) -> None:
        if self.all_sent and len(self._waiting) == 1 and self._alone_since is None and self._now is not None:
            self._alone_since = self._now()

    def close(self) -> None:
        """The round stops collecting (its aggregate is being closed)."""
        self.closed = True

    def add(self, task: Task) -> None:
        self._tasks[task.agent_id] = task
        self._waiting.add(task.agent_id)

    def get(self, agent_id: str) -> Task | None:
        return self._tasks.get(agent_id)

    def answered(self, agent_id: str) -> bool:
        return agent_id in self._tasks and agent_id not in self._waiting

    def mark_answered(self, agent_id: str) -> None:
        self._waiting.discard(agent_id)
        self._note_alone()

    def expects(self, agent_id: str) -> bool:
        """Whether a frame of the agent's may still answer this round: it owes an answer, or is
        sampled for it, while the round collects."""
        return not self.closed and (agent_id in self._waiting or agent_id in self.sampled)

    @property
    def waiting(self) -> Set[str]:
        """Agents with a task and no accepted answer yet (a live view, kept up to date in O(1))."""
        return self._waiting


@dataclass(frozen=True)
class LateWindow:
    """A closed round whose dropped agents' training updates are still taken
    (``stragglers.max_staleness``): its tasks, the state they were built from, and how much
    of a late update's change is applied (its discount)."""

    tasks: RoundTasks
    state: ServerState
    discount: float


class ClosedRounds:
    """Closed training rounds whose stragglers' late updates are still taken: each round's
    tasks and the state they were built from. ``limit`` (``stragglers.max_staleness``) keeps
    the last that many; with no limit, every round a task is still unanswered of."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._rounds: deque[tuple[RoundTasks, ServerState]] = deque(maxlen=limit)

    def add(self, tasks: RoundTasks, state: ServerState) -> None:
        if self.limit == 0:
            return
        self._rounds.append((tasks, state))
        if self.limit is None:
            self._rounds = deque(entry for entry in self._rounds if entry[0].waiting)

    def windows(self, round: int, staleness_exponent: float, method: Method) -> dict[int, LateWindow]:
        """The rounds whose stragglers round ``round`` takes late updates from, by round
        number, each with the discount of its staleness (none for a method whose server step
        needs a round's updates together)."""
        if not method.streaming:
            return {}
        return {tasks.round: LateWindow(tasks, state, staleness_weight(round - tasks.round, staleness_exponent))
                for tasks, state in self._rounds}
