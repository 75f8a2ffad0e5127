"""What an operator sees of a running federation: the JSON fleet view and Prometheus metrics.

The round loop tells an :class:`Observer` the clear points of a run (a phase begins, a
round's row is written, an encoder is released); the inbox calls :meth:`Observer.tick`
after every poll, where presence and rejection changes are noticed in O(1). The view
(:class:`edgepfl.protocol.view.FleetView`, retained JSON on ``edgepfl/v1/<F>/view``) is
published at once on a phase change and at most once per ``observe.view_interval_s``
otherwise, so a fleet of 1,000 agents coming online costs one view per interval, not
1,000. With ``observe.metrics_port`` set, the same numbers are served on ``/metrics``
for Prometheus (``prometheus-client``, imported only then).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, get_args

from edgepfl.config import ObserveSpec, RunConfig
from edgepfl.logs import set_log_context
from edgepfl.metrics import RoundMetrics
from edgepfl.protocol.backpressure import BoundedInbox
from edgepfl.protocol.view import AgentView, FleetView, Phase, RolloutState, RolloutView, encode_view

from .fleet import Fleet
from .registry import Registry
from .result import RoundResult, RunCounters
from .site_relay import SiteRelay

log = logging.getLogger("edgepfl.coordinator")

TIERS = ("trainer", "head", "site")
#: round durations a histogram bucket boundary each, in seconds (a round is a timeout of 1 s ... hours)
ROUND_SECONDS_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)


class Observer:
    """Keeps the fleet view and the metrics current; never raises into the round loop."""

    def __init__(self, config: RunConfig, fleet: Fleet, registry: Registry, counters: RunCounters):
        self.spec: ObserveSpec = config.observe
        self.fleet = fleet
        self.registry = registry
        #: the run's sites (docs/PROTOCOL.md §20; set by wire()), which the view names; None: none
        self.sites: SiteRelay | None = None
        # the run's counters, every round's (a resumed run's from its checkpoint): the inbox counts into them
        self.counters = counters
        self.federation, self.method, self.rounds = config.federation, config.method.name, config.rounds
        self.max_bytes = config.broker.max_message_bytes
        self.started = time.time()
        self.resumed_from: int | None = None
        self.phase: Phase = "waiting"
        self.round = -1
        self.rounds_completed = 0
        self.buffer_size = config.asynchrony.buffer_size if config.asynchrony.mode == "buffered" else None
        self._collecting: RoundResult | None = None
        self._seen_updates = 0
        self.last_accuracy: float | None = None
        self.last_accuracy_round: int | None = None
        self.last_accuracy_final = False
        self.release: str | None = None
        self.rollout: RolloutView | None = None
        self._seen_revision = -1
        self._seen_rejections = -1
        self._dirty = True
        self._published_at = float("-inf")
        self.metrics: PrometheusMetrics | None = None
        set_log_context(federation=self.federation, method=self.method)  # on every JSON log line

    def start(self, resumed_from: int | None) -> None:
        """The run begins (``resumed_from``: the checkpointed round it continues after); serve /metrics if asked."""
        self.resumed_from = resumed_from
        if self.spec.metrics_port is not None and self.metrics is None:
            self.metrics = PrometheusMetrics(self.spec.metrics_host, self.spec.metrics_port, self.federation,
                                             already_rejected=dict(self.counters.rejected),
                                             inbox=self.fleet.inbox)
            log.info("Prometheus metrics on http://%s:%d/metrics", self.spec.metrics_host, self.metrics.port)
        self.publish()

    def enter(self, phase: Phase, round: int) -> None:
        """A phase of the run begins: the view says so at once."""
        self.phase, self.round = phase, round
        set_log_context(phase=phase, round=round)
        self.publish()

    def collecting(self, result: RoundResult) -> None:
        """A round opened: the view counts the updates folded into ``result`` as they come."""
        self._collecting, self._seen_updates = result, 0
        self._dirty = True

    def round_done(self, row: RoundMetrics) -> None:
        """A round's (or the final evaluation's) metrics row was written."""
        self._collecting = None
        if not row.final:
            self.rounds_completed = row.round + 1
        if row.accuracy is not None:
            self.last_accuracy, self.last_accuracy_round = row.accuracy, row.round
            self.last_accuracy_final = row.final
        if self.metrics is not None:
            self.metrics.round_done(row)
        self._dirty = True

    def released(self, release_id: str) -> None:
        self.release = release_id
        self._dirty = True

    def rolling_out(self, rollout: RolloutView) -> None:
        """A staged rollout moved (a stage began or was judged, a decision): the view says so at once."""
        self.rollout = rollout
        self.publish()

    def tick(self) -> None:
        """After every poll: notice presence and rejection changes; publish when due. O(1) unless publishing."""
        rejections = sum(self.counters.rejected.values())  # a handful of reasons
        updates = self._updates()
        if (self.registry.revision != self._seen_revision or rejections != self._seen_rejections
                or updates != self._seen_updates):
            self._seen_revision, self._seen_rejections = self.registry.revision, rejections
            self._seen_updates = updates
            self._dirty = True
        since = time.monotonic() - self._published_at
        if (self._dirty and since >= self.spec.view_interval_s) or since >= self.spec.view_heartbeat_s:
            self.publish()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _updates(self) -> int:
        result = self._collecting
        return len(result.participants) + len(result.late) if result is not None else 0

    # ---------------------------------------------------------------- the view
    def view(self) -> FleetView:
        """The federation now (O(agents))."""
        now_wall, now_mono = time.time(), time.monotonic()
        agents = []
        for info in self.registry.agents.values():
            life = self.registry.last_life(info.agent_id)
            seen = now_wall - (now_mono - life) if life is not None else info.last_seen
            agents.append(AgentView(id=info.agent_id, tier=info.tier if info.tier in TIERS else "trainer",
                                    online=info.online, last_seen=round(seen, 3), device=info.device,
                                    num_train=info.num_train, benched_until=self.registry.benched_until(info.agent_id),
                                    excluded=self.registry.excluded(info.agent_id),
                                    suspended=self.registry.suspended(info.agent_id, self.round),
                                    clock_ahead_s=_rounded(self.registry.clock_ahead(info.agent_id)),
                                    release=info.release, release_refused=self.registry.release_refused(info.agent_id),
                                    **self._site_fields(info.agent_id, info.tier)))
        agents.sort(key=lambda a: (not a.online, a.id))
        releases = Counter(a.release or "none" for a in agents if a.tier == "head" and a.online)
        return FleetView(
            federation=self.federation, method=self.method, updated=round(now_wall, 3), started=round(self.started, 3),
            resumed_from=self.resumed_from, phase=self.phase, round=self.round, rounds=self.rounds,
            rounds_completed=self.rounds_completed, updates=self._updates(), buffer_size=self.buffer_size,
            staleness={str(k): n for k, n in sorted(self._collecting.staleness.items())} if self._collecting else {},
            last_accuracy=self.last_accuracy,
            last_accuracy_round=self.last_accuracy_round, last_accuracy_final=self.last_accuracy_final,
            heartbeat_s=self.spec.view_heartbeat_s,
            release=self.release,
            # sites only where there are any: a fleet without sites has the view it always had
            online={tier: n for tier in TIERS if (n := self.registry.count_online(tier)) or tier != "site"},
            releases=dict(releases.most_common()),
            rollout=self.rollout,
            rejected=dict(sorted(self.counters.rejected.items())), refused=dict(sorted(self.counters.refused.items())),
            agents=agents,
        )

    def _site_fields(self, agent_id: str, tier: str) -> dict:
        """What the view says of a site aggregator (its devices, its last sum) or of a device behind one."""
        sites = self.sites
        if sites is None:
            return {}
        if tier == "site":
            return {"devices": sites.device_count(agent_id), "last_sum": sites.last_sum.get(agent_id)}
        return {"site": sites.behind(agent_id)}

    def publish(self) -> None:
        self._published_at, self._dirty = time.monotonic(), False
        try:
            view = self.view()
            if self.metrics is not None:
                self.metrics.observe_view(view)
            if self.spec.view:
                self.fleet.publish_view(encode_view(view, self.max_bytes))
        except Exception as exc:  # watching the run must never stop it
            log.warning("fleet view not published: %s", exc)


class PrometheusMetrics:
    """The run's numbers as Prometheus metrics on ``http://host:port/metrics`` (a daemon thread)."""

    def __init__(self, host: str, port: int, federation: str, already_rejected: dict[str, int] | None = None,
                 inbox: BoundedInbox | None = None):
        from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        labels: dict[str, Any] = {"registry": self.registry}
        self.rounds_completed = Counter("edgepfl_rounds_completed", "Training rounds completed by this process",
                                        **labels)
        self.round = Gauge("edgepfl_round", "The round in progress (0-based, as metrics.jsonl)", **labels)
        self.accuracy = Gauge("edgepfl_accuracy", "Sample-weighted personalized accuracy of the last evaluated round "
                              "(NaN before the first evaluation)", **labels)
        self.accuracy.set(float("nan"))  # not 0: nothing was measured yet
        self.online = Gauge("edgepfl_agents_online", "Agents online", ["tier"], **labels)
        self.rejected = Counter("edgepfl_rejected_messages", "Messages rejected, by reason (docs/PROTOCOL.md §7)",
                                ["reason"], **labels)
        # unit last (Prometheus' naming): edgepfl_uplink_bytes_total, not edgepfl_bytes_up_total
        self.bytes_up = Counter("edgepfl_uplink_bytes", "Agent -> coordinator bytes of the answers counted", **labels)
        self.bytes_down = Counter("edgepfl_downlink_bytes", "Coordinator -> agent bytes of the tasks sent", **labels)
        self.round_seconds = Histogram("edgepfl_round_seconds", "Wall time of a round", buckets=ROUND_SECONDS_BUCKETS,
                                       **labels)
        self.phase = Enum("edgepfl_phase", "What the coordinator is doing",
                          states=["waiting", "training", "aggregating", "evaluating", "releasing", "done"], **labels)
        Gauge("edgepfl_federation_info", "The federation this coordinator runs", ["federation"],
              **labels).labels(federation).set(1)
        # releases and their staged rollout (docs/ROLLOUT.md), from the fleet view
        self.release = Gauge("edgepfl_release_info", "The fleet's current encoder release (1; none: no series)",
                             ["release"], **labels)
        self.on_release = Gauge("edgepfl_head_agents_on_release", "Head agents online, by the release they run "
                                "(none: not installed yet)", ["release"], **labels)
        self.rollout = Gauge("edgepfl_rollout_info", "The last staged rollout's release (1)", ["release"], **labels)
        # a gauge per state, not an Enum: an Enum reads its first state (staging) before any rollout
        self.rollout_state = Gauge("edgepfl_rollout_state", "The last staged rollout's state (1 for it, 0 for the "
                                   f"others: {', '.join(get_args(RolloutState))}); no series before a rollout",
                                   ["state"], **labels)
        self.rollout_stage = Gauge("edgepfl_rollout_stage", "The last staged rollout's stage, 1-based (0: none yet)",
                                   **labels)
        self.rollout_devices = Gauge("edgepfl_rollout_head_agents", "The last staged rollout's head agents: admitted "
                                     "to the release so far, and of them those that reported on it", ["kind"],
                                     **labels)
        if inbox is not None:  # read at scrape time: a coordinator falling behind its fleet shows here
            Gauge("edgepfl_inbox_queued_bytes", "Bytes received and not yet handled by the round loop",
                  **labels).set_function(lambda: inbox.queued_bytes)
            Gauge("edgepfl_inbox_held_acks", "Messages received whose PUBACK is held back: the broker keeps the "
                  "backlog (docs/PROTOCOL.md §1, flow control)", **labels).set_function(lambda: inbox.held)
        # rejections a resumed run counted before this process started are not this process's
        self._rejected_seen: dict[str, int] = dict(already_rejected or {})
        self.server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self.server.server_port)

    def collecting(self, result: RoundResult) -> None:
        """A round opened: the view counts the updates folded into ``result`` as they come."""
        self._collecting, self._seen_updates = result, 0
        self._dirty = True

    def round_done(self, row: RoundMetrics) -> None:
        if not row.final:
            self.rounds_completed.inc()
        if row.accuracy is not None:
            self.accuracy.set(row.accuracy)
        self.bytes_up.inc(row.bytes_up)
        self.bytes_down.inc(row.bytes_down)
        self.round_seconds.observe(row.seconds)

    def observe_view(self, view: FleetView) -> None:
        self.round.set(view.round)
        self.phase.state(view.phase)
        for tier in TIERS:
            self.online.labels(tier).set(view.online.get(tier, 0))
        self.release.clear()
        if view.release is not None:
            self.release.labels(view.release).set(1)
        self.on_release.clear()
        for release, count in (view.releases or {}).items():
            self.on_release.labels(release).set(count)
        if view.rollout is not None:
            self.rollout.clear()
            self.rollout.labels(view.rollout.release).set(1)
            for state in get_args(RolloutState):
                self.rollout_state.labels(state).set(float(state == view.rollout.state))
            self.rollout_stage.set(view.rollout.stage)
            self.rollout_devices.labels("admitted").set(view.rollout.admitted)
            self.rollout_devices.labels("reported").set(view.rollout.reported)
        for reason, count in view.rejected.items():
            before = self._rejected_seen.get(reason, 0)
            if count > before:
                self.rejected.labels(reason).inc(count - before)
                self._rejected_seen[reason] = count

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _rounded(offset: float | None) -> float | None:
    return round(offset, 1) if offset is not None else None
