"""The central coordinator's side of its sites (``sites.enabled``; docs/PROTOCOL.md §20).

A site aggregator's status lists its site's online trainers; :class:`SiteRelay` registers
each as a trainer of the run (the registry's entry for it says ``via`` nothing else: the
device is sampled, capped and benched as any trainer), remembers which site it is behind,
and takes it off when the site's list drops it or the site goes offline. A device is in one
site at a time: a claim on a device that another site or a direct agent already holds is
ignored (logged once), so a compromised site cannot take over another's devices.

In a round, the tasks the driver sends to devices behind a site are held (:meth:`hold`) and
go out at the start of the collection as one task per site (:meth:`flush`), whose orders name
them and carry what the round's bounds judge them by. The site's answer is read by the gate
(:meth:`.UpdateGate._site_answer`) and folded into the round by :meth:`.RoundResult.record`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from edgepfl.aggregation import AggregationSpec
from edgepfl.protocol import Capabilities, StatusMeta

from .registry import Registry
from .result import RoundResult
from .round_tasks import RoundTasks, Task
from .sites import orders_for

log = logging.getLogger("edgepfl.coordinator")


class SiteRelay:
    """Which devices are behind which site, and a round's one task per site."""

    def __init__(self, registry: Registry, aggregation: AggregationSpec):
        self.registry = registry
        #: the run's aggregation settings, ``auto`` resolved for a run of sites (what each site sums by)
        self.aggregation = aggregation.model_copy(update={"rule": aggregation.resolved(sites=True)})
        #: site id -> its devices, as its last status listed them (online ones)
        self.devices: dict[str, list[str]] = {}
        #: device id -> the site it is behind
        self.site_of: dict[str, str] = {}
        #: site id -> the round's held tasks: (device, kind)
        self._held: dict[str, list[tuple[str, str]]] = {}
        self._told: set[tuple[str, str]] = set()

    def status(self, site_id: str, status: StatusMeta, created: float | None) -> None:
        """A site aggregator's status: its listed devices become (or stay) online trainers behind
        it, the ones it no longer lists (all of them, when it goes offline) go offline."""
        listed = {d.agent: d for d in (status.site.devices if status.site is not None and status.state == "online"
                                       else [])}
        previous = set(self.devices.get(site_id, ()))
        kept = []
        for agent, device in sorted(listed.items()):
            holder = self.site_of.get(agent)
            direct = self.registry.agents.get(agent)
            if (holder is not None and holder != site_id) or (holder is None and direct is not None and direct.online):
                if (site_id, agent) not in self._told:
                    self._told.add((site_id, agent))
                    log.warning("site %s lists %s, which %s: ignored (a device is in one site at a time)", site_id,
                                agent, f"is behind site {holder}" if holder else "is online on its own")
                continue
            self.site_of[agent] = site_id
            kept.append(agent)
            self.registry.update(agent, StatusMeta(
                state="online", tier="trainer", device=f"site {site_id}", num_train=device.num_train,
                num_test=device.num_test, version=status.version, session=status.session,
                capabilities=Capabilities(), connection=status.connection), created)
        for agent in previous - set(kept):
            self.site_of.pop(agent, None)
            self.registry.update(agent, StatusMeta(state="offline", tier="trainer", device=f"site {site_id}",
                                                   version=status.version, session=status.session), created)
        self.devices[site_id] = kept

    def behind(self, agent_id: str) -> str | None:
        """The site ``agent_id`` is behind (None: it is a direct agent)."""
        return self.site_of.get(agent_id)

    def hold(self, site_id: str, agent_id: str, kind: str) -> None:
        """Keep a task of the open round for ``agent_id`` behind ``site_id``: it goes with the site's task."""
        self._held.setdefault(site_id, []).append((agent_id, kind))

    def flush(self, tasks: RoundTasks, result: RoundResult,
              send: Callable[[str, str, object], tuple[str, int]]) -> None:
        """Send each site with held tasks its one task of the round (``send(site, kind, orders)``
        returns the task id and the bytes sent); every held device then owes an answer under that id."""
        held, self._held = self._held, {}
        aggregate = result.aggregate
        for site_id, items in sorted(held.items()):
            train = [a for a, kind in items if kind == "train"]
            evaluate = [a for a, kind in items if kind != "train"]
            if aggregate is not None:
                orders = orders_for(aggregate, self.aggregation, train, evaluate, tasks.weight_cap)
            else:
                from edgepfl.protocol.site import SiteOrders

                orders = SiteOrders(evaluate=evaluate)
            kind = "train" if train else "evaluate"
            task_id, sent = send(site_id, kind, orders)
            result.sent(sent)
            tasks.add(Task(site_id, task_id, kind, site=orders))
            for agent_id, device_kind in items:
                tasks.add(Task(agent_id, task_id, device_kind, self.registry.announced_num_train(agent_id)
                               if device_kind == "train" else None, via=site_id))


__all__ = ["SiteRelay"]
