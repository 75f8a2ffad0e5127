"""The central coordinator's map of which device is behind which site (:class:`SiteRelay`):
whatever order the sites' statuses arrive in, a device listed by one site alone is behind it,
one listed by two is behind neither until one drops it, and one online on its own is behind
none; a site going offline takes its devices offline."""

from __future__ import annotations

import itertools

from edgepfl.aggregation import AggregationSpec
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.site_relay import SiteRelay
from edgepfl.coordinator.sites import central_too_old
from edgepfl.protocol import Capabilities, StatusMeta
from edgepfl.protocol.site import SiteDevice, SiteStatus


def _site(devices: list[str], state: str = "online") -> StatusMeta:
    return StatusMeta(state=state, tier="site", site=SiteStatus(devices=[SiteDevice(agent=d, num_train=10)
                                                                          for d in devices]))


def _relay() -> tuple[Registry, SiteRelay]:
    registry = Registry()
    registry.update("direct", StatusMeta(state="online", num_train=10))
    return registry, SiteRelay(registry, AggregationSpec(), ["a", "b"])


def test_whatever_the_order_a_device_two_sites_list_is_behind_neither_and_one_online_alone_behind_none():
    statuses = [("a", _site(["d1", "d2", "direct"])), ("b", _site(["d2", "d3"]))]
    for order in itertools.permutations(statuses):
        registry, relay = _relay()
        for site, status in order:
            relay.status(site, status, None)
        assert relay.site_of == {"d1": "a", "d3": "b"}
        online = set(registry.online("trainer"))
        assert {"d1", "d3", "direct"} <= online and "d2" not in online
        assert registry.agents["direct"].device == "cpu"  # not taken over by site a


def test_a_claim_dropped_gives_the_device_back_and_a_site_going_offline_takes_its_devices_offline():
    registry, relay = _relay()
    relay.status("a", _site(["d1", "d2"]), None)
    relay.status("b", _site(["d2"]), None)
    assert relay.behind("d2") is None
    relay.status("b", _site([]), None)
    assert relay.behind("d2") == "a" and registry.is_online("d2")
    relay.status("a", _site(["d1", "d2"], state="offline"), None)
    assert relay.site_of == {} and not registry.is_online("d1") and not registry.is_online("d2")


def test_a_site_before_protocol_1_17_gets_no_task_for_its_devices_and_a_direct_trainer_of_1_16_none_either(caplog):
    """A site of 1.16 sums a BatchNorm running variance on a grid of 64 x its largest; from 1.17
    the central side decodes 2**15 x (PROTOCOL.md §19.3), so a sum of such a site would move the
    variances by a 512th of what its devices sent. Its devices are registered (the view shows them)
    but not eligible, said once; a 1.17 site's are."""
    registry, relay = _relay()
    for direct, version in (("direct-new", "1.17"), ("direct-old", "1.16")):
        registry.update(direct, StatusMeta(state="online", num_train=10, version=version, capabilities=Capabilities()))
    relay.status("a", _site(["d1"]).model_copy(update={"version": "1.16"}), None)
    relay.status("b", _site(["d2"]), None)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        eligible = set(registry.eligible())
    assert relay.site_of == {"d1": "a", "d2": "b"} and registry.is_online("d1")
    assert eligible == {"d2", "direct-new"}
    assert "it speaks protocol 1.16; a run of sites needs 1.17" in caplog.text


def test_a_site_sums_only_for_a_central_coordinator_of_protocol_1_17():
    """The site's side of the same rule (:meth:`SiteAggregator._checked` refuses the task with
    this reason): a central coordinator before 1.17, or one whose presence it has not heard."""
    assert central_too_old("1.17") is None and central_too_old("1.18") is None
    for version in ("1.16", "1.13", None, "2.0"):
        why = central_too_old(version)
        assert why is not None and "a site's sums need 1.17" in why
