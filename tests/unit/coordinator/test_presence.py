"""Presence warnings: a coordinator says so when the broker cut its view of the fleet short.

The judgement in process (the real failure, a Mosquitto with a small
``max_queued_messages`` and the real coordinator over MQTT:
tests/integration/broker/test_presence_replay_cap.py).
"""

from __future__ import annotations

import logging

from edgepfl.coordinator.presence import BURST_QUIET_S, PresenceWatch, looks_capped
from edgepfl.coordinator.registry import Registry
from edgepfl.protocol import Capabilities, StatusMeta


def _registry(n: int) -> Registry:
    registry = Registry()
    for i in range(n):
        registry.update(f"a{i}", StatusMeta(state="online", num_train=10, capabilities=Capabilities()))
    return registry


def test_a_replay_that_stops_at_a_queue_cap_is_suspicious():
    assert looks_capped(1020) and looks_capped(120) and looks_capped(10020)
    assert not looks_capped(20) and not looks_capped(1000) and not looks_capped(1021)


def test_the_burst_is_judged_once_after_it_went_quiet(caplog):
    watch = PresenceWatch(_registry(50), expected=80)
    for i in range(50):
        watch.status_arrived(100.0 + i * 0.001)
    with caplog.at_level(logging.WARNING, "edgepfl.coordinator"):
        watch.tick(100.1)  # still inside the burst
        assert not caplog.records
        watch.tick(101.1 + BURST_QUIET_S)
        watch.tick(200.0)
        watch.status_arrived(201.0)  # a live status later is not part of the replay
    assert watch.burst == 50
    assert len(caplog.records) == 1
    assert "50 trainers online of expected_agents=80" in caplog.text and "max_queued_messages" in caplog.text


def test_a_round_that_starts_short_warns_once_per_shortfall(caplog):
    registry = _registry(5)
    watch = PresenceWatch(registry, expected=6)
    with caplog.at_level(logging.WARNING, "edgepfl.coordinator"):
        watch.round_starts(0)
        watch.round_starts(1)  # same shortfall: said already
        registry.update("a0", StatusMeta(state="offline"))
        watch.round_starts(2)
        registry.update("a0", StatusMeta(state="online", num_train=10, capabilities=Capabilities()))
        registry.update("a9", StatusMeta(state="online", num_train=10, capabilities=Capabilities()))
        watch.round_starts(3)  # everyone there
    assert [r.getMessage().split(" trainers")[0] for r in caplog.records] == [
        "round 0 starts with 5 of expected_agents=6", "round 2 starts with 4 of expected_agents=6"]


def test_without_expected_agents_an_ordinary_burst_says_nothing(caplog):
    watch = PresenceWatch(_registry(37), expected=None)
    for _ in range(37):
        watch.status_arrived(1.0)
    with caplog.at_level(logging.WARNING, "edgepfl.coordinator"):
        watch.tick(10.0)
        watch.round_starts(0)
    assert not caplog.records
