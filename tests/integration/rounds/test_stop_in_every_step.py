"""SIGTERM stops a trainer agent in every step of a round, clear or secure, of a signed and
enrolled fleet: the process exits 0 by itself (it is never killed) and leaves its retained
``offline`` status, while the round goes on without it. Real Mosquitto, a real coordinator,
real agent processes; each agent is stopped the moment the broker shows it in its step
(a frame to it or from it), one step per agent."""

from __future__ import annotations

import subprocess
import threading
import uuid
from collections.abc import Callable

import pytest

from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import Message, MessageType, TaskMeta, agent_topic, decode
from edgepfl.protocol.secagg import SecAggMeta
from edgepfl.testing import TrafficCapture

from tests.attack_kit import signed_fleet
from tests.fleet_helpers import retained_state, run_config

pytest.importorskip("torch")

#: a stopped agent must be gone before systemd would SIGKILL it (the unit's TimeoutStopSec);
#: it takes about two seconds (a step under way is ended at once, then the offline status goes out)
EXIT_WITHIN_S = 20.0


def _step(message: Message) -> str | None:
    """The step a frame on an agent's topic puts it in."""
    if message.type is MessageType.SECAGG:
        return message.meta_as(SecAggMeta).step
    if message.type is MessageType.TASK:
        task = message.meta_as(TaskMeta)
        return "secure task" if task.secagg is not None else f"{task.kind} task"
    if message.type is MessageType.UPDATE:
        return "update"
    return None


#: (the step, where its frame goes): after an agent's own frame it waits, after one to it it works
CLEAR_STEPS = [("train task", "task"), ("update", "update")]
SECURE_STEPS = [("advertise", "task"), ("keys", "update"), ("roster", "task"), ("shares", "update"),
                ("secure task", "task"), ("update", "update"), ("unmask", "task")]


def _stop_at(capture: TrafficCapture, federation: str, agent: str, step: str, channel: str,
             proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM ``proc`` when the broker shows ``agent`` in ``step``."""
    topic = agent_topic(federation, agent, channel)

    def there(messages: list[tuple[str, bytes]]) -> bool:
        for t, payload in messages:
            if t == topic and payload:
                try:
                    if _step(decode(payload)) == step:
                        return True
                except Exception:  # noqa: BLE001 - a chunk of a larger frame: not a step
                    continue
        return False

    capture.wait_for(there, timeout)
    proc.terminate()


def _federate(secure: bool, url: str, tmp_path, steps: list[tuple[str, str]]) -> dict[str, int | None]:
    n = len(steps) + 3  # three agents are never stopped: the round keeps a quorum (every step is in round 0)
    ids = agent_ids(n)
    coordinator_security, agent_security = signed_fleet(tmp_path / "keys", ids)
    config = prepare(run_config(f"st{uuid.uuid4().hex[:8]}", rounds=1, min_agents=3, fraction=1.0,
                                model={"arch": "mlp", "feature_dim": 16}, train={"epochs": 2},
                                data={"dataset": "digits", "samples_per_client": 200},
                                aggregation={"rule": "mean"}, security=coordinator_security,
                                secure_aggregation={"enabled": secure, "step_timeout_s": 10}, round_timeout_s=30), n)
    out = tmp_path / "run"
    procs = [spawn_agent(config, out, url, a, i, security=agent_security[a]) for i, a in enumerate(ids)]
    exits: dict[str, int | None] = {}
    capture = TrafficCapture(url, f"edgepfl/v1/{config.federation}/agents/#").start()
    fleet = MqttFleet(config.federation, config.broker, url=url, security=coordinator_security)
    errors: list[BaseException] = []

    def run(target: Callable[[], object]) -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
    thread = threading.Thread(target=run, args=(coordinator.run,), daemon=True)
    thread.start()
    try:
        for (step, channel), agent, proc in zip(steps, ids, procs):
            _stop_at(capture, config.federation, agent, step, channel, proc, timeout=300)
            try:
                exits[f"{agent} at {step}"] = proc.wait(timeout=EXIT_WITHIN_S)
            except subprocess.TimeoutExpired:
                exits[f"{agent} at {step}"] = None
            assert retained_state(url, agent_topic(config.federation, agent, "status")) == "offline", (agent, step)
        thread.join(600)
        assert not errors, errors
    finally:
        capture.stop()
        fleet.close()
        stop_agents(procs)
    return exits


@pytest.mark.timeout(900)
@pytest.mark.parametrize("secure", [False, True], ids=["clear", "secure"])
def test_an_agent_stopped_in_any_step_of_a_round_exits_by_itself_and_says_offline(mosquitto, tmp_path, secure):
    steps = SECURE_STEPS if secure else CLEAR_STEPS
    exits = _federate(secure, mosquitto.url, tmp_path, steps)
    assert exits == {f"agent-{i:02d} at {step}": 0 for i, (step, _) in enumerate(steps)}
