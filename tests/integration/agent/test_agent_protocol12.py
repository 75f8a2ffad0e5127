"""Protocol 1.2 on the agent side (docs/PROTOCOL.md §5, §10), with a real Mosquitto and
real agent processes.

A plain paho client plays the coordinator, encoding frames with edgepfl.protocol: the
agent declares capabilities and answers a task it cannot run with a refusal only to a
coordinator whose presence announced 1.2; it logs a nack, counts it and closes the task
it names; it ignores a coordinator of another major version. A real coordinator and a
broker restarted while the agent trains: the answer the agent finished while
disconnected is held and still reaches the round; a head agent's metrics report finished
while the broker was down is held too and reaches the coordinator that comes back.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import paho.mqtt.client as mqtt

from edgepfl.protocol import (
    AgentChannel,
    CoordinatorMeta,
    FederationChannel,
    MessageType,
    MetricsMeta,
    NackMeta,
    RefusalMeta,
    StatusMeta,
    TaskMeta,
    agent_topic,
    decode,
    encode,
    federation_topic,
    new_message_id,
)
from edgepfl.protocol.envelope import peek_header
from edgepfl.testing import TrafficCapture

from tests.fleet_helpers import RunningFleet, read_rows, run_config, run_in_thread, wait_until

AGENT = "agent-00"


class PlayedCoordinator:
    """A paho client publishing coordinator frames; a capture records what the agent sends."""

    def __init__(self, url: str, federation: str):
        self.federation = federation
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"played-{uuid.uuid4().hex[:8]}")
        self.client.connect(host, int(port))
        self.client.loop_start()
        self.capture = TrafficCapture(url, topic=f"edgepfl/v1/{federation}/agents/+/+", include_retained=True).start()

    def publish(self, topic: str, frame: bytes, retain: bool = False) -> None:
        self.client.publish(topic, frame, qos=1, retain=retain).wait_for_publish(10)

    def presence(self, version: str, round: int = 0, state: str = "online") -> None:
        meta = CoordinatorMeta(state=state, method="fedavg", round=round, version=version, session=uuid.uuid4().hex)
        self.publish(federation_topic(self.federation, FederationChannel.COORDINATOR),
                     encode(MessageType.COORDINATOR, federation=self.federation, sender="coordinator", round=round,
                            meta=meta), retain=True)

    def task(self, run, round: int = 0, kind: str = "evaluate", task_id: str | None = None) -> str:
        meta = TaskMeta(task_id=task_id or new_message_id(), kind=kind, run=run, seed=round, deadline_s=60)
        self.publish(agent_topic(self.federation, AGENT, AgentChannel.TASK),
                     encode(MessageType.TASK, federation=self.federation, sender="coordinator", round=round, meta=meta))
        return meta.task_id

    def nack(self, meta: NackMeta, round: int = 0, recipient: str = AGENT) -> None:
        self.publish(agent_topic(self.federation, AGENT, AgentChannel.TASK),
                     encode(MessageType.NACK, federation=self.federation, sender="coordinator", round=round,
                            meta=meta, recipient=recipient))

    def sent(self, channel: AgentChannel) -> list[bytes]:
        return [p for t, p in self.capture.snapshot() if t.endswith(f"/{AGENT}/{channel.value}") and p]

    def close(self) -> None:
        self.capture.stop()
        self.client.loop_stop()
        self.client.disconnect()


def _statuses(played: PlayedCoordinator, n: int) -> list[bytes]:
    return wait_until(lambda: (s := played.sent(AgentChannel.STATUS)) and len(s) >= n and s, timeout=120,
                      what=f"{n} statuses")


def _logged(fleet: RunningFleet, text: str, timeout: float = 60) -> None:
    wait_until(lambda: text in fleet.log(AGENT), timeout=timeout, what=f"agent log line {text!r}")


def test_capabilities_and_refusals_only_for_a_coordinator_of_1_2(mosquitto, tmp_path):
    config = run_config()
    with RunningFleet(config, tmp_path, mosquitto.url, 1) as fleet:
        played = PlayedCoordinator(mosquitto.url, config.federation)
        try:
            run = fleet.config.run_spec(**fleet.shape())
            other_data = run.model_copy(update={"data": run.data.model_copy(
                update={"num_classes": 3, "class_names": ["a", "b", "c"]})})
            (first,) = _statuses(played, 1)
            assert "capabilities" not in peek_header(first)["meta"]  # no coordinator known: a 1.1 status

            played.presence("1.1")  # a new session: the roll call
            second = _statuses(played, 2)[-1]
            assert decode(second).meta_as(StatusMeta).state == "online"
            assert "capabilities" not in peek_header(second)["meta"]
            silent = played.task(other_data)
            _logged(fleet, f"refusal of task {silent} not sent")
            assert f"{silent} (round 0) refused (data_mismatch)" in fleet.log(AGENT)  # still logged, one line

            played.presence("1.2")
            status = decode(_statuses(played, 3)[-1]).meta_as(StatusMeta)
            caps = status.capabilities
            assert caps is not None and "fedavg" in caps.methods and "cnn" in caps.archs
            assert caps.max_message_bytes == fleet.config.broker.max_message_bytes and caps.head_kinds is None

            refused = played.task(other_data)
            bad_options = played.task(run.model_copy(update={"method": run.method.model_copy(
                update={"options": {"no_such_option": 1}})}))
            frames = wait_until(lambda: len(s := played.sent(AgentChannel.UPDATE)) >= 2 and s, timeout=120,
                                what="two refusals")
        finally:
            played.close()
    refusals = [decode(f) for f in frames]
    assert all(m.type == MessageType.REFUSAL and m.header.sender == AGENT for m in refusals)
    assert {(m.meta_as(RefusalMeta).task_id, m.meta_as(RefusalMeta).reason) for m in refusals} == {
        (refused, "data_mismatch"), (bad_options, "bad_options")}
    assert silent not in {m.meta_as(RefusalMeta).task_id for m in refusals}


def test_a_nack_is_logged_and_closes_its_task_and_another_major_version_is_ignored(mosquitto, tmp_path):
    config = run_config()
    with RunningFleet(config, tmp_path, mosquitto.url, 1) as fleet:
        played = PlayedCoordinator(mosquitto.url, config.federation)
        try:
            run = fleet.config.run_spec(**fleet.shape())
            _statuses(played, 1)
            played.presence("1.2")
            task_id = played.task(run)
            (update,) = wait_until(lambda: played.sent(AgentChannel.UPDATE), timeout=120, what="the update")
            message_id = decode(update).header.message_id
            played.task(run, task_id=task_id)  # redelivered: answered again from the cache (§9)
            wait_until(lambda: len(played.sent(AgentChannel.UPDATE)) == 2, timeout=60, what="the cached answer")
            assert decode(played.sent(AgentChannel.UPDATE)[1]).header.message_id == message_id

            # a nack for another agent is dropped; the one for this agent is logged and closes the task
            played.nack(NackMeta(message_id=message_id, rejected_type="update", reason="corrupt", task_id=task_id),
                        recipient="agent-99")
            played.nack(NackMeta(message_id=message_id, rejected_type="update", reason="wrong_shape",
                                 detail="encoder.conv.0.weight", task_id=task_id))
            _logged(fleet, f"rejected this agent's update {message_id} (round 0): wrong_shape (encoder.conv.0.weight)")
            played.task(run, task_id=task_id)
            _logged(fleet, f"task {task_id} (round 0) was closed by the coordinator; not answered again")
            assert len(played.sent(AgentChannel.UPDATE)) == 2
            assert "corrupt" not in fleet.log(AGENT)

            played.presence("2.0", round=1)
            _logged(fleet, "the coordinator speaks protocol 2.0, this agent 1.x")
            ignored = played.task(run, round=1)
            _logged(fleet, "unsupported_version (the coordinator speaks protocol 2.0)")
            played.presence("1.2", round=1)  # a coordinator of this major is back: its tasks are answered
            answered = played.task(run, round=1)
            wait_until(lambda: len(played.sent(AgentChannel.UPDATE)) == 3, timeout=120, what="the next answer")
        finally:
            played.close()
    assert decode(played.sent(AgentChannel.UPDATE)[2]).meta.task_id == answered != ignored
    assert fleet.log(AGENT).count("the coordinator speaks protocol 2.0, this agent") == 1  # logged once


def test_an_answer_finished_while_the_broker_was_down_still_reaches_its_round(tmp_path):
    """The broker is stopped while the agent trains and restarted after it finished: paho
    alone would re-send the update at the reconnect, before the coordinator is back; the
    held answer is published once the coordinator's presence shows the round still open.
    The agent is frozen from the start of its training until the broker is down, so the
    order is certain however fast it trains (a loaded box once let it answer first)."""
    from edgepfl.coordinator.fleet import MqttFleet
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.testing import MosquittoBroker

    from tests.conftest import require_mosquitto

    require_mosquitto()
    broker = MosquittoBroker()
    url = broker.start()
    port = broker.port
    # long enough local training that the broker goes down before the answer is ready
    config = run_config(rounds=1, round_timeout_s=240, train={"epochs": 6}, data={"samples_per_client": 1500})
    out = tmp_path / "run"
    try:
        with RunningFleet(config, out, url, 1) as fleet:
            mfleet = MqttFleet(fleet.config.federation, fleet.config.broker, url=url)
            coordinator = Coordinator(fleet.config, mfleet, out, progress=False, **fleet.shape())
            thread, box = run_in_thread(coordinator.run)
            _logged(fleet, f"{AGENT}: built", timeout=240)  # the round-0 task arrived; training starts
            agent = fleet.procs[AGENT]
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                broker.stop()
            finally:
                os.kill(agent.pid, signal.SIGCONT)
            _logged(fleet, "is held: not connected to the broker", timeout=240)
            broker = MosquittoBroker(port=port)
            broker.start()
            thread.join(timeout=400)
            mfleet.close()
            assert "error" not in box, box.get("error")
            log = fleet.log(AGENT)
    finally:
        broker.stop()
    rows = read_rows(out)
    assert rows[0].round == 0 and rows[0].participants == [AGENT] and not rows[0].aborted
    assert rows[0].seconds < 240  # the round closed on the answer, not on its deadline
    assert "publishing the held answer" in log, log[-3000:]
    # the coordinator counted no rejection of it (the held copy is the only one that went out)
    assert not rows[0].rejected, json.dumps(rows[0].rejected)


def test_a_head_agents_metrics_finished_while_the_broker_was_down_reach_the_coordinator_back(tmp_path):
    """The head agent receives a release and the broker dies before its metrics go out (the
    agent process is frozen meanwhile, so the order is certain): paho alone would re-send
    the report at the reconnect, before the coordinator is back; the held report is
    published once the coordinator's presence shows it online again."""
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.releases.release import build_release
    from edgepfl.coordinator.rounds import Coordinator
    from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
    from edgepfl.testing import MosquittoBroker

    from tests.conftest import require_mosquitto

    require_mosquitto()
    config = prepare(run_config(), 0, head_agents=1)
    out = tmp_path / "run"
    # a real release of an (untrained) encoder, exported as the coordinator does
    coordinator = Coordinator(config, LocalFleet({}, config.federation), out, progress=False, **data_shape(config))
    coordinator.init_or_resume()
    assert coordinator.state is not None
    built = build_release(coordinator.state, coordinator.checkpoint_meta(0), out / "releases", config)
    release_id, frame = built.release_id, built.frame

    broker = MosquittoBroker()
    url = broker.start()
    port = broker.port
    agent = spawn_agent(config, out, url, AGENT, 0, tier="head")
    played = PlayedCoordinator(url, config.federation)
    log_path = out / "agents" / f"{AGENT}.log"
    try:
        _statuses(played, 1)
        played.presence("1.2")
        _statuses(played, 2)  # the roll call's birth: the agent knows the coordinator
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            played.publish(federation_topic(config.federation, FederationChannel.RELEASE), frame, retain=True)
            time.sleep(1.0)  # the broker has handed the release to the agent's socket
            played.close()
            broker.stop()  # no persistence: the retained release and presence are gone with it
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        wait_until(lambda: f"release {release_id} installed" in log_path.read_text(), timeout=240,
                   what="the release installed")
        broker = MosquittoBroker(port=port)
        broker.start()
        # the agent reconnects (its birth) before the coordinator is back
        births = TrafficCapture(url, topic=agent_topic(config.federation, AGENT, AgentChannel.STATUS)).start()
        wait_until(births.snapshot, timeout=120, what="the agent's reconnect")
        births.stop()
        played = PlayedCoordinator(url, config.federation)
        played.presence("1.2")
        (report, *_) = wait_until(lambda: played.sent(AgentChannel.METRICS), timeout=60, what="the held metrics")
    finally:
        played.close()
        stop_agents([agent])
        broker.stop()
    metrics = decode(report).meta_as(MetricsMeta)
    assert metrics.release_id == release_id and metrics.num_test > 0
    assert f"publishing the held metrics report of release {release_id}" in log_path.read_text()
