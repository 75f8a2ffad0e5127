"""``edgepfl aggregator``: a site aggregator between the devices of one site and the central
coordinator (docs/PROTOCOL.md §20).

To its devices it is a coordinator on the site's broker, built by the same :func:`.wiring.wire`
as the round loop (registry, update gate, inbox, NACKs), sending tasks signed with its own key:
a device runs edgepfl's agent, or any agent that passes the conformance kit, unchanged. To the
central coordinator it is one participant (:class:`CentralLink`): its status lists its site's
online trainers, and each task the central coordinator sends it is one round for some of them.
It runs that round at the site (:meth:`SiteAggregator.run_round`): every device named is sent
its own task built from the task's tensors and run, and its answer is checked by the gate and
judged by the central round's bounds, then summed exactly (:func:`.sites.site_aggregate`); the
aggregator answers with the site's partial sum, so that one model-sized frame crosses the site's
uplink per round whatever the number of devices, and the central round is the flat fleet's bit for bit.

An exact site keeps no state of its own: the model is the one each central task carries, its
devices are what their retained statuses on the site's broker say, and a round in flight is
lost with the process, like a central round's aggregate (the central round closes with the
other sites; the next task starts afresh). So a restart resumes by construction. A summary
site (``mode: summary``) draws its own devices and keeps their records
(:class:`.site_records.SiteRecords`, in ``state_dir``), which a restart reads back.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from edgepfl.aggregation import AggregationSpec, SummingRule, weight_cap
from edgepfl.config import ConfigError
from edgepfl.failpoints import failpoint
from edgepfl.methods import ServerState, create_method
from edgepfl.protocol import (
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    Message,
    MessageType,
    ProtocolError,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
    agent_topic,
    decode,
    encode,
    encode_refusal,
    federation_topic,
)
from edgepfl.protocol.signing import verify
from edgepfl.protocol.site import SiteDevice, SiteOrders, SiteStatus
from edgepfl.protocol.transport import MqttTransport
from edgepfl.site_config import AggregatorConfig

from .credentials import Credentials
from .fleet import MqttFleet
from .result import RoundResult
from .round_tasks import PATIENCE_SHARE, RoundTasks, Task
from .site_records import SiteRecords
from .sites import answer_of, central_too_old, draw_site, site_aggregate, summary_answer_of
from .tasks import TaskWriter
from .wiring import wire

log = logging.getLogger("edgepfl.aggregator")
#: how long one wait for the central coordinator's next frame lasts before the site is looked at again
POLL_S = 0.2


class CentralLink:
    """The aggregator as one participant of the central federation: its retained status (the
    site's devices; the last will ``offline``), its task topic, the central coordinator's
    presence, and its answers, signed with its own key."""

    def __init__(self, config: AggregatorConfig, url: str | None = None):
        link = config.central
        self.site_id, self.federation = config.site_id, link.federation
        #: a summary site: its status says how many devices it has, not which
        self.summary = config.mode == "summary"
        keys = Credentials.load(link.security)
        self.signer, self.central_key = keys.signer, keys.upstream
        self.devices: list[SiteDevice] = []
        self._status_topic = agent_topic(self.federation, self.site_id, AgentChannel.STATUS)
        #: the central coordinator's last presence (None: none heard yet)
        self.central: CoordinatorMeta | None = None
        #: (epoch, round) of the last task taken: a task not newer is not run again
        self._last: tuple[int, int] | None = None
        self.transport = MqttTransport.from_config(
            link.broker, url=url, client_id=f"edgepfl-{self.federation}-{self.site_id}", federation=self.federation,
            sender=self.site_id,
            subscriptions=[agent_topic(self.federation, self.site_id, AgentChannel.TASK),
                           federation_topic(self.federation, FederationChannel.COORDINATOR)],
            will=(self._status_topic, self._status("offline")),
            birth=lambda: (self._status_topic, self._status("online"), True))
        self.transport.start(timeout=60)

    def _status(self, state: str) -> bytes:
        meta = StatusMeta(state=state, tier="site", num_train=sum(d.num_train for d in self.devices),
                          num_test=sum(d.num_test for d in self.devices), software="edgepfl aggregator",
                          site=SiteStatus(count=len(self.devices)) if self.summary else SiteStatus(devices=self.devices))
        return encode(MessageType.STATUS, federation=self.federation, sender=self.site_id, round=-1, meta=meta,
                      signer=self.signer)

    def announce(self, devices: list[SiteDevice]) -> None:
        """Publish the site's online trainers (retained), when they changed."""
        if devices != self.devices:
            self.devices = devices
            self.transport.publish(self._status_topic, self._status("online"), retain=True)

    def receive(self, timeout: float) -> Message | None:
        """The next task from the central coordinator (its presence is kept as it comes); None
        after ``timeout``. A frame that is not the central coordinator's own is dropped, logged."""
        inbound = self.transport.receive(timeout)
        if inbound is None:
            return None
        try:
            message = decode(inbound.frame)
        except ProtocolError as exc:
            log.warning("dropped a frame from the central broker: %s", exc)
            return None
        if self.central_key is not None and verify(message, self.central_key) is not None:
            log.warning("dropped a %s frame not signed by the central coordinator", message.type.value)
            return None
        if message.type == MessageType.COORDINATOR:
            self.central = message.meta_as(CoordinatorMeta)
            return None
        if message.type != MessageType.TASK:
            return None
        signed = self.central_key is not None
        if message.header.recipient != self.site_id and (signed or message.header.recipient is not None):
            log.warning("dropped a task addressed to %s", message.header.recipient)
            return None
        order = (message.meta_as(TaskMeta).epoch, message.header.round)
        if self._last is not None and order <= self._last:
            # a copy of a task it ran, or an older one replayed: a round is run once (PROTOCOL.md §10)
            log.warning("dropped a task of round %d: not newer than the last one run (round %d)", order[1],
                        self._last[1])
            return None
        self._last = order
        return message

    def send(self, frame: bytes, round: int) -> int:
        """Publish an answer on the aggregator's update topic; its bytes on the uplink."""
        return self.transport.publish(agent_topic(self.federation, self.site_id, AgentChannel.UPDATE), frame,
                                      round=round)

    def close(self) -> None:
        self.transport.stop(final=(self._status_topic, self._status("offline")))


class SiteAggregator:
    """A site's aggregator: the site's coordinator side over its broker, and its link to the central one."""

    def __init__(self, config: AggregatorConfig, *, site_url: str | None = None, central_url: str | None = None):
        self.config = site = config.site
        self.site_id = config.site_id
        self.method = create_method(site.method.name, site.method.options())
        self.fleet = MqttFleet(site.federation, site.broker, url=site_url, security=site.security)
        side = wire(site, self.fleet, self.method)
        self.registry, self.inbox = side.registry, side.inbox
        self.signer = side.credentials.signer
        self.registry.require(site.method.name, site.model.arch)
        #: what a summary site keeps of its devices' updates (``state_dir``; in memory without one)
        self.records = SiteRecords(None if config.state_dir is None else Path(config.state_dir))
        if config.mode == "summary" and config.state_dir is None:
            log.warning("site %s keeps its devices' records in memory (no state_dir): a restart forgets them",
                        config.site_id)
        self.central = CentralLink(config, central_url)

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve the central coordinator's tasks until its presence says ``done`` (or ``stop``)."""
        self.fleet.announce(CoordinatorMeta(state="online", method=self.config.method.name))
        while stop is None or not stop.is_set():
            self.inbox.pump_until(lambda: False, self.fleet.clock.now() + POLL_S)  # the site's statuses
            self.central.announce(self._devices())
            task = self.central.receive(timeout=POLL_S)
            if task is not None:
                self.run_round(task)
            elif self.central.central is not None and self.central.central.state == "done":
                break
        self.fleet.announce(CoordinatorMeta(state="done", method=self.config.method.name))

    def _devices(self) -> list[SiteDevice]:
        agents = self.registry.agents
        return [SiteDevice(agent=a, num_train=agents[a].num_train, num_test=agents[a].num_test)
                for a in sorted(self.registry.eligible())]

    def run_round(self, message: Message) -> None:
        """Run one central task at the site: send its devices their tasks, collect, and answer
        the central coordinator with the site's share of the round (a refusal when it cannot)."""
        meta, r = message.meta_as(TaskMeta), message.header.round
        orders = self._drawn(meta.site, r) if meta.site is not None and meta.site.sample is not None else meta.site
        refusal, rule = self._checked(meta, orders)
        if refusal is not None or orders is None:
            reason, detail = refusal or ("error", "a task without site orders")
            log.warning("round %d: refused the central task: %s (%s)", r, reason, detail)
            self.central.send(encode_refusal(message, sender=self.site_id, reason=reason, detail=detail,
                                             signer=self.central.signer), r)
            return
        site, clock = self.config, self.fleet.clock
        state = ServerState(global_tensors=dict(message.tensors))
        tasks = RoundTasks(r, orders.weight_cap, orders.train, patience_s=PATIENCE_SHARE * site.round_timeout_s,
                           now=clock.now)
        result = RoundResult(round=r, sampled=list(orders.train))
        if rule is not None:  # devices train: their updates are summed by the central round's rule
            result.aggregate = site_aggregate(self.method, state, rule, orders)
        self.inbox.open_round(tasks, result, state, None)
        writer = TaskWriter(site.model_copy(update={"seed": meta.run.seed}), meta.run, self.method, self.signer)
        writer.open(r, state, meta.epoch)
        self.fleet.announce(CoordinatorMeta(state="online", method=site.method.name, round=r))
        started = clock.now()
        for agent_id, kind in [(a, "train") for a in orders.train] + [(a, "evaluate") for a in orders.evaluate]:
            info = self.registry.agents.get(agent_id)
            task_id, frame = writer.frame(agent_id, kind, agent=info)
            tasks.add(Task(agent_id, task_id, kind, self.registry.announced_num_train(agent_id) if kind == "train"
                           else None, session=info.session if info else None,
                           connection=info.connection if info else None))
            result.sent(self.fleet.send(agent_id, frame, r))
        failpoint("site.tasks_sent")
        result.dropped = self.inbox.collect(tasks, len(orders.train), result.participants, started,
                                            site.round_timeout_s, site.quorum_of(len(orders.train)))
        tasks.close()
        for agent_id in result.dropped:
            self.registry.missed(agent_id, r, silent_since=started)
        aggregate = result.aggregate
        part = aggregate.site_part() if aggregate is not None and aggregate.count else None
        if meta.site is not None and meta.site.sample is not None:  # a summary round: totals, no device named
            bound = rule.bound if rule is not None else None
            if part is not None:
                self.records.hold(r, part, bound.vs_median if bound is not None and bound.first_limit_ else None)
            answer, tensors = summary_answer_of(
                part, result.evaluations, sampled=len(orders.train), dropped=len(result.dropped),
                max_weight_ratio=self._aggregation(meta.site).max_weight_ratio, rejected=result.rejected,
                refused=result.refused)
        else:
            answer, tensors = answer_of(part, result.evaluations, rejected=result.rejected, refused=result.refused,
                                        dropped=result.dropped)
        evaluations = result.evaluations.values()
        reply = UpdateMeta(task_id=meta.task_id, kind=meta.kind, num_train=max(1, answer.total_weight)
                           if meta.kind == "train" else 0, num_test=sum(e.total for e in evaluations),
                           eval_correct=sum(e.correct for e in evaluations), site=answer)
        sent = self.central.send(encode(MessageType.UPDATE, federation=self.central.federation, sender=self.site_id,
                                        round=r, meta=reply, tensors=tensors, signer=self.central.signer), r)
        log.info("round %d: %d of %d devices' updates summed, %d evaluated; %d bytes to the central coordinator "
                 "(the site's devices sent %d)", r, aggregate.count if aggregate is not None else 0,
                 len(orders.train), len(result.evaluations), sent, result.bytes_up)

    def _drawn(self, orders: SiteOrders, r: int) -> SiteOrders:
        """A summary task's orders as the site runs them: its own draw of its online devices
        (:func:`.sites.draw_site`), their records from its book (first keeping those of the round
        whose sum the task says was adopted), and the weight cap over the devices drawn."""
        sample = orders.sample
        assert sample is not None  # the caller's condition
        self.records.settle(sample.kept, orders.typical_change)
        # the status first: the central round holds the answer to what the site announced, and
        # its devices may have come or gone since it last said
        self.central.announce(self._devices())
        train, evaluate = draw_site(self.site_id, sorted(self.registry.eligible()), sample, r)
        records, newcomer = self.records.for_round(train)
        try:
            ratio = self._aggregation(orders).max_weight_ratio
        except ValueError:
            ratio = None  # _checked refuses the task
        cap = weight_cap([self.registry.announced_num_train(a) for a in train], ratio)
        return orders.model_copy(update={
            "train": train, "evaluate": evaluate, "weight_cap": cap,
            "records": {a: [tuple(row) for row in rows] for a, rows in records.items()},
            "newcomer": None if newcomer is None else tuple(newcomer.to_json())})

    @staticmethod
    def _aggregation(orders: SiteOrders) -> AggregationSpec:
        """The central run's aggregation settings a task carries (``ValueError``: not valid ones)."""
        return AggregationSpec.model_validate(orders.aggregation)

    def _checked(self, meta: TaskMeta, orders: SiteOrders | None) -> tuple[tuple[str, str] | None,
                                                                          SummingRule | None]:
        """Why the site cannot run this task (None: it can), and the rule its devices' updates are
        summed by (None: nobody trains, or it cannot run it)."""
        site = self.config
        central = self.central.central
        too_old = central_too_old(None if central is None else central.version)
        if too_old is not None:
            return ("error", too_old), None
        if meta.run.method.name != site.method.name:
            return ("unsupported_method", f"the site's devices run {site.method.name}, not {meta.run.method.name}"), None
        if meta.run.model.arch != site.model.arch:
            return ("unsupported_arch", f"the site's devices run {site.model.arch}, not {meta.run.model.arch}"), None
        if orders is None or not orders.train:
            return None, None
        try:
            rule = self._aggregation(orders).build()
        except ValueError as exc:
            return ("bad_options", f"the task's aggregation settings: {exc}"), None
        if not isinstance(rule, SummingRule) or not self.method.streaming:
            return ("bad_options", f"{type(rule).__name__} with {self.method.name} makes no partial sums"), None
        return None, rule

    def close(self) -> None:
        self.central.close()
        self.fleet.close()


def main_aggregator(argv: list[str] | None = None) -> int:
    """``edgepfl aggregator --config site.yaml``: run a site aggregator until the central run is done."""
    import argparse

    from edgepfl.errors import OneLineParser
    from edgepfl.service import notifier
    from edgepfl.site_config import load_aggregator_config

    p: argparse.ArgumentParser = OneLineParser(prog="edgepfl aggregator", allow_abbrev=False,
                                               description="a site aggregator between a site's devices and the "
                                                           "central coordinator (docs/PROTOCOL.md section 20)")
    p.add_argument("--config", required=True, help="the aggregator's YAML (edgepfl.site_config.AggregatorConfig)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = p.parse_args(argv)
    config = load_aggregator_config(args.config, args.set)
    if config.site.broker.url == config.central.broker.url and config.site.federation == config.central.federation:
        raise ConfigError("site.federation must differ from central.federation on one broker: the site's devices "
                          "would hear the central coordinator")
    aggregator = SiteAggregator(config)
    notifier().ready(f"site aggregator {config.site_id} of {config.central.federation}")
    try:
        aggregator.run()
    finally:
        notifier().stopping()
        aggregator.close()
    return 0


__all__ = ["CentralLink", "SiteAggregator", "main_aggregator"]
