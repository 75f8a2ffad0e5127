"""An agent announces the largest frame it accepts, and is never sent a larger one
(PROTOCOL.md §15, `capabilities.max_payload_bytes`, 1.4). Real Mosquitto, real agent
processes, a real coordinator; what crosses the broker is recorded by a plain client."""

from __future__ import annotations

import json
import time

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import agent_topic

from tests.fleet_helpers import run_config, wait_until

SMALL = "agent-02"


def test_an_agent_that_takes_smaller_frames_than_the_runs_tasks_is_sent_none_and_nobody_waits_for_it(
        mosquitto, broker_capture, tmp_path, caplog):
    config = prepare(run_config(rounds=2), 3).model_copy(update={"min_agents": 2})
    small = config.model_copy(update={"broker": config.broker.model_copy(update={"max_payload_bytes": 65_536})})
    out, url = tmp_path / "run", mosquitto.url
    procs = [spawn_agent(config, out, url, f"agent-{i:02d}", i) for i in range(2)]
    procs.append(spawn_agent(small, out, url, SMALL, 2))
    # the run does not wait for it (it is never eligible): on a busy machine two rounds could
    # end before it connects, and with them the chance to see what it declares
    small_log = out / "agents" / f"{SMALL}.log"
    wait_until(lambda: small_log.is_file() and f"agent {SMALL} (trainer tier) online" in small_log.read_text(), 180,
               interval=0.2, what=f"{SMALL} online")
    fleet = MqttFleet(config.federation, config.broker, url=url)
    try:
        with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
            coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
            rows = coordinator.run()
    finally:
        fleet.close()
        stop_agents(procs)
    task_bytes = coordinator.task_writer.task_bytes(coordinator.state)
    assert task_bytes > 65_536  # the run's tasks are larger than what the small agent takes
    assert f"{SMALL} gets no task" in caplog.text and "above the 65536 it accepts" in caplog.text
    # Once its status declares the limit, not a byte of a task. A task can reach it only before
    # that status: its first birth, made before it read the coordinator's presence, declares
    # nothing. It refuses that one `too_large` from the header alone and is sent no other.
    sent_to_small = [p for t, p in broker_capture.snapshot() if t == agent_topic(config.federation, SMALL, "task")]
    refused = sum(r.refused.get("too_large", 0) for r in rows)
    assert len(sent_to_small) == refused <= 1, (len(sent_to_small), [r.refused for r in rows])
    assert all(r.participants and SMALL not in r.participants for r in rows if not r.final), rows
    assert all(not r.dropped for r in rows)  # nobody was waited for
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == len(rows) == 3  # two rounds and the final evaluation


def test_a_task_larger_than_an_agent_takes_is_refused_too_large_from_its_header(mosquitto, tmp_path):
    """The window before an agent's status declares its limit: a task sent then is dropped
    unread, and answered with a refusal `too_large` (1.4), which the round counts instead of
    waiting for it."""
    from edgepfl.coordinator.fleet import AgentFrame
    from edgepfl.protocol import AgentChannel, CoordinatorMeta, MessageType, RefusalMeta, decode

    config = prepare(run_config(rounds=1), 1)
    small = config.model_copy(update={"broker": config.broker.model_copy(update={"max_payload_bytes": 65_536})})
    out, url = tmp_path / "run", mosquitto.url
    fleet = MqttFleet(config.federation, config.broker, url=url)
    proc = spawn_agent(small, out, url, SMALL, 0)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        coordinator.init_or_resume()
        fleet.announce(CoordinatorMeta(state="online", method=config.method.name, round=0))
        coordinator.task_writer.open(0, coordinator.state, coordinator.epoch)
        task_id, frame = coordinator.task_writer.frame(SMALL, "train")
        assert len(frame) > 65_536
        deadline = time.monotonic() + 120
        refusal = None
        sent = False
        while refusal is None and time.monotonic() < deadline:
            event = fleet.poll(0.5)
            if not isinstance(event, AgentFrame):
                continue
            message = decode(event.frame)
            if event.channel == AgentChannel.STATUS and not sent:
                # past the fleet's own check, as a coordinator that has not read the limit yet would send it
                fleet.transport.publish(agent_topic(config.federation, SMALL, "task"), frame, round=0)
                sent = True
            elif message.type == MessageType.REFUSAL:
                refusal = message.meta_as(RefusalMeta)
    finally:
        fleet.close()
        stop_agents([proc])
    assert refusal is not None and refusal.task_id == task_id and refusal.reason == "too_large", refusal
    assert "65536" in refusal.detail


def test_the_fleet_never_sends_a_frame_above_the_declared_limit_and_says_so(mosquitto, broker_capture):
    """What the fleet does when a frame is larger than the agent declared (a method that adds
    tensors per agent, FedPAC's, past the run's measured task size): nothing goes out, and
    ``poll`` hands the round a refusal ``too_large`` for the task in the agent's place."""
    from edgepfl.config import BrokerConfig
    from edgepfl.coordinator.gate import Refused

    fleet = MqttFleet("largest", BrokerConfig(), url=mosquitto.url)
    try:
        fleet.agent_limits("pi", None, 20_000)
        assert fleet.send("pi", b"x" * 20_001, 3) == 0
        event = fleet.poll(1.0)
        assert isinstance(event, Refused) and (event.agent_id, event.reason) == ("pi", "too_large")
        assert fleet.send("pi", b"y" * 20_000, 3) > 0  # at the limit: sent
        topic = agent_topic("largest", "pi", "task")
        wait_until(lambda: any(t == topic for t, _ in broker_capture.snapshot()), 30, what="the frame at the limit")
    finally:
        fleet.close()
    assert [p for t, p in broker_capture.snapshot() if t == topic] == [b"y" * 20_000]  # and only it
