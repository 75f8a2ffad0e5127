"""The round loop, written once for every method and both fleets.

:meth:`Coordinator.run` is the protocol's coordinator side (``docs/PROTOCOL.md`` §10):
wait for ``min_agents`` trainers; then per round sample a fraction of the online
trainers, send each a task (shared parameters + method payload; the others an
evaluate task on evaluation rounds), collect answers until every sampled agent
answered — or, with a quorum, until the round timeout passes or everyone still owing
an answer went offline — close the round's aggregate, append a metrics row and
checkpoint atomically; a final evaluation round; a release of the frozen encoder to
head-tier agents and their reports; ``done``. A restarted coordinator resumes after
the last checkpointed round with the same global state.

The server step is spread over the round: when the tasks go out the method opens the
round's aggregate (:meth:`~edgepfl.methods.Method.open_round`, with the run's
aggregation rule), every accepted update is added to it on arrival (a streaming rule
keeps running sums, not the updates), and at quorum it is closed into a candidate
state. The candidate is adopted only if it is finite and moves the shared parameters
no more than ``aggregation.max_change_ratio`` allows; otherwise the round is aborted
with that reason and the state kept. After ``aggregation.rollback_after`` aborted rounds
in a row the state goes back to the last good one: the last state a round was adopted
from, kept on disk beside the checkpoint (``checkpoint/good-<round>/``).

Every wait is :meth:`.inbox.Inbox.pump_until` with a condition: statuses go to the
:class:`~.registry.Registry`, updates through the :class:`~.gate.UpdateGate` into the
open round, head-tier metrics to the head reports, and every rejection, by reason, to
the counters that ``metrics.jsonl``, the checkpoint and the log show.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgepfl.aggregation import capped_accuracy, weight_cap
from edgepfl.config import ConfigError, RunConfig
from edgepfl.methods import Method, RoundAggregate, ServerState, create_method
from edgepfl.metrics import RoundMetrics, read_metrics, record_run_end, record_run_start
from edgepfl.protocol import (
    Body,
    CoordinatorMeta,
    MessageType,
    RunSpec,
    TaskMeta,
    encode,
    encode_body,
    new_message_id,
    seed_for,
)
from edgepfl.protocol.signing import Keyring, load_signer
from edgepfl.state import CheckpointError, CheckpointMeta, load_checkpoint, save_checkpoint

from .fleet import SENDER, Fleet
from .gate import Accepted, RoundTasks, Task, UpdateGate, admit_state
from .inbox import Inbox
from .nack import Nacker
from .observe import Observer
from .presence import PresenceWatch
from .progress import Progress
from .registry import Registry

log = logging.getLogger("edgepfl.coordinator")

# Keeps the evaluators' sample independent of the trainers' drawn from the same seed and round.
EVALUATION_STREAM = 1


def sample_agents(online: list[str], fraction: float, seed: int, round: int) -> list[str]:
    """Deterministic per (seed, round): the same sample whether or not the coordinator restarted."""
    if not online:
        return []
    return draw(online, max(1, round_half_up(fraction * len(online))), [seed, round])


def draw(agents: list[str], k: int, entropy: list[int]) -> list[str]:
    """``k`` of ``agents`` (all of them when ``k`` reaches their number), sorted; the same for the same ``entropy``."""
    if k >= len(agents):
        return sorted(agents)
    if k <= 0:
        return []
    rng = np.random.default_rng(entropy)
    return sorted(rng.choice(sorted(agents), size=k, replace=False).tolist())


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


@dataclass
class RoundResult:
    """What one round collected: its open aggregate, evaluations, rejections, traffic.

    Accepted training updates go straight into ``aggregate`` (None in a round where
    nobody trains); the result itself keeps no update's tensors.
    """

    round: int
    aggregate: RoundAggregate | None = None
    participants: list[str] = field(default_factory=list)
    #: participants whose update the rule's bound clipped (aggregation.on_large_update: clip)
    clipped: list[str] = field(default_factory=list)
    evaluations: dict[str, dict] = field(default_factory=dict)
    rejected: Counter = field(default_factory=Counter)
    #: tasks refused by their agents, by reason
    refused: Counter = field(default_factory=Counter)
    bytes_up: int = 0
    bytes_down: int = 0
    dropped: list[str] = field(default_factory=list)
    sampled: list[str] = field(default_factory=list)

    def record(self, accepted: Accepted, wire_bytes: int) -> None:
        """Count an answer the gate accepted; a training update is added to the round's
        aggregate first, and one the rule refuses (``AggregationRejected``) counts for nothing."""
        if accepted.update is not None:
            # a train task, hence a training round with its aggregate
            assert self.aggregate is not None
            if self.aggregate.add(accepted.update):
                log.warning("round %d: the update from %s moved the shared parameters past the update bound "
                            "(aggregation.max_update_ratio); clipped onto it", self.round, accepted.agent_id)
                self.clipped.append(accepted.agent_id)
            self.participants.append(accepted.agent_id)
        meta = accepted.meta
        self.bytes_up += wire_bytes
        self.evaluations[accepted.agent_id] = {
            "correct": meta.eval_correct, "total": meta.num_test, "loss": meta.eval_loss,
            "train_loss": meta.train_loss, "kind": meta.kind, "train_seconds": meta.train_seconds,
        }


class Coordinator:
    """Runs a federation described by a :class:`RunConfig` over a :class:`Fleet`."""

    def __init__(self, config: RunConfig, fleet: Fleet, out_dir: str | Path, *, input_shape=None, num_classes=None,
                 class_names=None, normalization=None, progress: bool = True):
        self.config = config
        self.fleet = fleet
        self.out_dir = Path(out_dir)
        self.method: Method = create_method(config.method.name, config.method.options())
        input_shape, num_classes = input_shape or config.input_shape, num_classes or config.num_classes
        if input_shape is None or num_classes is None:  # the message RunConfig.run_spec gives
            raise ConfigError("input_shape and num_classes are unknown: read them from the data or set them")
        self.input_shape = tuple(input_shape)
        self.num_classes = int(num_classes)
        self.class_names = list(class_names or [])
        # Every task says how inputs are normalized, so that no trainer guesses (PROTOCOL §5, task).
        self.normalization = normalization or config.normalization
        if not self.normalization:
            raise ConfigError("the input normalization is unknown: read it from the data or set "
                              "normalization: {mean: [...], std: [...]} in the run config")
        self.progress = Progress(config.rounds, enabled=progress)
        self.rejected_total: Counter = Counter()
        self.refused_total: Counter = Counter()  # refused tasks by reason, every round of the run (checkpointed)
        self.registry = Registry()
        self.registry.require(config.method.name, config.model.arch)
        security = config.security
        # With a signing key every task and release is signed; with enrolled_dir only
        # enrolled agents' signed statuses, updates and metrics get in (PROTOCOL.md §3a).
        self.signer = load_signer(security.signing_key) if security.signing_key else None
        keyring = Keyring(Path(security.enrolled_dir)) if security.enrolled_dir else None
        gate = UpdateGate(config.federation, self.method, self.registry, max_bytes=config.broker.max_payload_bytes,
                          keyring=keyring)
        self.observer = Observer(config, fleet, self.registry, self.rejected_total, self.refused_total)
        self.inbox = Inbox(fleet, self.registry, gate, self.rejected_total, tick=self.observer.tick, keyring=keyring,
                           presence=PresenceWatch(self.registry, config.expected_agents),
                           nacks=Nacker(config.federation, fleet, self.registry, self.signer))
        self.epoch = int(time.time() * 1000)  # a resumed run keeps its checkpoint's (init_or_resume)
        self.state: ServerState | None = None
        self.start_round = 0
        self.aborted_streak = 0  # training rounds aborted in a row
        self.good_round: int | None = None  # the last good state is the one after this round (good-<round>/)
        self.releases: dict[str, int] = {}  # release id -> the round it was exported after, in publishing order

    @property
    def head_reports(self) -> dict[str, dict]:
        """Head-tier reports on the latest release, by agent id (``head_metrics.json`` keeps every release's)."""
        latest = next(reversed(self.releases), None)
        return self.inbox.reports_by_release.get(latest, {}) if latest else {}

    # ---------------------------------------------------------------- state
    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def _run_dict(self) -> RunSpec:
        """The run spec every task carries (and checkpoints and releases record)."""
        return self.config.run_spec(self.input_shape, self.num_classes, self.class_names, self.normalization)

    def init_or_resume(self) -> None:
        """Fresh server state from a seeded model, or the last checkpoint if one exists."""
        found = load_checkpoint(self.checkpoint_dir)
        if found is not None:
            state, meta = found
            if meta.run.method.name != self.config.method.name:
                raise RuntimeError(f"{self.checkpoint_dir} holds a {meta.run.method.name} run, config says "
                                   f"{self.config.method.name}; use another --out")
            self.state, self.start_round = state, meta.round + 1
            self.rejected_total.update(meta.rejected_total)
            self.refused_total.update(meta.refused_total)
            self.aborted_streak, self.good_round = meta.aborted_streak, meta.good_round
            self.epoch = meta.epoch if meta.epoch is not None else self.epoch
            log.info("resuming from checkpoint after round %d", meta.round)
            self._truncate_metrics(self.start_round)
            return
        import torch

        from edgepfl.config import ModelSpec

        torch.manual_seed(seed_for(self.config.seed, "global-init"))
        model = self.method.build_model(ModelSpec(**self.config.model.model_dump()), self.input_shape, self.num_classes)
        self.state = self.method.init_server(model)
        self.start_round = 0

    def _server_state(self) -> ServerState:
        """The global state, which :meth:`init_or_resume` sets (:meth:`run` calls it first)."""
        if self.state is None:
            raise RuntimeError("no server state yet: call init_or_resume() first")
        return self.state

    def run_meta(self, round: int) -> CheckpointMeta:
        """What a checkpoint (and an export) records about this run as of ``round``."""
        return CheckpointMeta(round=round, run=self._run_dict(), data_spec=self.config.data,
                              rejected_total=dict(self.rejected_total), refused_total=dict(self.refused_total),
                              aborted_streak=self.aborted_streak,
                              good_round=self.good_round, epoch=self.epoch)

    def _checkpoint(self, round: int) -> None:
        save_checkpoint(self.checkpoint_dir, self._server_state(), self.run_meta(round))
        # Only now, with the checkpoint naming the current good state, may older ones go.
        for stale in self.checkpoint_dir.glob("good-*"):
            if stale.name != self._good_dir(self.good_round).name:
                shutil.rmtree(stale, ignore_errors=True)

    def _good_dir(self, round: int | None) -> Path:
        return self.checkpoint_dir / f"good-{round}"

    # ---------------------------------------------------------------- main loop
    def run(self) -> list[RoundMetrics]:
        """Wait for agents, run the remaining rounds and a final evaluation; return metrics rows."""
        if self.state is None:
            self.init_or_resume()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        resumed_from = self.start_round - 1 if self.start_round else None
        record_run_start(self.out_dir, resumed_from)
        self.observer.start(resumed_from)
        self.observer.enter("waiting", self.start_round)
        try:
            rows = self._run_all()
        finally:
            self.observer.close()
        record_run_end(self.out_dir)
        return rows

    def _run_all(self) -> list[RoundMetrics]:
        c = self.config
        self._wait_for_agents()
        rows = []
        for r in range(self.start_round, c.rounds):
            if r > self.start_round:
                # Agents that dropped out get up to one round timeout to come back before we go on without them.
                self._wait_for_agents(required=False)
            self.fleet.announce(CoordinatorMeta(state="online", method=c.method.name, round=r))
            rows.append(self._run_round(r, final=False))
            if c.release_every and (r + 1) % c.release_every == 0 and r + 1 < c.rounds:
                self.release(r)
        rows.append(self._run_round(c.rounds, final=True))
        if c.release_at_end or c.release_every:
            self.release(c.rounds - 1)
            self._collect_head_reports(timeout=c.round_timeout_s)
        self.fleet.announce(CoordinatorMeta(state="done", method=c.method.name, round=c.rounds))
        self.observer.enter("done", c.rounds)
        return rows

    def _wait_for_agents(self, required: bool = True) -> None:
        """Block until ``min_agents`` trainers that may be sent this run's tasks are online
        (:meth:`Registry.eligible`: capable, not busy, not excluded). Before round 0 that is required
        (TimeoutError after ``wait_for_agents_s``); between rounds we wait at most one
        round timeout and go on with whoever is there."""
        need = self.config.min_agents
        wait = self.config.wait_for_agents_s if required else self.config.round_timeout_s
        shown, shown_at = -1, float("-inf")

        def enough() -> bool:
            nonlocal shown, shown_at
            online = self.registry.count_eligible()
            # at most a line a second: a thousand agents coming online are not a thousand lines
            if online < need and online != shown and time.monotonic() - shown_at >= 1.0:
                self.progress.note(f"waiting for agents: {online}/{need} online")
                shown, shown_at = online, time.monotonic()
            return online >= need

        if self.inbox.pump_until(enough, time.monotonic() + wait):
            return
        online = self.registry.count_eligible()
        if not required and online:
            log.warning("only %d of min_agents=%d online; going on without the others", online, need)
            return
        raise TimeoutError(f"only {online} of min_agents={need} capable trainer agents came online within "
                           f"{self.config.wait_for_agents_s:.0f}s")

    def _run_round(self, r: int, final: bool) -> RoundMetrics:
        """One round: sample, send tasks, collect, close the aggregate, metrics row, checkpoint."""
        started = time.monotonic()
        self.inbox.presence.round_starts(r)
        sampled, evaluators = self._sample(r, final)
        tasks, result = self._send_tasks(r, sampled, evaluators)
        self.observer.enter("evaluating" if final else "training", r)
        self._collect(tasks, result, started)
        tasks.close()  # an answer after this is stale: the aggregate is closed next
        self.observer.enter("aggregating", r)
        for agent_id in result.dropped:
            self.registry.mark_unresponsive(agent_id, silent_since=started)
        previous = self.state
        abort = self._server_step(result)
        rolled_back = self._after_abort(r, abort) if abort else None
        row = self._row(result, time.monotonic() - started, final, abort, rolled_back)
        self.refused_total.update(row.refused)
        # Row first, checkpoint second: a crash in between leaves a row that the resumed
        # run drops and writes again (see _truncate_metrics), never a round without a row.
        self._append_metrics(row)
        if sampled:
            if abort is None and previous is not None and self.config.aggregation.rollback_after:
                # A round trained from `previous` was adopted: it is the last good state.
                # Written before the checkpoint that names it, so a crash between the two
                # leaves the checkpoint naming the older good state, still on disk.
                save_checkpoint(self._good_dir(r - 1), previous, self.run_meta(r - 1))
                self.good_round = r - 1
            self._checkpoint(r)
        self.progress.update(row)
        self.observer.round_done(row)
        return row

    def _sample(self, r: int, final: bool) -> tuple[list[str], list[str]]:
        """Who trains this round (a seeded sample of the online trainers; nobody in the
        final round) and who only evaluates, on evaluation rounds: enough of the other
        online trainers, drawn with the seed and round, that ``eval_fraction`` of the
        online trainers (``final_eval_fraction`` in the final round) are evaluated. The
        trainers count: each evaluates the global model before it trains."""
        c = self.config
        # Only trainers that may run this run's tasks (capable, not busy, not excluded by a
        # refusal). Agents that let their last task time out are skipped until they show
        # life (any frame), so a dead agent does not cost every later round its timeout; if
        # nobody is left, every eligible one gets another chance.
        online = self.registry.responsive() or self.registry.eligible()
        sampled = [] if final else sample_agents(online, c.fraction, c.seed, r)
        if not (final or r % c.eval_every == 0):
            return sampled, []
        training = set(sampled)
        idle = [a for a in online if a not in training]
        share = c.eval_fraction if not final or c.final_eval_fraction is None else c.final_eval_fraction
        wanted = max(1, round_half_up(share * len(online))) - len(sampled)
        return sampled, draw(idle, wanted, [c.seed, r, EVALUATION_STREAM])

    def _send_tasks(self, r: int, sampled: list[str], evaluators: list[str]) -> tuple[RoundTasks, RoundResult]:
        """Open round ``r`` and send each agent its task; returns the tasks and the round's (empty) result."""
        c = self.config
        announced = {a: self.registry.announced_num_train(a) for a in sampled}
        tasks = RoundTasks(r, weight_cap(announced.values(), c.aggregation.max_weight_ratio))
        result = RoundResult(round=r, sampled=sampled)
        state = self._server_state()
        if sampled:
            result.aggregate = self.method.open_round(state, c.aggregation.build())
        self.inbox.open_round(tasks, result, state)
        run = self._run_dict()
        # Most methods send every agent the same tensors: encode and hash them once per round.
        # The payload is held with its body so that its arrays' ids cannot be reused by
        # another agent's payload while the loop runs.
        bodies: dict[tuple[tuple[str, int], ...], tuple[dict, Body]] = {}
        for agent_id, kind in [(a, "train") for a in sampled] + [(a, "evaluate") for a in evaluators]:
            task_id = new_message_id()
            meta = TaskMeta(task_id=task_id, kind=kind, run=run, seed=seed_for(c.seed, r, agent_id),
                            deadline_s=c.round_timeout_s, epoch=self.epoch)
            payload = self.method.payload_for(state, agent_id)
            key = tuple((name, id(array)) for name, array in payload.items())
            if key not in bodies:
                bodies[key] = (payload, encode_body(payload))
            # signed per agent over its own header only: the shared body is hashed once per round
            frame = encode(MessageType.TASK, federation=c.federation, sender=SENDER, round=r, meta=meta,
                           body=bodies[key][1], signer=self.signer,
                           recipient=agent_id if self.signer is not None else None)
            tasks.add(Task(agent_id, task_id, kind, announced.get(agent_id)))
            result.bytes_down += self.fleet.send(agent_id, frame, r)
            if not self.fleet.send_ready():
                # Unacknowledged tasks wait in the transport: at 1,000 agents a round's worth
                # is 1,000 x the model. Answers are admitted meanwhile (their tasks are added).
                self.inbox.pump_until(self.fleet.send_ready, time.monotonic() + c.round_timeout_s)
        return tasks, result

    def _collect(self, tasks: RoundTasks, result: RoundResult, started: float) -> None:
        """Admit answers until every task is answered or, once a quorum of updates is in,
        the round timeout passes or every agent still owing an answer is offline; never
        past twice the timeout. Whoever has not answered then is dropped from the round."""
        timeout = self.config.round_timeout_s
        quorum = self._quorum(len(result.sampled))
        waiting = tasks.waiting  # live: the gate removes agents as they answer

        def closable() -> bool:
            if not waiting:
                return True
            if len(result.participants) < quorum:
                return False
            # is_online is a dict lookup, and any() stops at the first agent still online:
            # no per-message work that grows with the fleet.
            return time.monotonic() - started > timeout or not any(self.registry.is_online(a) for a in waiting)

        self.inbox.pump_until(closable, started + 2 * timeout)
        if waiting:
            log.info("round %d: closed with %d/%d updates after %.0fs; no answer from %s", result.round,
                     len(result.participants), len(result.sampled), time.monotonic() - started, ", ".join(sorted(waiting)))
            result.dropped.extend(sorted(waiting))

    def _server_step(self, result: RoundResult) -> str | None:
        """Close the round's aggregate when a quorum was added and adopt it if it passes
        :func:`~.gate.admit_state`; returns why the round was aborted (None: adopted)."""
        aggregate, result.aggregate = result.aggregate, None  # the round's sums go with this call
        if not result.sampled or aggregate is None:
            return None
        quorum = self._quorum(len(result.sampled))
        if aggregate.count == 0 or aggregate.count < quorum:
            log.warning("round %d: %d of %d updates, below quorum %d; global state unchanged", result.round,
                        aggregate.count, len(result.sampled), quorum)
            return "below_quorum"
        candidate = aggregate.close(result.round)
        refused = admit_state(aggregate.state, candidate, self.config.aggregation.max_change_ratio)
        if refused is not None:
            log.warning("round %d: aggregate not adopted: %s (%s); global state unchanged", result.round,
                        refused.reason, refused.detail)
            return refused.reason
        self.state = candidate
        self.aborted_streak = 0
        return None

    def _after_abort(self, r: int, reason: str) -> int | None:
        """Count an aborted round; after ``rollback_after`` in a row, go back to the last
        good state and return the round it is the state after (None: no rollback)."""
        self.aborted_streak += 1
        limit = self.config.aggregation.rollback_after
        if limit is None or self.aborted_streak < limit:
            return None
        streak, self.aborted_streak = self.aborted_streak, 0
        good = self.good_round
        found = None
        if good is not None:
            try:
                found = load_checkpoint(self._good_dir(good))
            except CheckpointError as exc:
                log.error("round %d: the last good state (good-%d) cannot be read: %s", r, good, exc)
        if found is None:
            log.error("round %d: %d rounds in a row aborted (last: %s) and no earlier good state to go back to; "
                      "going on with the current state", r, streak, reason)
            return None
        self.state = found[0]
        # Now at the good state: nothing older is kept, so a further run of aborts only says so.
        self.good_round = None
        log.error("round %d: %d rounds in a row aborted (last: %s); rolled back to the last good state, "
                  "the global state after round %d", r, streak, reason, good)
        return good

    def _quorum(self, sampled: int) -> int:
        return math.ceil(self.config.quorum * sampled)

    # ---------------------------------------------------------------- releases
    def release(self, round: int) -> str | None:
        """Export the frozen encoder and publish it (retained) for head-tier agents."""
        from .release import build_release, publish_release

        self.observer.enter("releasing", round)
        release_id, frame = build_release(self._server_state(), self.run_meta(round), self.out_dir / "releases",
                                          self.config, signer=self.signer)
        publish_release(self.fleet, frame, round, self.out_dir / "releases")
        self.releases[release_id] = round
        self.observer.released(release_id)
        self.progress.note(f"released encoder {release_id} ({len(frame) / 1e6:.2f} MB) to head-tier agents")
        return release_id

    def _collect_head_reports(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a report from every online head agent; write what came."""
        heads = self.registry.online("head")
        if not heads or not self.releases:
            return
        self.inbox.expect_reports(heads, next(reversed(self.releases)))
        self.inbox.pump_until(self.inbox.reports_complete, time.monotonic() + timeout)
        self._write_head_reports()

    def _write_head_reports(self) -> None:
        """Every release's reports, by release id; a resumed run keeps those of its earlier sessions."""
        from edgepfl.atomic import write_json
        from edgepfl.metrics import HEAD_METRICS_FILE, ReleaseReports, read_head_metrics

        try:
            head = read_head_metrics(self.out_dir)
        except ValueError as exc:  # an older run's file: replaced
            log.warning("%s", exc)
            head = {}
        for release_id, reports in self.inbox.reports_by_release.items():
            earlier = head[release_id].round if release_id in head else None
            head[release_id] = ReleaseReports(round=self.releases.get(release_id, earlier), reports=reports)
        write_json(self.out_dir / HEAD_METRICS_FILE, {k: v.model_dump(mode="json") for k, v in head.items()})

    # ---------------------------------------------------------------- metrics
    def _row(self, result: RoundResult, seconds: float, final: bool, abort: str | None,
             rolled_back: int | None) -> RoundMetrics:
        evals = result.evaluations
        losses = [e["train_loss"] for e in evals.values() if e["train_loss"] is not None]
        return RoundMetrics(
            round=result.round,
            final=final,
            accuracy=capped_accuracy(((e["correct"], e["total"]) for e in evals.values()),
                                     self.config.aggregation.max_weight_ratio),
            per_client={a: (e["correct"] / e["total"] if e["total"] else None) for a, e in sorted(evals.items())},
            participants=sorted(result.participants),
            clipped=sorted(result.clipped),
            sampled=result.sampled,
            evaluated=len(evals),
            dropped=sorted(result.dropped),
            rejected=dict(result.rejected),
            refused=dict(result.refused),
            aborted=abort is not None,
            abort_reason=abort,
            rolled_back_to=rolled_back,
            train_loss=float(np.mean(losses)) if losses else None,
            bytes_up=result.bytes_up,
            bytes_down=result.bytes_down,
            shared_bytes=int(sum(v.nbytes for v in self._server_state().shared_params().values())),
            seconds=round(seconds, 4),
        )

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def _append_metrics(self, row: RoundMetrics) -> None:
        with self.metrics_path.open("a") as fh:
            fh.write(row.to_line())
            fh.flush()

    def _truncate_metrics(self, start_round: int) -> None:
        """Drop rows the resumed run will write again (written after the last checkpoint)."""
        if not self.metrics_path.exists():
            return
        # a row torn by a crash belongs to a round the checkpoint does not hold: it runs again
        rows = read_metrics(self.metrics_path, drop_torn_tail=True)
        keep = [row for row in rows if row.round < start_round and not row.final]
        from edgepfl.atomic import write_bytes

        write_bytes(self.metrics_path, "".join(row.to_line() for row in keep).encode())
