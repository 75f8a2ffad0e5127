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
import time
from collections.abc import Callable
from pathlib import Path

from edgepfl.aggregation import AggregationRejected, weight_cap
from edgepfl.config import ConfigError, RunConfig
from edgepfl.failpoints import failpoint
from edgepfl.methods import Method, ServerState, create_method
from edgepfl.metrics import HeadReport, RoundMetrics
from edgepfl.protocol import (
    GRADIENT_CLIP,
    INPUT_KINDS,
    CoordinatorMeta,
    RunSpec,
    seed_for,
)
from edgepfl.protocol.secagg import SecAggTask
from edgepfl.protocol.site import SiteOrders
from edgepfl.state import CheckpointMeta

from .drivers import SyncRounds, driver_for
from .fleet import Fleet
from .gate import Refused, StepAnswer, admit_state
from .privacy import PrivacyLedger
from .progress import Progress
from .registry import Registry
from .releases.release import resume_release
from .result import RoundResult
from .rollback import RollbackPolicy
from .round_tasks import PATIENCE_SHARE, ClosedRounds, RoundTasks, Task
from .run_dir import RunDirectory
from .sampling import choose_participants
from .tasks import TaskWriter
from .wiring import wire

log = logging.getLogger("edgepfl.coordinator")

class Coordinator:
    """Runs a federation described by a :class:`RunConfig` over a :class:`Fleet`."""

    def __init__(self, config: RunConfig, fleet: Fleet, out_dir: str | Path, *, input_shape=None, num_classes=None,
                 class_names=None, normalization=None, channel_names=None, progress: bool = True):
        self.config, self.fleet, self.clock = config, fleet, fleet.clock  # deadlines: the fleet's (maybe virtual) clock
        self.method: Method = create_method(config.method.name, config.method.options())
        #: what every task carries, and checkpoints and releases record
        self.run_spec: RunSpec = run_spec_of(config, input_shape, num_classes, class_names, normalization, channel_names)
        side = wire(config, fleet, self.method)
        self.registry, self.counters, self.observer, self.inbox = side.registry, side.counters, side.observer, side.inbox
        self.signer, self.enrols, self.sites = side.credentials.signer, side.credentials.keyring is not None, side.sites
        require_capable(self.registry, config, self.run_spec)
        self.progress, self.run_dir = Progress(config.rounds, enabled=progress), RunDirectory(out_dir)
        self.rollback = RollbackPolicy(config.aggregation.rollback_after, self.run_dir)
        self.privacy = PrivacyLedger(config, Path(out_dir))  # before a resume drops any row: what was spent
        self.task_writer = TaskWriter(config, self.run_spec, self.method, self.signer)
        self.epoch = int(time.time() * 1000)  # a resumed run keeps its checkpoint's (init_or_resume)
        self.state: ServerState | None = None
        self.start_round, self._sampled_from = 0, 0
        self.releases: dict[str, int] = {}  # release id -> the round it was exported after, in publishing order
        #: closed training rounds' tasks and the states they were built from: their stragglers' late updates
        self._closed_rounds = ClosedRounds(config.staleness_limit)

    @property
    def head_reports(self) -> dict[str, HeadReport]:
        """Head-tier reports on the latest release, by agent id (``head_metrics.json`` keeps every release's)."""
        latest = next(reversed(self.releases), None)
        return self.inbox.reports_by_release.get(latest, {}) if latest else {}

    def init_or_resume(self) -> None:
        """Fresh server state from a seeded model, or the last checkpoint if one exists."""
        found = self.run_dir.load_checkpoint()
        if found is not None:
            state, meta = found
            if meta.run.method.name != self.config.method.name:
                raise RuntimeError(f"{self.run_dir.checkpoint_dir} holds a {meta.run.method.name} run, config says "
                                   f"{self.config.method.name}; use another --out")
            self.state, self.start_round = state, meta.round + 1
            self.counters.restore(meta)
            self.rollback.restore(meta)
            self.epoch = meta.epoch if meta.epoch is not None else self.epoch
            log.info("resuming from checkpoint after round %d", meta.round)
            self.run_dir.drop_rows_from(self.start_round)
        else:
            # rows a session wrote before its first checkpoint: that session left nothing to resume
            self.run_dir.drop_rows_from(0)
            self.state, self.start_round = initial_state(self.config, self.method, self.run_spec), 0
        # the fleet's release, this run's (named in the presence again) or an earlier run's the broker retains
        resume_release(self.fleet, self.run_dir.releases_dir, on_current=lambda ref: self.observer.released(ref.release_id))

    def server_state(self) -> ServerState:
        """The global state, which :meth:`init_or_resume` sets (:meth:`run` calls it first)."""
        if self.state is None:
            raise RuntimeError("no server state yet: call init_or_resume() first")
        return self.state

    def checkpoint_meta(self, round: int) -> CheckpointMeta:
        """What a checkpoint (and an export) records about this run as of ``round``."""
        return CheckpointMeta(round=round, run=self.run_spec, data_spec=self.config.data,
                              rejected_total=dict(self.counters.rejected), refused_total=dict(self.counters.refused),
                              aborted_streak=self.rollback.aborted_streak,
                              good_round=self.rollback.good_round, epoch=self.epoch)

    # ---------------------------------------------------------------- main loop
    def run(self) -> list[RoundMetrics]:
        """Wait for agents, run the remaining rounds and a final evaluation; return metrics rows."""
        if self.state is None:
            self.init_or_resume()
        resumed_from = self.start_round - 1 if self.start_round else None
        self.run_dir.open(resumed_from, virtual_clock=self.clock.virtual)
        self.observer.start(resumed_from)
        self.observer.enter("waiting", self.start_round)
        try:
            rows = self._run_all()
        finally:
            self.observer.close()
        self.run_dir.close()
        return rows

    def _run_all(self) -> list[RoundMetrics]:
        c = self.config
        # an agent that announced a smaller largest frame than this run's tasks is sent none (PROTOCOL.md §15)
        task_bytes = self.task_writer.task_bytes(self.server_state())
        self.registry.require(c.method.name, c.model.arch, task_bytes)
        self.inbox.expect_updates(task_bytes)  # what an agent with a task may reserve for its chunked answer
        driver = driver_for(c, self)
        wait_for_agents(self)
        rows = []
        began = self.clock.now()
        for r in range(self.start_round, c.rounds):
            if c.time_budget_s is not None and self.clock.now() - began >= c.time_budget_s:
                log.info("time budget of %.0fs spent after round %d; final evaluation", c.time_budget_s, r - 1)
                break
            if not self.privacy.allows_round(len(self.registry.responsive(r) or self.registry.eligible())):
                break  # the budget of privacy.epsilon_budget is spent: the final evaluation follows
            if r > self.start_round and driver.waits_between_rounds:
                # Agents that dropped out get up to one round timeout to come back before we go on without them.
                wait_for_agents(self, required=False)
            self.fleet.announce(CoordinatorMeta(state="online", method=c.method.name, round=r))
            rows.append(driver.run_round(r))
            if c.release_every and (r + 1) % c.release_every == 0 and r + 1 < c.rounds:
                self.release(r)
        trained = rows[-1].round + 1 if rows else self.start_round  # c.rounds, unless the time budget ran out
        rows.append(SyncRounds(self).run_round(trained, final=True))
        if c.release_at_end or c.release_every:
            self.release(trained - 1)
            self._collect_head_reports(timeout=c.round_timeout_s)
        self.fleet.announce(CoordinatorMeta(state="done", method=c.method.name, round=trained))
        self.observer.enter("done", trained)
        return rows

    def close_round(self, tasks: RoundTasks, result: RoundResult, started: float, final: bool,
                    quorum: int) -> RoundMetrics:
        """Stop collecting, adopt the aggregate if it passes (at least ``quorum`` updates),
        write the metrics row, then the checkpoint."""
        r = tasks.round
        tasks.close()  # an answer after this is stale (or, from a dropped agent, late): the aggregate is closed next
        self.observer.enter("aggregating", r)
        previous, trained = self.server_state(), result.aggregate is not None
        if trained:
            self._closed_rounds.add(tasks, previous)
        abort = self._server_step(tasks, result, quorum)
        rolled_back = self._roll_back(r, abort) if abort else None
        row = result.to_metrics(seconds=self.clock.now() - started, final=final, abort=abort, rolled_back=rolled_back,
                                shared_bytes=int(sum(v.nbytes for v in self.server_state().shared_params().values())),
                                max_weight_ratio=self.config.aggregation.max_weight_ratio)
        # Row first, checkpoint second: a crash in between leaves a row that the resumed
        # run drops and writes again (RunDirectory.drop_rows_from), never a round without a row.
        self.run_dir.append_row(row)
        failpoint("round.row_appended")
        if trained:
            if abort is None:  # a round trained from `previous` was adopted: it is the last good state
                self.rollback.keep_good_state(previous, self.checkpoint_meta(r - 1))
                failpoint("round.good_state_kept")
            self.run_dir.save_checkpoint(self.server_state(), self.checkpoint_meta(r))
        self.progress.update(row)
        self.observer.round_done(row)
        return row

    # ------------------------------------------------------- the round drivers' context
    def sample(self, r: int, final: bool) -> tuple[list[str], list[str]]:
        """Who trains round ``r`` and who only evaluates (:func:`.sampling.choose_participants`).
        Agents that let their tasks time out, or kept the round waiting for a refusal, sit out
        rounds (:meth:`.Registry.missed`, :meth:`.Registry.held_up`), so such an agent does not
        cost every round its wait; the final evaluation skips those that did so twice or more in
        a row; if nobody is left, every eligible one is asked."""
        self.inbox.presence.round_starts(r)
        online = self.registry.responsive(r, final) or self.registry.eligible()
        self._sampled_from = len(online)  # the population a private round's sample was drawn from
        if self.sites is not None and self.sites.summary:  # every site, each drawing its own devices
            return ([], online) if final else (online, [])
        return choose_participants(online, self.config, r, final)

    def open_round(self, r: int, sampled: list[str], late: bool,
                   final: bool = False) -> tuple[RoundTasks, RoundResult, ServerState]:
        """Open round ``r`` for answers (its aggregate when ``sampled`` train; with ``late``,
        closed rounds' late updates too), its tasks built from the current state; ``final``:
        the run's final evaluation (no training round, nothing spent)."""
        c, state = self.config, self.server_state()
        tasks = RoundTasks(r, weight_cap([self.registry.announced_num_train(a) for a in sampled],
                                         c.aggregation.max_weight_ratio), sampled,
                           patience_s=PATIENCE_SHARE * c.round_timeout_s, now=self.clock.now)
        result = RoundResult(round=r, sampled=sampled)
        if sampled:
            rule, result.privacy = self.privacy.open(r, sampled, self._sampled_from)
            result.aggregate = self.method.open_round(state, rule, c.aggregation.server_lr)
        elif not final and c.privacy.poisson_rate(c.fraction) is not None:
            result.privacy = self.privacy.spend(self._sampled_from, 0)  # a Poisson draw of nobody counts too
        windows = self._closed_rounds.windows(r, c.stragglers.staleness_exponent, self.method) if late else None
        self.inbox.open_round(tasks, result, state, windows)
        self.observer.collecting(result)
        self.task_writer.open(r, state, self.epoch)
        return tasks, result, state

    def send_task(self, tasks: RoundTasks, result: RoundResult, agent_id: str, kind: str,
                  secagg: SecAggTask | None = None) -> None:
        """Send ``agent_id`` a ``kind`` task of the open round (``secagg``: a secure round's); a
        device behind a site gets it with its site's one task, when the round collects."""
        if self.sites is not None and (site := self.sites.answering_for(agent_id)) is not None:
            self.sites.hold(site, agent_id, kind)
            return self._flush_sites(tasks, result) if self.sites.summary else None  # a site's task, at once
        info = self.registry.agents.get(agent_id)
        uplink = self.task_writer.uplink_for(info.capabilities if info else None) if kind == "train" else None
        task_id, frame = self.task_writer.frame(agent_id, kind, uplink=uplink, agent=info, secagg=secagg)
        announced = self.registry.announced_num_train(agent_id) if kind == "train" else None
        tasks.add(Task(agent_id, task_id, kind, announced, session=info.session if info else None,
                       connection=info.connection if info else None, uplink=uplink, secagg=secagg))
        result.sent(self.fleet.send(agent_id, frame, tasks.round), self.task_writer.last_downlink)
        if not self.fleet.send_ready():
            # Unacknowledged tasks wait in the transport: at 1,000 agents a round's worth
            # is 1,000 x the model. Answers are admitted meanwhile (their tasks are added).
            self.inbox.pump_until(self.fleet.send_ready, self.clock.now() + self.config.round_timeout_s)

    def collect(self, tasks: RoundTasks, result: RoundResult, started: float) -> None:
        """Admit answers until every task is answered or, once a quorum of updates is in,
        the round timeout passes or every agent still owing an answer is offline
        (:meth:`.Inbox.collect`); whoever has not answered then is dropped from the round."""
        self._flush_sites(tasks, result)
        result.dropped.extend(self.inbox.collect(tasks, len(result.sampled), result.participants, started,
                                                 self.config.round_timeout_s, self.config.quorum_of(len(result.sampled))))

    def _flush_sites(self, tasks: RoundTasks, result: RoundResult) -> None:
        """The tasks held for devices behind sites go out, one per site."""
        def send(site_id: str, kind: str, orders: SiteOrders) -> tuple[str, int]:
            task_id, frame = self.task_writer.frame(site_id, kind, site=orders)
            return task_id, self.fleet.send(site_id, frame, tasks.round)
        if self.sites is not None:
            self.sites.flush(tasks, result, send, self.rollback.last_adopted)

    def pump_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Route the fleet's traffic until ``done()`` or ``deadline`` (:meth:`.Inbox.pump_until`)."""
        return self.inbox.pump_until(done, deadline)

    def late_rounds(self) -> set[int]:
        """The closed rounds whose late updates the open round takes."""
        return self.inbox.late_rounds

    def device_noise(self, sampled: int) -> tuple[float | None, float | None]:
        """Distributed DP: :meth:`.PrivacyLedger.device_noise`."""
        return self.privacy.device_noise(sampled)

    def route_steps(self, handler: Callable[[StepAnswer, int], None],
                    refusals: Callable[[Refused], None] | None = None) -> None:
        """Secure-round steps the gate admits to ``handler``, refusals of tasks to ``refusals`` (one driver's)."""
        self.inbox.steps, self.inbox.refusals = handler, refusals

    def resend_lost_tasks(self) -> None:
        """Over a fleet that can lose a task with a connection, send it again, same id, when
        its agent comes back on a new connection (a buffered state moves on without it)."""
        if self.fleet.loses_tasks:
            self.inbox.resend = lambda task, r: self.fleet.send(task.agent_id, self.task_writer.frame(
                task.agent_id, task.kind, task.task_id, task.uplink, secagg=task.secagg)[1], r)

    # ---------------------------------------------------------------- the server step
    def _server_step(self, tasks: RoundTasks, result: RoundResult, quorum: int) -> str | None:
        """Close the round's aggregate when a quorum was added and adopt it if it passes
        :func:`~.gate.admit_state`; returns why the round was aborted (None: adopted)."""
        aggregate, result.aggregate = result.aggregate, None  # the round's sums go with this call
        if aggregate is None:  # nobody trained (an evaluation round)
            return None
        if aggregate.count == 0 or aggregate.count < quorum:
            log.warning("round %d: %d of %d updates, below quorum %d; global state unchanged", result.round,
                        aggregate.count, len(result.sampled), quorum)
            return "below_quorum"
        try:
            candidate = aggregate.close(result.round)
        except AggregationRejected as exc:  # a sum that cannot be made (a secure round's masks left on)
            log.warning("round %d: no aggregate: %s (%s); global state unchanged", result.round, exc.reason, exc)
            return exc.reason
        refused = admit_state(aggregate.state, candidate, self.config.aggregation.max_change_ratio)
        if refused is not None:
            noise = self.privacy.noise_note(aggregate.state, len(result.sampled)) if refused.reason == "diverged" else ""
            log.warning("round %d: aggregate not adopted: %s (%s)%s; global state unchanged", result.round,
                        refused.reason, refused.detail, noise)
            return refused.reason
        self.state = self.task_writer.downlink.step(candidate, aggregate.state, tasks, result)
        self.rollback.adopted(result.round)
        result.update_share = aggregate.shares()
        return None

    def _roll_back(self, r: int, reason: str) -> int | None:
        """Count an aborted round; returns the round whose state the run went back to (None: none)."""
        target = self.rollback.aborted(r, reason)
        if target is None:
            return None
        good, self.state = target
        return good

    # ---------------------------------------------------------------- releases
    def release(self, round: int) -> str | None:
        """Export the frozen encoder and release it to the head agents (by stages with
        ``rollout.in_runs``); its id, or None when a stage halted it."""
        from .releases.release import build_release
        from .releases.rollout import release_to_fleet

        self.observer.enter("releasing", round)
        built = build_release(self.server_state(), self.checkpoint_meta(round), self.run_dir.releases_dir,
                              self.config, signer=self.signer)
        if not release_to_fleet(built, round, config=self.config, fleet=self.fleet, inbox=self.inbox,
                                observer=self.observer, releases_dir=self.run_dir.releases_dir, signer=self.signer):
            return None  # halted at a stage and rolled back (docs/ROLLOUT.md): the fleet keeps its release
        self.releases[built.release_id] = round
        self.observer.released(built.release_id)
        # what went out, not what could have: a delta offered to no agent that holds its base is sent as nothing
        sent = self.fleet.releases.sent_bytes(take=True)  # since the last release: what this one sent so far
        said = ", ".join(f"{n / 1e6:.2f} MB {form}" for form, n in sent.items() if n) or "retained only, none sent yet"
        self.progress.note(f"released encoder {built.release_id} ({len(built.frame) / 1e6:.2f} MB) to head-tier "
                           f"agents: {said}")
        return built.release_id

    def _collect_head_reports(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a report from every online head agent (first, for
        ``min_head_agents`` of them to be online); write what came."""
        c = self.config
        if self.releases and self.inbox.collect_reports(next(reversed(self.releases)), timeout, c.min_head_agents,
                                                        c.wait_for_agents_s):
            self.run_dir.write_head_reports(self.inbox.reports_by_release, self.releases,
                                            self.fleet.releases.release_bytes())


def require_capable(registry: Registry, config: RunConfig, run_spec: RunSpec) -> None:
    """Trainers are eligible for this run's tasks only if they run its method and model,
    (a run of series or vectors) read its input shape: protocol 1.10, and (a run that clips
    local gradients) clip them: protocol 1.11."""
    registry.require(config.method.name, config.model.arch)
    if run_spec.data.input_kind != "image":
        registry.require_protocol(INPUT_KINDS, f"{run_spec.data.input_kind} inputs")
    if run_spec.train.max_grad_norm is not None:
        registry.require_protocol(GRADIENT_CLIP, "train.max_grad_norm")


def run_spec_of(config: RunConfig, input_shape, num_classes, class_names, normalization, channel_names=None) -> RunSpec:
    """What every task of the run carries; refused (ConfigError) when the input normalization
    is unknown, so that no trainer guesses (PROTOCOL §5, task)."""
    spec = config.run_spec(input_shape, num_classes, class_names, normalization, channel_names)
    if spec.data.normalization is None:
        raise ConfigError("the input normalization is unknown: read it from the data or set "
                          "normalization: {mean: [...], std: [...]} in the run config")
    return spec


def wait_for_agents(co: Coordinator, required: bool = True) -> None:
    """Block until ``min_agents`` trainers that may be sent this run's tasks are online
    (:meth:`Registry.eligible`: capable, not busy, not excluded). Before round 0 that is required
    (TimeoutError after ``wait_for_agents_s``); between rounds we wait at most one
    round timeout and go on with whoever is there."""
    need = co.config.min_agents
    wait = co.config.wait_for_agents_s if required else co.config.round_timeout_s
    online = co.inbox.wait_for_trainers(need, co.clock.now() + wait, co.progress.note)
    if online >= need:
        return
    if not required and online:
        log.warning("only %d of min_agents=%d online; going on without the others", online, need)
        return
    raise TimeoutError(f"only {online} of min_agents={need} capable trainer agents came online within "
                       f"{co.config.wait_for_agents_s:.0f}s")


def initial_state(config: RunConfig, method: Method, run_spec: RunSpec) -> ServerState:
    """Round 0's server state: the method's from a model seeded by the run's seed alone."""
    import torch

    from edgepfl.config import ModelSpec

    torch.manual_seed(seed_for(config.seed, "global-init"))
    data = run_spec.data
    model = method.build_model(ModelSpec(**config.model.model_dump()), data.input_shape, data.num_classes)
    return method.init_server(model)
