"""Beyond one broker: site Mosquittos bridged to a central one, a RabbitMQ cluster, and a
broker that takes at most 128 KB per message (docs/BROKERS.md).

Each federation runs the real coordinator and real agent processes against real brokers;
tests/unit/core/test_topologies.py covers the logic those runs depend on.
"""

from __future__ import annotations

import signal

import pytest

from edgepfl.broker import max_message_bytes_for
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import simulate, spawn_agent, stop_agents
from edgepfl.metrics import latest_release, read_head_metrics
from edgepfl.protocol import FederationChannel, MessageType, decode, parse_topic
from edgepfl.testing import MosquittoBridge, MosquittoBroker, RabbitMQCluster, TrafficCapture

from tests.conftest import require_mosquitto, require_rabbitmq
from tests.fleet_helpers import checkpoint_tensors, read_rows, run_config, run_in_thread, wait_until
from tests.unit.core.test_topologies import AWS_IOT_LIMIT

# --------------------------------------------------------------------------- real topologies


def _frames(capture: TrafficCapture, federation: str) -> list[tuple[str, object]]:
    """(channel, decoded frame) of the federation's traffic, in arrival order (the
    operators' JSON view is not a frame: PROTOCOL §18)."""
    return [(parse_topic(t).channel.value, decode(p)) for t, p in capture.snapshot()
            if t.startswith(f"edgepfl/v1/{federation}/") and p and parse_topic(t).channel != FederationChannel.VIEW]


def test_a_federation_runs_through_site_brokers_bridged_to_a_central_one(tmp_path):
    require_mosquitto()
    config = run_config(rounds=2, data={"samples_per_client": 200})
    with MosquittoBridge(sites=2, capture=True) as bridge:
        assert bridge.central.capture is not None
        rows, summary = simulate(config, 4, tmp_path / "run", broker=bridge.central.url,
                                 agent_brokers=bridge.site_urls, head_agents=1, progress=False, threads=1)
        frames = _frames(bridge.central.capture, config.federation)

    assert [r.round for r in rows] == [0, 1, 2] and rows[-1].final
    assert set(rows[-1].per_client) == {"agent-00", "agent-01", "agent-02", "agent-03"}
    assert all(len(r.participants) == 4 for r in rows[:-1])
    # every agent reached the coordinator only through its site's bridge
    senders = {f.header.sender for ch, f in frames if ch == "update"}
    assert senders == {"agent-00", "agent-01", "agent-02", "agent-03"}
    # the head agent on site 0 got the release over the bridge and reported
    _, latest = latest_release(read_head_metrics(tmp_path / "run"))
    assert set(latest.reports) == {"device-00"} and latest.reports["device-00"].total > 0
    # QoS 1 across two hops: whatever was delivered twice was dropped, never aggregated twice
    assert summary["rejected"].get("duplicate", 0) == sum(1 for ch, f in frames if ch == "update") - 4 * 3


def _spawn(config, out, url, agent_id, index, tier="trainer"):
    return spawn_agent(config, out, url, agent_id, index, tier, "lr", 1)


def test_a_federation_runs_on_a_rabbitmq_cluster_with_agents_on_every_node(tmp_path):
    """RabbitMQ keeps retained messages on one node and never sends them on a wildcard
    subscription: the coordinator learns of agents that came before it only by the roll
    call, and a head agent that comes later gets the release on its task topic."""
    require_rabbitmq()
    from edgepfl.coordinator.simulate import data_shape, prepare

    config = prepare(run_config(rounds=3, release_every=1, round_timeout_s=180, data={"samples_per_client": 200},
                                broker={"keepalive_s": 300}), 4, head_agents=1)
    fed, out = config.federation, tmp_path / "run"
    trainers = [f"agent-{i:02d}" for i in range(4)]
    procs, fleet = [], None
    with RabbitMQCluster(nodes=2) as cluster:
        first, second = cluster.urls
        with TrafficCapture(first, f"edgepfl/v1/{fed}/#") as cap:
            try:
                for i, agent_id in enumerate(trainers):
                    procs.append(_spawn(config, out, cluster.urls[i % 2], agent_id, i))
                # all trainers announced before the coordinator exists: their retained
                # statuses are what a coordinator on Mosquitto would read on subscribe
                wait_until(lambda: {t.split("/")[-2] for t, _ in cap.snapshot() if t.endswith("/status")} >= set(trainers),
                           120, what="trainers online")
                fleet = MqttFleet(fed, config.broker, url=first)
                coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
                thread, box = run_in_thread(coordinator.run)
                # a head agent on the other node joins after the first release, while one
                # stopped trainer holds the coordinator in round 1 (its keepalive outlasts the pause)
                wait_until(lambda: any(t.endswith("/release") for t, _ in cap.snapshot()), 300, what="a release")
                procs[0].send_signal(signal.SIGSTOP)
                try:
                    procs.append(_spawn(config, out, second, "device-00", 4, "head"))
                    wait_until(lambda: any(t.endswith("device-00/metrics") for t, _ in cap.snapshot()), 150,
                               what="the late head agent's report")
                finally:
                    procs[0].send_signal(signal.SIGCONT)
                thread.join(300)
                assert not thread.is_alive(), "the federation did not finish"
                if "error" in box:
                    raise box["error"]
            finally:
                if fleet is not None:
                    fleet.close()
                stop_agents(procs)
            frames = _frames(cap, fed)

    rows = read_rows(out)
    assert [r.round for r in rows] == [0, 1, 2, 3] and rows[-1].final
    assert all(len(r.participants) == 4 for r in rows[:-1]), [r.participants for r in rows]
    assert set(rows[-1].per_client) == set(trainers)
    # the head agent reported on a release that was published before it came online:
    # one it could only have got addressed to it (retained copies live on node 1)
    joined = next(i for i, (ch, f) in enumerate(frames) if ch == "status" and f.header.sender == "device-00")
    earlier = {f.meta.release_id for ch, f in frames[:joined] if ch == "release" and f.type == MessageType.RELEASE}
    reported = {f.meta.release_id for ch, f in frames if ch == "metrics" and f.header.sender == "device-00"}
    assert earlier and reported & earlier, (earlier, reported)


@pytest.fixture(scope="module")
def mosquitto_128k():
    require_mosquitto()
    with MosquittoBroker(max_packet_bytes=AWS_IOT_LIMIT, capture=True) as broker:
        yield broker


def test_a_128_kb_message_limit_chunks_everything_and_learns_the_same_model(mosquitto_128k, mosquitto, tmp_path):
    limit = max_message_bytes_for(AWS_IOT_LIMIT)
    config = run_config(rounds=2, seed=11, broker={"max_message_bytes": limit})
    assert mosquitto_128k.capture is not None
    rows, _ = simulate(config, 3, tmp_path / "mqtt", broker=mosquitto_128k.url, head_agents=1, progress=False,
                       threads=1)
    # the reference: the same run unchunked (test_federation shows MQTT runs equal in-process ones)
    unchunked = run_config(federation=f"{config.federation}u", rounds=2, seed=11)
    local_rows, _ = simulate(unchunked, 3, tmp_path / "local", broker=mosquitto.url, head_agents=1, progress=False,
                             threads=1)

    frames = [(t, p) for t, p in mosquitto_128k.capture.snapshot() if t.startswith(f"edgepfl/v1/{config.federation}/")
              and parse_topic(t).channel != FederationChannel.VIEW]  # the JSON view is not a frame
    assert max(len(p) for _, p in frames) <= limit
    chunked = {parse_topic(t).channel.value for t, p in frames if p and decode(p).type == MessageType.CHUNK}
    assert chunked >= {"task", "update", "release"}
    _, latest = latest_release(read_head_metrics(tmp_path / "mqtt"))
    assert latest.reports["device-00"].total > 0  # the chunked release was reassembled, verified and used
    assert [r.accuracy for r in rows] == pytest.approx([r.accuracy for r in local_rows], abs=1e-9)
    g_mqtt = checkpoint_tensors(tmp_path / "mqtt" / "checkpoint")
    g_local = checkpoint_tensors(tmp_path / "local" / "checkpoint")
    assert g_mqtt.keys() == g_local.keys()
    for key in g_mqtt:
        assert g_mqtt[key].tobytes() == g_local[key].tobytes(), key


def test_a_message_above_the_brokers_limit_is_a_loud_error_and_one_that_fits_is_not(mosquitto_128k, caplog):
    import logging

    from edgepfl.protocol.transport import MqttTransport

    topic = "edgepfl/v1/oversize/agents/a1/update"
    with TrafficCapture(mosquitto_128k.url, topic) as cap, caplog.at_level(logging.ERROR, "edgepfl.protocol.transport"):
        for name, max_message_bytes in (("fits", max_message_bytes_for(AWS_IOT_LIMIT)), ("too-big", 1_000_000)):
            t = MqttTransport(mosquitto_128k.url, client_id=f"edgepfl-oversize-{name}", federation="oversize",
                              sender="a1", subscriptions=[], max_message_bytes=max_message_bytes)
            t.start()
            try:
                t.publish(topic, b"z" * 300_000)
                if name == "fits":  # three chunks-worth of raw bytes arrive; nothing is logged
                    cap.wait_for(lambda m: sum(len(p) for _, p in m) >= 300_000, 30)
                    assert not caplog.records
                else:
                    wait_until(lambda: any("max_message_bytes" in r.getMessage() for r in caplog.records), 30,
                               what="the oversize error")
            finally:
                t.stop()
    assert "300000-byte message" in caplog.records[0].getMessage()
