"""The central coordinator's side of its sites (``sites.enabled``; docs/PROTOCOL.md §20).

A site aggregator's status lists its site's online trainers; :class:`SiteRelay` registers
each as a trainer of the run (its registry entry's device reads ``site <id>``; otherwise it
is sampled, capped and benched as any trainer), remembers which site it is behind, and
takes it off when the site's list drops it or the site goes offline. A device is in one
site at a time: a device that two sites list is behind neither until one of them drops it,
and one online on its own is behind none (each logged once), so a compromised site can deny
a device it names but never take it over, whatever order the statuses arrive in.

In a round, the tasks the driver sends to devices behind a site are held (:meth:`hold`) and
go out at the start of the collection as one task per site (:meth:`flush`), whose orders name
them and carry what the round's bounds judge them by. The site's answer is read by the gate
(:meth:`.UpdateGate._site_answer`) and folded into the round by :meth:`.RoundResult.record`.

In summary (``sites.mode: summary``) no device is registered here: each site is one trainer
of the run, weighing what its devices announced, sent a task every round whose orders tell it
what share of its devices to draw (:class:`~edgepfl.protocol.site.SiteSample`); what this
side keeps and handles per round is per site, whatever the devices behind them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from edgepfl.aggregation import AggregationSpec
from edgepfl.config import RunConfig
from edgepfl.protocol import VARIANCE_GRID, Capabilities, StatusMeta
from edgepfl.protocol.site import SiteDevice, SiteOrders, SiteSample

from .registry import Registry
from .result import RoundResult
from .round_tasks import RoundTasks, Task
from .sites import orders_for

log = logging.getLogger("edgepfl.coordinator")


class SiteRelay:
    """Which devices are behind which site, and a round's one task per site."""

    def __init__(self, registry: Registry, aggregation: AggregationSpec, ids: Iterable[str],
                 summary: RunConfig | None = None):
        self.registry = registry
        # a site before 1.17 sums a BatchNorm variance on another grid than this side decodes
        # (PROTOCOL.md §19.3): it gets no task; in a run of sites direct trainers are held to it too
        registry.require_protocol(VARIANCE_GRID, "a run of sites")
        #: a run that takes its sites in summary: its sampling settings (None: exact, every device here)
        self.summary = summary
        if summary is not None:
            registry.training_tiers = frozenset({"trainer", "site"})
        #: site id -> how many online trainers its last status announced (summary)
        self.counts: dict[str, int] = {}
        #: summary site id -> (the round its last sum went into, the round of the task it answered)
        self._folded: dict[str, tuple[int, int]] = {}
        #: summary site id -> the round of its last task whose sum is in an adopted state (SiteSample.kept)
        self.kept: dict[str, int] = {}
        #: the agent ids that may be sites (``sites.ids``)
        self.ids = frozenset(ids)
        #: the run's aggregation settings, ``auto`` resolved for a run of sites (what each site sums by)
        self.aggregation = aggregation.model_copy(update={"rule": aggregation.resolved(sites=True)})
        #: site id -> the devices behind it now (those its last status listed that no other site claims)
        self.devices: dict[str, list[str]] = {}
        #: device id -> the site it is behind
        self.site_of: dict[str, str] = {}
        #: site id -> the last round whose partial sum was folded in (the fleet view shows it)
        self.last_sum: dict[str, int] = {}
        #: site id -> the round's held tasks: (device, kind)
        self._held: dict[str, list[tuple[str, str]]] = {}
        #: device id -> the sites whose last status lists it
        self._claims: dict[str, set[str]] = {}
        #: site id -> its last status's devices, and that status with when it was made
        self._listed: dict[str, dict[str, SiteDevice]] = {}
        self._status: dict[str, tuple[StatusMeta, float | None]] = {}
        self._told: set[tuple[str, str]] = set()

    def status(self, site_id: str, status: StatusMeta, created: float | None) -> None:
        """A site aggregator's status: the devices it lists are claimed by it; a device claimed by
        this site alone becomes (or stays) an online trainer behind it, one it no longer lists or
        that another site claims too goes offline (contested: behind no site until one claim is
        left, so a compromised site can deny a device it names, never take it over)."""
        if self.summary is not None:  # the site is the trainer; its devices are its own
            site = status.site if status.state == "online" else None
            self.counts[site_id] = 0 if site is None else site.count if site.count is not None else len(site.devices)
            return
        listed = {d.agent: d for d in (status.site.devices if status.site is not None and status.state == "online"
                                       else [])}
        before = set(self._listed.get(site_id, {}))
        self._listed[site_id], self._status[site_id] = listed, (status, created)
        for agent in before - set(listed):
            self._claims[agent].discard(site_id)
        for agent in listed:
            self._claims.setdefault(agent, set()).add(site_id)
        for agent in sorted(before | set(listed)):
            self._assign(agent)
        self.devices[site_id] = sorted(a for a, s in self.site_of.items() if s == site_id)

    def _assign(self, agent: str) -> None:
        """Put ``agent`` behind the one site that claims it, or behind none (offline)."""
        claimants = self._claims.get(agent, set())
        owner = next(iter(claimants)) if len(claimants) == 1 else None
        direct = self.registry.agents.get(agent)
        if owner is not None and agent not in self.site_of and direct is not None and direct.online:
            owner = None  # online on its own: no site may speak for it
            self._warn(agent, "is online on its own")
        if len(claimants) > 1:
            self._warn(agent, f"is listed by sites {', '.join(sorted(claimants))}")
        was = self.site_of.get(agent)
        if owner is None:
            if was is not None:
                del self.site_of[agent]
                status, created = self._status[was]
                self.registry.update(agent, StatusMeta(state="offline", tier="trainer", device=f"site {was}",
                                                       version=status.version, session=status.session), created)
            return
        self.site_of[agent] = owner
        status, created = self._status[owner]
        device = self._listed[owner][agent]
        self.registry.update(agent, StatusMeta(
            state="online", tier="trainer", device=f"site {owner}", num_train=device.num_train,
            num_test=device.num_test, version=status.version, session=status.session,
            capabilities=Capabilities(), connection=status.connection), created)

    def _warn(self, agent: str, why: str) -> None:
        if (agent, why) not in self._told:
            self._told.add((agent, why))
            log.warning("device %s %s: it is behind no site until one lists it alone", agent, why)

    def summed(self, site_id: str, round: int, trained_on: int | None = None) -> None:
        """The site's partial sum was folded into ``round`` (from its task of ``trained_on``,
        a buffered run's earlier state; None: ``round``'s own)."""
        self.last_sum[site_id] = round
        self._folded[site_id] = (round, round if trained_on is None else trained_on)

    def behind(self, agent_id: str) -> str | None:
        """The site ``agent_id`` is behind (None: it is a direct agent)."""
        return self.site_of.get(agent_id)

    def answering_for(self, agent_id: str) -> str | None:
        """The site whose task carries ``agent_id``'s: the one it is behind, or in summary a site itself."""
        if self.summary is not None and agent_id in self.counts:
            return agent_id
        return self.site_of.get(agent_id)

    def device_count(self, site_id: str) -> int:
        """How many devices are behind ``site_id`` now (the fleet view's figure)."""
        return self.counts.get(site_id, 0) if self.summary is not None else len(self.devices.get(site_id, ()))

    def sample(self, site_id: str, r: int, final: bool, adopted: int | None) -> SiteSample:
        """A summary round's orders to ``site_id``: the run's sampling settings, for the site to
        draw its own devices with, and the round of its last task whose sum went into an adopted
        state (``adopted``: the round whose aggregate made the current one)."""
        c = self.summary
        assert c is not None  # summary rounds only
        folded = self._folded.pop(site_id, None)
        if adopted is None:
            self.kept.pop(site_id, None)  # rolled back, or resumed: whatever it kept is older than the state
        elif folded is not None and folded[0] == adopted:
            self.kept[site_id] = folded[1]
        share = c.final_eval_fraction if final and c.final_eval_fraction is not None else c.eval_fraction
        return SiteSample(train_fraction=0.0 if final else c.fraction,
                          evaluate_share=share if final or r % c.eval_every == 0 else 0.0, seed=c.seed,
                          kept=self.kept.get(site_id))

    def hold(self, site_id: str, agent_id: str, kind: str) -> None:
        """Keep a task of the open round for ``agent_id`` behind ``site_id``: it goes with the site's task."""
        self._held.setdefault(site_id, []).append((agent_id, kind))

    def flush(self, tasks: RoundTasks, result: RoundResult, send: Callable[[str, str, SiteOrders], tuple[str, int]],
              adopted: int | None = None) -> None:
        """Send each site with held tasks its one task of the round (``send(site, kind, orders)``
        returns the task id and the bytes sent); every held device then owes an answer under that
        id. In summary the site owes it, and its orders are :meth:`sample` (``adopted``: there).
        A buffered run sends a summary site's task at once (there is no collection to wait for)."""
        held, self._held = self._held, {}
        aggregate = result.aggregate
        if self.summary is not None:
            for site_id, items in sorted(held.items()):
                kind = items[0][1]
                orders = SiteOrders(aggregation=self.aggregation.model_dump(mode="json"),
                                    typical_change=aggregate.typical_change if aggregate is not None else None,
                                    sample=self.sample(site_id, tasks.round, aggregate is None, adopted))
                task_id, sent = send(site_id, kind, orders)
                result.sent(sent)
                tasks.add(Task(site_id, task_id, kind, self.registry.announced_num_train(site_id)
                               if kind == "train" else None, site=orders))
            return
        for site_id, items in sorted(held.items()):
            train = [a for a, kind in items if kind == "train"]
            evaluate = [a for a, kind in items if kind != "train"]
            orders = orders_for(aggregate, self.aggregation, train, evaluate, tasks.weight_cap) \
                if aggregate is not None else SiteOrders(evaluate=evaluate)
            kind = "train" if train else "evaluate"
            task_id, sent = send(site_id, kind, orders)
            result.sent(sent)
            tasks.add(Task(site_id, task_id, kind, site=orders))
            for agent_id, device_kind in items:
                tasks.add(Task(agent_id, task_id, device_kind, self.registry.announced_num_train(agent_id)
                               if device_kind == "train" else None))


__all__ = ["SiteRelay"]
