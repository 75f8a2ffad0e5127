"""The composition root of the coordinator side: what the round loop and the release
service are built from, wired in one place.

Both connect to a fleet as its coordinator and route what it delivers through the same
collaborators: the registry of agents, the update gate, the inbox, the NACKs, the fleet
view. They differ only in what they are given: the round loop a method (the gate checks
updates against it) and the run's expected fleet size; the release service no method
(its gate never opens a round, so every update is refused before a method is needed, and
``edgepfl release`` runs without torch).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from edgepfl.config import RunConfig
from edgepfl.methods import Method

from .credentials import Credentials
from .fleet import Fleet
from .gate import UpdateGate
from .inbox import Inbox
from .nack import Nacker
from .observe import Observer
from .presence import PresenceWatch
from .registry import Registry
from .result import RunCounters
from .site_relay import SiteRelay

log = logging.getLogger("edgepfl.coordinator")

@dataclass(frozen=True)
class CoordinatorSide:
    """A coordinator's collaborators over one fleet connection."""

    credentials: Credentials
    registry: Registry
    counters: RunCounters
    observer: Observer
    inbox: Inbox
    #: the run's site aggregators and the devices behind them (None: the run takes no sites)
    sites: SiteRelay | None = None


def wire(config: RunConfig, fleet: Fleet, method: Method | None, *, watch_presence: bool = True) -> CoordinatorSide:
    """Build the collaborators of a coordinator of ``config`` over ``fleet``; ``method`` checks
    updates (None: no round is ever opened); ``watch_presence`` warns when fewer trainers than
    ``expected_agents`` are online (the round loop's concern, not a release's)."""
    credentials = fleet.credentials
    if credentials is None or credentials.source != config.security:
        # a fleet built without this run's security section (a test, an embedding program)
        # signs only its presence, if at all; the tasks are signed with the run's own key
        credentials = Credentials.load(config.security)
    registry = Registry(clock=fleet.clock)
    counters = RunCounters()
    gate = UpdateGate(config.federation, method, registry, max_bytes=config.broker.max_payload_bytes,
                      keyring=credentials.keyring)
    observer = Observer(config, fleet, registry, counters)
    presence = PresenceWatch(registry, config.expected_agents if watch_presence else None)
    inbox = Inbox(fleet, registry, gate, counters, tick=observer.tick, keyring=credentials.keyring,
                  clock=fleet.clock, presence=presence,
                  nacks=Nacker(config.federation, fleet, registry, credentials.signer))
    sites = SiteRelay(registry, config.aggregation, config.sites.ids,
                      summary=config if config.sites.mode == "summary" else None) \
        if config.sites.enabled and method is not None else None
    inbox.sites = observer.sites = sites
    fleet.expect_chunks(inbox.chunk_allowance)  # chunks reserve memory only for answers the inbox expects
    if method is not None and (config.release_every or config.release_at_end) and not config.rollout.in_runs \
            and fleet.releases.stages:
        # a run's own releases: the gate exists and they would pass it by; said once, not per release
        log.warning("this run's releases (release_every / release_at_end) go to every head agent at once, "
                    "measured by no canary: set rollout.in_runs: true for stages %s and their gate",
                    config.rollout.stages)
    return CoordinatorSide(credentials, registry, counters, observer, inbox, sites)
