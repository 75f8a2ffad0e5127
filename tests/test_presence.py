"""Presence warnings: a coordinator says so when the broker cut its view of the fleet short.

The slow test is the real failure: a Mosquitto with a small ``max_queued_messages``, more
retained agent statuses than that (published by a plain MQTT client, as agents would),
and the real coordinator over MQTT.
"""

from __future__ import annotations

import logging
import uuid

import paho.mqtt.client as mqtt
import pytest

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.presence import BURST_QUIET_S, PresenceWatch, looks_capped
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import AgentChannel, MessageType, StatusMeta, agent_topic, encode
from edgepfl.testing import MosquittoBroker

from tests.conftest import require_mosquitto


def _registry(n: int) -> Registry:
    registry = Registry()
    for i in range(n):
        registry.update(f"a{i}", StatusMeta(state="online", num_train=10))
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
        registry.update("a0", StatusMeta(state="online", num_train=10))
        registry.update("a9", StatusMeta(state="online", num_train=10))
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


def _publish_statuses(url: str, federation: str, n: int) -> None:
    host, port = url.removeprefix("mqtt://").split(":")
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fleet-{uuid.uuid4().hex[:8]}")
    client.connect(host, int(port))
    client.loop_start()
    infos = []
    for i in range(n):
        agent = f"agent-{i:04d}"
        frame = encode(MessageType.STATUS, federation=federation, sender=agent, round=-1,
                       meta=StatusMeta(state="online", num_train=10, num_test=5))
        infos.append(client.publish(agent_topic(federation, agent, AgentChannel.STATUS), frame, qos=1, retain=True))
    for info in infos:
        info.wait_for_publish(timeout=30)
    client.disconnect()
    client.loop_stop()


@pytest.mark.slow
def test_a_coordinator_behind_a_small_broker_queue_warns_that_presence_is_truncated(tmp_path, caplog):
    require_mosquitto()
    federation = f"pr{uuid.uuid4().hex[:8]}"
    n = 200
    with MosquittoBroker(max_queued_messages=100) as broker:
        _publish_statuses(broker.url, federation, n)
        for expected in (n, None):
            config = RunConfig(federation=federation, method={"name": "fedavg"},
                               model={"arch": "mlp", "feature_dim": 8, "norm": "none"}, rounds=1, min_agents=120,
                               round_timeout_s=1.5, wait_for_agents_s=10, input_shape=[1, 4, 4], num_classes=3,
                               normalization={"mean": [0.5], "std": [0.5]},
                               device="cpu", fraction=0.01, eval_fraction=0.01, expected_agents=expected)
            fleet = MqttFleet(federation, config.broker, url=broker.url)
            caplog.clear()
            try:
                with caplog.at_level(logging.WARNING, "edgepfl.coordinator"):
                    coordinator = Coordinator(config, fleet, tmp_path / f"run-{expected}", progress=False)
                    coordinator.run()  # nobody answers: the rounds close at their deadlines
            finally:
                fleet.close()
            seen = coordinator.registry.count_online("trainer")
            assert seen == 120  # the broker's cap (100) plus its in-flight window (20): the rest was dropped
            warnings = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
            assert len(warnings) == 1, warnings
            assert "max_queued_messages" in warnings[0] and "120" in warnings[0]
            if expected:
                assert f"expected_agents={n}" in warnings[0]
                assert any(f"round 0 starts with 120 of expected_agents={n}" in r.getMessage() for r in caplog.records)
