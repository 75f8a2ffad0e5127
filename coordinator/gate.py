"""What the coordinator lets in from the network, and the reason it gives for the rest.

Pure checks: no broker, no clock, no logging. :class:`UpdateGate` takes one frame from an
agent's update topic and the tasks of the round being collected, and returns an
:class:`Accepted` update or a :class:`Rejection` whose ``reason`` is the tag of
``docs/PROTOCOL.md`` §7, in the order of that table. :func:`admit_presence` and
:func:`admit_metrics` do the same for presence and head-tier reports, and
:func:`admit_state` for a round's closed aggregate before it becomes the global state.
The caller counts and logs rejections; nothing here raises on hostile bytes.

A rejection carries an :class:`Attribution` when the rejected frame is provably the
agent's own (its header decodes, names the topic's agent as sender and, with a keyring,
is signed by the agent's enrolled key): only those are answered with a NACK and may end
the agent's wait for its task (docs/PROTOCOL.md §7). A ``refusal`` on an update topic
that names the agent's open task is admitted as :class:`Refused`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from edgepfl import codecs
from edgepfl.aggregation import STATISTIC_LEAVES, AggregationRejected
from edgepfl.methods import ClientUpdate, Method, ServerState, SitePart, UpdateRejected
from edgepfl.protocol import (
    REFUSAL_REASONS,
    Message,
    MessageType,
    MetricsMeta,
    ProtocolError,
    RefusalMeta,
    StatusMeta,
    UpdateMeta,
    decode,
    parse_version,
)
from edgepfl.protocol.envelope import peek_header, peek_signed_part
from edgepfl.protocol.evolution import MAJOR
from edgepfl.protocol.secagg import SecAggMeta
from edgepfl.protocol.signing import Keyring, verify_signed_part

from .registry import Registry
from .round_tasks import LateWindow, RoundTasks, Task
from .sites import part_of, summary_part_of

# Sample counts become aggregation weights (the streaming rules refuse more than 2**24
# for one update: edgepfl.aggregation). Above 2**53 a count is no longer exact as a
# float64, and one past float64's range (10**400, say) would raise OverflowError; no
# device holds anywhere near this many.
MAX_SAMPLES = 2**53

# Rejections that never end an agent's wait: the frame is not an answer to its open task
# (an old round's, another task's) or a second copy of an answer already counted.
NEVER_ENDS_WAIT = frozenset({"stale", "unexpected", "duplicate", "unknown_agent"})
#: refusal reasons that hold until the agent restarts: it gets no further task of this run
EXCLUDING_REFUSALS = frozenset({"unsupported_method", "unsupported_arch", "unsupported_version", "bad_options",
                                "data_mismatch", "normalization", "too_large"})
_ID = re.compile(r"^[0-9a-f]{32}$")
_TAG = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass(frozen=True)
class Attribution:
    """The rejected frame, when it is provably from the agent whose topic it came on."""

    message_id: str
    #: the frame's type (``update``, ``status``, ``refusal``, ``metrics``; ``unknown`` when not a type tag)
    type: str
    round: int
    #: the task it answered, when its meta names one readably
    task_id: str | None = None
    #: its signature verified against the agent's enrolled key: only then can it answer the
    #: agent's task (on an unsigned deployment anyone can write a header naming the agent)
    verified: bool = False


@dataclass(frozen=True)
class Rejection:
    """A message the coordinator drops: ``reason`` tags the counters, ``detail`` goes to the log.

    ``attributed`` is set when the frame is provably ``agent_id``'s (see the module doc)."""

    agent_id: str | None
    reason: str
    detail: str
    attributed: Attribution | None = None


@dataclass(frozen=True)
class Refused:
    """An agent's refusal of its open task (since protocol 1.2): the task is answered, nothing aggregated.
    ``reason`` is one of :data:`~edgepfl.protocol.REFUSAL_REASONS` (an unknown one reads as ``error``)."""

    agent_id: str
    reason: str
    detail: str
    message_id: str
    #: whether the refusal may keep the agent out of the run (:data:`EXCLUDING_REFUSALS`):
    #: only when it is provably the agent's own (signed by its enrolled key) or the
    #: coordinator's own finding. On an unsigned deployment anyone can publish a refusal
    #: naming the agent's task (it is on the task topic): it costs the agent that task, as
    #: a forged update would, but never the rest of the run (docs/SECURITY.md)
    may_exclude: bool = True
    #: ``bad_shares`` (since 1.12): the neighbours whose sealed shares did not open for it
    peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Presence:
    """An admitted status and when its sender made it (its signed ``created``, for ordering)."""

    meta: StatusMeta
    created: float


def _unsigned_by(agent_id: str, message: Message, keyring: Keyring | None) -> Rejection | None:
    """With a keyring, a frame from ``agent_id`` must be signed by the key enrolled for it."""
    if keyring is None:
        return None
    reason = keyring.check(agent_id, message)
    if reason is None:
        return None
    return Rejection(agent_id, reason, f"{message.type.value} not signed by {agent_id}'s enrolled key")


def _sender_checks(agent_id: str, message: Message,
                   keyring: Keyring | None) -> tuple[Attribution | None, Rejection | None]:
    """The decoded ``message`` as ``agent_id``'s frame (None when its sender is another or,
    with a keyring, it is not signed by ``agent_id``'s enrolled key), and the signature's
    rejection when the sender is right but the signature is not."""
    h = message.header
    if h.sender != agent_id:
        return None, None
    forged = _unsigned_by(agent_id, message, keyring)
    if forged is not None:
        return None, forged
    task_id = getattr(message.meta, "task_id", None)
    return Attribution(h.message_id, h.type.value, h.round, task_id if isinstance(task_id, str) else None,
                       verified=keyring is not None), None


def attribute_raw(agent_id: str, frame: bytes, keyring: Keyring | None) -> Attribution | None:
    """:func:`attribute` for a frame that did not decode, from its header read best-effort:
    its ``sender``, ``message_id`` and ``round`` must be readable (and, with a keyring, its
    signature over prefix and header must verify)."""
    header = peek_header(frame)
    if header is None or header.get("sender") != agent_id:
        return None
    message_id, kind, round = header.get("message_id"), header.get("type"), header.get("round")
    if not (isinstance(message_id, str) and _ID.match(message_id)):
        return None
    if type(round) is not int or round < -1:
        return None
    if keyring is not None:
        public, signed = keyring.get(agent_id), peek_signed_part(frame)
        signer = header.get("signer")
        if public is None or signed is None or not isinstance(signer, str):
            return None
        if verify_signed_part(signed[0], signed[1], signer, public) is not None:
            return None
    meta = header.get("meta")
    task_id = meta.get("task_id") if isinstance(meta, dict) else None
    return Attribution(message_id, kind if isinstance(kind, str) and _TAG.match(kind) else "unknown", round,
                       task_id if isinstance(task_id, str) and _ID.match(task_id) else None,
                       verified=keyring is not None)


@dataclass(frozen=True)
class Accepted:
    """An update that passed every check.

    ``update`` is what the server step aggregates (train tasks); ``None`` for an
    evaluate task, whose answer is only its ``meta``.
    """

    agent_id: str
    meta: UpdateMeta
    update: ClientUpdate | None
    #: ``header.message_id`` of the update (for a NACK when the aggregation rule still refuses it)
    message_id: str = ""
    #: a late update: the closed round whose task it answers, trained from that round's state
    late: LateWindow | None = None
    #: a site aggregator's answer (``meta.site``): the partial sum of its devices' training updates
    #: (None: it has none, an evaluation round's answer)
    site: SitePart | None = None


@dataclass(frozen=True)
class StepAnswer:
    """A step of the open secure round from one of its agents (protocol 1.9): it answers
    no task; the secure round reads it (:mod:`.drivers.secure`)."""

    agent_id: str
    meta: SecAggMeta
    message_id: str = ""


class UpdateGate:
    """Admits or rejects the updates of a federation's rounds.

    ``registry`` says which agents are known and how many training samples each
    announced; ``method`` checks a training update (None for a gate that never opens a
    round: a release service's, which rejects every update). The gate remembers the id of every message it accepted in the round being
    collected, so a second copy of one is a ``duplicate``; a copy of an earlier round's
    message is ``stale`` (or ``unexpected``, its task id being an old round's), so only the
    current round's ids are kept: memory per round, not per run.
    """

    def __init__(self, federation: str, method: Method | None, registry: Registry, *, max_bytes: int,
                 keyring: Keyring | None = None):
        self.federation = federation
        self.method = method
        self.registry = registry
        self.max_bytes = max_bytes
        #: with a keyring, only updates signed by the agent's enrolled key get past the sender check
        self.keyring = keyring
        self._seen: set[str] = set()
        self._seen_round: int | None = None

    def admit(self, agent_id: str, frame: bytes, tasks: RoundTasks,
              state: ServerState | None,
              late: Mapping[int, LateWindow] | None = None) -> Accepted | Refused | Rejection | StepAnswer:
        """Check one frame from ``agent_id``'s update topic. Accepting an update or a refusal
        marks the agent's task answered, and so does a rejection that :meth:`ends_wait`.

        ``state`` is None before the first round opens (no tasks yet, so nothing is accepted).
        ``late``: closed rounds by number, whose unanswered training tasks may still be answered
        (an accepted one is marked answered there, so a copy of it is a ``duplicate``)."""
        if tasks.round != self._seen_round:
            self._seen, self._seen_round = set(), tasks.round
        try:
            message = decode(frame, max_bytes=self.max_bytes)
        except ProtocolError as exc:
            attributed = attribute_raw(agent_id, frame, self.keyring)
            if attributed is not None and attributed.message_id in self._seen:
                attributed = None  # a mangled copy of an answer already taken: nothing to tell or end
            verdict: Accepted | Refused | Rejection | StepAnswer = Rejection(agent_id, exc.reason, exc.detail,
                                                                             attributed)
        else:
            verdict = self._check(agent_id, message, tasks, state, late)
            if not isinstance(verdict, Rejection):
                self._seen.add(message.header.message_id)
        if isinstance(verdict, StepAnswer):
            pass  # a secure round's step answers no task
        elif isinstance(verdict, Accepted) and verdict.late is not None:
            verdict.late.tasks.mark_answered(agent_id)
        elif not isinstance(verdict, Rejection) or self.ends_wait(verdict, tasks):
            tasks.mark_answered(agent_id)
            orders = task.site if (task := tasks.get(agent_id)) is not None else None
            for device in (orders.train + orders.evaluate) if orders is not None else ():
                tasks.mark_answered(device)  # a site's answer (or refusal) answers for its devices
        return verdict

    @staticmethod
    def ends_wait(rejection: Rejection, tasks: RoundTasks) -> bool:
        """Whether a rejected frame answers its agent's open task (docs/PROTOCOL.md §7): it is
        the agent's own *by its signature* (only an enrolled key proves that: on an unsigned
        deployment a forged frame naming the agent would burn its task, so there no rejection
        answers one), an update or refusal for the round being collected, naming the open
        task or no readable task at all (an agent has one task per round), and rejected for
        something other than being stale, unexpected or a duplicate."""
        a, agent_id = rejection.attributed, rejection.agent_id
        if a is None or not a.verified or agent_id is None or rejection.reason in NEVER_ENDS_WAIT:
            return False
        if a.type not in (MessageType.UPDATE.value, MessageType.REFUSAL.value):
            return False
        task = tasks.get(agent_id)
        if tasks.closed or a.round != tasks.round or task is None or agent_id not in tasks.waiting:
            return False
        return a.task_id is None or a.task_id == task.task_id

    def _check(self, agent_id: str, message: Message, tasks: RoundTasks,
               state: ServerState | None,
               late: Mapping[int, LateWindow] | None = None) -> Accepted | Refused | Rejection | StepAnswer:
        h = message.header
        attributed, forged = _sender_checks(agent_id, message, self.keyring)

        def reject(reason: str, detail: str) -> Rejection:
            return Rejection(agent_id, reason, detail, attributed)

        if message.type not in (MessageType.UPDATE, MessageType.REFUSAL, MessageType.SECAGG):
            return reject("wrong_type", f"{h.type.value} on an update topic")
        if h.sender != agent_id:
            return reject("wrong_sender", f"sender {h.sender} on {agent_id}'s topic")
        if forged is not None:
            return forged
        if h.federation != self.federation:
            return reject("wrong_federation", h.federation)
        if h.message_id in self._seen:
            return reject("duplicate", f"message {h.message_id} already processed")
        if not self.registry.known(agent_id):
            return reject("unknown_agent", "no status ever received from this agent")
        if late and h.round in late and h.round != tasks.round and message.type == MessageType.UPDATE:
            return self._check_late(agent_id, message, late[h.round], reject)
        if h.round != tasks.round:
            return reject("stale", f"update for round {h.round}, current round is {tasks.round}")
        if message.type == MessageType.SECAGG:  # the secure round checks what it says (it may be closed)
            return StepAnswer(agent_id, message.meta_as(SecAggMeta), h.message_id)
        if tasks.closed:
            return reject("stale", f"update for round {h.round}, which is closed")
        answer: UpdateMeta | RefusalMeta = message.meta  # type: ignore[assignment]
        task = tasks.get(agent_id)
        if task is None or answer.task_id != task.task_id:
            return reject("unexpected", "no such task was sent to this agent this round")
        if tasks.answered(agent_id):
            return reject("duplicate", f"task {task.task_id} already answered")
        if isinstance(answer, RefusalMeta):
            reason = answer.reason if answer.reason in REFUSAL_REASONS else "error"
            return Refused(agent_id, reason, answer.detail, h.message_id, may_exclude=self.keyring is not None,
                           peers=tuple(answer.peers or ()))
        meta = answer
        if meta.kind != task.kind:
            return reject("malformed", f"answered a {task.kind} task with {meta.kind}")
        if (meta.site is None) != (task.site is None):
            return reject("malformed", "a site's answer to a device's task" if meta.site is not None
                          else "a site's task answered without the site's answer")
        if task.site is not None:
            return self._site_answer(agent_id, message, task, tasks, state, reject)
        if meta.eval_correct > meta.num_test:
            return reject("malformed", "eval_correct exceeds num_test")
        if task.kind == "evaluate":
            if message.tensors:
                return reject("malformed", "evaluate answer carries tensors")
            return Accepted(agent_id, meta, None, h.message_id)
        if state is None:  # not reached: without a state no round is open, so there was no task
            return reject("unexpected", "no round is open")
        return self._training_update(agent_id, message, task, tasks, state, reject)

    def _check_late(self, agent_id: str, message: Message, late: LateWindow,
                    reject: Callable[[str, str], Rejection]) -> Accepted | Rejection:
        """A training update for a closed round, from an agent that round dropped."""
        answer = message.meta
        task = late.tasks.get(agent_id)
        if task is None or not isinstance(answer, UpdateMeta) or answer.task_id != task.task_id:
            return reject("unexpected", f"no such task was sent to this agent in round {late.tasks.round}")
        if late.tasks.answered(agent_id):
            return reject("duplicate", f"task {task.task_id} already answered")
        if task.kind != "train" or answer.kind != "train":
            return reject("stale", f"a late {answer.kind} answer for round {late.tasks.round}: only training "
                                   "updates are folded in late")
        if answer.eval_correct > answer.num_test:
            return reject("malformed", "eval_correct exceeds num_test")
        if task.site is not None and answer.site is not None and answer.site.totals is not None:
            # a summary site's sum of an earlier state (a buffered run): over that state's parameters
            verdict = self._summary_answer(agent_id, message, task, late.state, reject)
        elif task.site is not None or answer.site is not None:
            return reject("stale", f"a site's answer for closed round {late.tasks.round}: only a summary site's "
                                   "sum is folded in late")
        else:
            verdict = self._training_update(agent_id, message, task, late.tasks, late.state, reject)
        return replace(verdict, late=late) if isinstance(verdict, Accepted) else verdict

    def _training_update(self, agent_id: str, message: Message, task: Task, tasks: RoundTasks, state: ServerState,
                         reject: Callable[[str, str], Rejection]) -> Accepted | Rejection:
        """The checks of a training update against the round its task was sent in."""
        meta: UpdateMeta = message.meta  # type: ignore[assignment]
        if meta.num_train <= 0:
            return reject("malformed", "train update with num_train = 0")
        announced = self.registry.announced_num_train(agent_id) if task.announced is None else task.announced
        if meta.num_train > announced:
            # The count is the aggregation weight: one the agent did not announce could
            # outweigh the whole fleet. (Not formatted: it may have thousands of digits.)
            return reject("malformed", f"num_train exceeds the {announced} samples its status announced")
        # What the device says it trained on, up to the round's cap: its weight (never a rejection)
        weight = meta.num_train if tasks.weight_cap is None else min(meta.num_train, tasks.weight_cap)
        tensors = message.tensors
        if task.secagg is not None:  # a masked vector: the secure round's sum checks its shape, nothing can check more
            if meta.codec is not None:
                return reject("malformed", "a secure round's update is masked, not compressed")
            return Accepted(agent_id, meta, ClientUpdate(agent_id, weight, tensors), message.header.message_id)
        if meta.codec is not None:
            decoded = self._decompressed(agent_id, message, task, state)
            if isinstance(decoded, tuple):
                return reject(*decoded)
            tensors = decoded
        update = ClientUpdate(agent_id, weight, tensors)
        if self.method is None:  # not reached: a gate without a method opens no round (a release service's)
            return reject("unexpected", "no round is open")
        try:
            self.method.check_update(state, update)
        except UpdateRejected as exc:
            return reject(exc.reason, str(exc))
        return Accepted(agent_id, meta, update, message.header.message_id)


    def _site_answer(self, agent_id: str, message: Message, task: Task, tasks: RoundTasks, state: ServerState | None,
                     reject: Callable[[str, str], Rejection]) -> Accepted | Rejection:
        """A site aggregator's answer (docs/PROTOCOL.md §20): every device it names was ordered
        to answer that kind, and its partial sum can be the sum of its training updates
        (:func:`.sites.part_of`; the round's aggregate checks the rest before any of it counts)."""
        meta: UpdateMeta = message.meta  # type: ignore[assignment]
        orders, answer = task.site, meta.site
        assert orders is not None and answer is not None  # the caller's condition
        if orders.sample is not None or answer.totals is not None:
            return self._summary_answer(agent_id, message, task, state, reject)
        ordered = {**{a: "evaluate" for a in orders.evaluate}, **{a: "train" for a in orders.train}}
        wrong = [d for d in answer.devices if ordered.get(d.agent) != d.kind]
        if wrong:
            return reject("unexpected", f"{wrong[0].agent} was not ordered to {wrong[0].kind} at this site")
        if state is None:  # not reached: a site's task was sent, so a round is open
            return reject("unexpected", "no round is open")
        for d in answer.devices:
            # a device's weight as the flat round would give it: its count, at most what its status
            # announced (through its site's) and the round's cap
            device = tasks.get(d.agent)
            most = min(device.announced if device is not None and device.announced is not None else 0,
                       orders.weight_cap or MAX_SAMPLES)
            if d.kind == "train" and (d.weight is None or d.weight > most):
                return reject("malformed", f"{d.agent}'s weight {d.weight} is above its announced count or the "
                                           f"round's cap ({most})")
        try:
            part = part_of(answer, message.tensors, state.shared_params(), orders.train)
        except AggregationRejected as exc:
            return reject(exc.reason, str(exc))
        return Accepted(agent_id, meta, None, message.header.message_id, site=part)

    def _summary_answer(self, agent_id: str, message: Message, task: Task, state: ServerState | None,
                        reject: Callable[[str, str], Rejection]) -> Accepted | Rejection:
        """A summary site's answer (``sites.mode: summary``): totals to a summary task, weighing
        no more than its site announced, and a sum that can be one (:func:`.sites.summary_part_of`)."""
        meta: UpdateMeta = message.meta  # type: ignore[assignment]
        orders, answer = task.site, meta.site
        assert orders is not None and answer is not None  # the caller's condition
        totals = answer.totals
        if orders.sample is None or totals is None:
            return reject("malformed", "a summary answer to a task of named devices" if orders.sample is None
                          else "a site's answer to a summary task without its totals")
        # what its latest status announced: a site draws from the devices online when the task
        # came, and says so before it answers (a device that came online since the round began counts)
        info = self.registry.agents.get(agent_id)
        announced = info.num_train if info is not None else 0
        if answer.total_weight > announced or (totals.trained and task.kind != "train"):
            return reject("malformed", f"site {agent_id}'s sum weighs {answer.total_weight} of {totals.trained} "
                                       f"updates; it announced {announced} training samples")
        if info is not None and totals.eval_total > info.num_test:
            return reject("malformed", f"site {agent_id} evaluated {totals.eval_total} samples; it announced "
                                       f"{info.num_test}")
        if state is None:  # not reached: a site's task was sent, so a round is open
            return reject("unexpected", "no round is open")
        try:
            part = summary_part_of(agent_id, answer, message.tensors, state.shared_params())
        except AggregationRejected as exc:
            return reject(exc.reason, str(exc))
        return Accepted(agent_id, meta, None, message.header.message_id, site=part)

    def _decompressed(self, agent_id: str, message: Message, task: Task,
                      state: ServerState) -> dict[str, np.ndarray] | tuple[str, str]:
        """A compressed update as the tensors it stands for (docs/COMPRESSION.md): its changes
        decoded onto the payload its task carried, built again from the task's state; or the
        (reason, detail) of its rejection. Only the codec the task asked for is accepted, and
        none of the tensors the method keeps exact may come compressed. The bounds, robust
        rules and exact sums that follow see an ordinary update."""
        header = message.meta_as(UpdateMeta).codec
        assert header is not None  # the caller's condition
        asked = task.uplink
        if asked is None or header.codec not in ("none", asked.codec) or header.block != asked.block:
            return "malformed", (f"update encoded {header.codec} (block {header.block}); its task asked for "
                                 + (f"{asked.codec} (block {asked.block})" if asked else "no codec"))
        rounded = [t.name for t in header.tensors if asked.is_exact(t.name)]
        if rounded:
            return "malformed", f"{rounded[0]} is one the method keeps exact, sent compressed"
        if self.method is None:  # not reached: as in _training_update
            return "unexpected", "no round is open"
        try:
            encoded = codecs.Encoded.from_arrays(header, message.tensors)
            return codecs.decode(encoded, self.method.payload_for(state, agent_id))
        except codecs.CodecError as exc:
            return exc.reason, exc.detail


def admit_presence(agent_id: str, frame: bytes, keyring: Keyring | None = None,
                   registry: Registry | None = None) -> Presence | Rejection:
    """Check a frame from ``agent_id``'s status topic: it may update the registry when it is a
    status from that agent (signed by its enrolled key, with a keyring) and, given the
    ``registry``, not older than the agent's current presence (:meth:`Registry.stale_presence`).
    A status of another major protocol version is refused (``unsupported_version``)."""
    try:
        message = decode(frame)
    except ProtocolError as exc:
        return Rejection(agent_id, exc.reason, f"status: {exc.detail}", attribute_raw(agent_id, frame, keyring))
    if message.type != MessageType.STATUS or message.header.sender != agent_id:
        return Rejection(agent_id, "wrong_sender", "status not from the agent whose topic it is on")
    attributed, forged = _sender_checks(agent_id, message, keyring)
    if forged is not None:
        return forged
    meta = message.meta_as(StatusMeta)
    if parse_version(meta.version)[0] != MAJOR:
        return Rejection(agent_id, "unsupported_version", f"status of protocol {meta.version}; this coordinator "
                                                          f"speaks major version {MAJOR}", attributed)
    if meta.num_train > MAX_SAMPLES or meta.num_test > MAX_SAMPLES:
        return Rejection(agent_id, "malformed", f"status announces more than {MAX_SAMPLES} samples", attributed)
    if registry is not None:
        stale = registry.stale_presence(agent_id, meta, message.header.created, signed=keyring is not None)
        if stale is not None:
            return Rejection(agent_id, "stale_status", stale, attributed)
    return Presence(meta, message.header.created)


def admit_metrics(agent_id: str, frame: bytes, keyring: Keyring | None = None,
                  registry: Registry | None = None) -> MetricsMeta | Rejection:
    """Check a frame from ``agent_id``'s metrics topic; returns its meta when it is a consistent
    report from that agent (signed by its enrolled key, with a keyring; from an agent the
    ``registry`` knows, when given)."""
    try:
        message = decode(frame)
    except ProtocolError as exc:
        return Rejection(agent_id, exc.reason, exc.detail, attribute_raw(agent_id, frame, keyring))
    attributed, forged = _sender_checks(agent_id, message, keyring)
    if message.type != MessageType.METRICS or message.header.sender != agent_id:
        return Rejection(agent_id, "malformed", "not a metrics message from this agent", attributed)
    if forged is not None:
        return forged
    if registry is not None and not registry.known(agent_id):
        return Rejection(agent_id, "unknown_agent", "metrics from an agent that never announced itself")
    meta = message.meta_as(MetricsMeta)
    if meta.eval_correct > meta.num_test:
        return Rejection(agent_id, "malformed", "eval_correct exceeds num_test", attributed)
    return meta


def admit_state(before: ServerState, after: ServerState, max_change_ratio: float | None) -> Rejection | None:
    """Check a round's closed aggregate before it becomes the global state: None to adopt it,
    else a :class:`Rejection` (``non_finite``: a float tensor of the new state holds NaN or
    Inf; ``diverged``: the shared parameters move by more than ``max_change_ratio`` times
    their norm, taken as at least 1 so that a state near zero may still move; BatchNorm's
    running statistics are not counted)."""
    tensors = [*after.global_tensors.items(), *((f"{a}:{k}", v) for a, t in after.client_tensors.items()
                                                for k, v in t.items())]
    for key, value in tensors:
        arr = np.asarray(value)
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            return Rejection(None, "non_finite", f"the aggregate's {key} holds NaN or Inf")
    if max_change_ratio is None:
        return None
    old, new = before.shared_params(), after.shared_params()
    # the learned parameters: BatchNorm's running statistics estimate the devices' data, and a
    # fleet with one skewed device honestly moves a variance by thousands of times its norm
    # share (they are bounded per channel in their own geometry, UpdateBound)
    floats = [k for k, v in old.items() if v.dtype.kind == "f" and k in new
              and k.rpartition(".")[2] not in STATISTIC_LEAVES]
    change = math.sqrt(sum(float(np.sum(np.square(new[k].astype(np.float64) - old[k]))) for k in floats))
    norm = math.sqrt(sum(float(np.sum(np.square(old[k].astype(np.float64)))) for k in floats))
    if change > max_change_ratio * max(norm, 1.0):
        return Rejection(None, "diverged", f"the aggregate moves the shared parameters by {change:.4g}, more than "
                                           f"{max_change_ratio:g} x their norm {norm:.4g}")
    return None
