"""Presence warnings: a coordinator says so when the broker cut its view of the fleet short.

The real failure: a Mosquitto with a small ``max_queued_messages``, more retained agent
statuses than that (published by a plain MQTT client, as agents would), and the real
coordinator over MQTT (the judgement in process: tests/unit/coordinator/test_presence.py).
"""

from __future__ import annotations

import logging
import uuid

import paho.mqtt.client as mqtt

from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import AgentChannel, MessageType, StatusMeta, agent_topic, encode
from edgepfl.testing import MosquittoBroker

from tests.conftest import require_mosquitto


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
