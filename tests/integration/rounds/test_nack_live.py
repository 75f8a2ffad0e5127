"""Protocol 1.2 on the coordinator side, end to end: NACKs, refusals, capabilities, versions.

A live coordinator (the real round loop over :class:`MqttFleet`) on the test Mosquitto,
and agents that are plain paho clients speaking the protocol as a foreign device would:
they build their frames with ``edgepfl.protocol.encode`` and nothing else of edgepfl. Each
plays one part of docs/PROTOCOL.md §7 and §10: an update with a wrong tensor shape, a
refusal, capabilities that exclude the run, a status of protocol 2.0, a 1.1 agent with a
bad update, a busy agent, a flood of bad frames. The round timeout is 60 s; the rounds
must close in a few seconds, and every agent is told what the document says it is told.
(The NACK rate bounds in process: tests/unit/coordinator/test_nack.py.)
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import paho.mqtt.client as mqtt

from edgepfl.broker import parse_broker_url
from edgepfl.config import RunConfig
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.nack import AGENT_BURST, AGENT_RATE_PER_S
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.protocol import (
    Capabilities,
    Message,
    MessageType,
    RefusalMeta,
    StatusMeta,
    UpdateMeta,
    decode,
    encode,
    new_message_id,
)

from tests.fleet_helpers import run_in_thread, wait_until

TIMEOUT_S = 60


def answer(agent_id: str, task: Message, tensors: dict | None = None, **meta) -> bytes:
    """The update a correct agent publishes for ``task`` (the task's own tensors: a valid FedAvg update)."""
    fields = dict(task_id=task.meta.task_id, kind=task.meta.kind, num_train=10, num_test=5, eval_correct=3)
    fields.update(meta)
    if tensors is None:
        tensors = dict(task.tensors) if task.meta.kind == "train" else {}
    return encode(MessageType.UPDATE, federation=task.header.federation, sender=agent_id, round=task.header.round,
                  meta=UpdateMeta(**fields), tensors=tensors)


class WireAgent:
    """A device on a plain paho client: a retained status, its task topic, and an answer per task.

    ``behave(agent, task)`` returns the frames to publish on the update topic for a task;
    everything arriving on the task topic is kept, decoded, in :attr:`tasks` and :attr:`nacks`.
    """

    def __init__(self, url: str, federation: str, agent_id: str, behave: Callable[[WireAgent, Message], list[bytes]],
                 **status):
        self.agent_id, self.federation, self.behave = agent_id, federation, behave
        self.base = f"edgepfl/v1/{federation}/agents/{agent_id}"
        self.tasks: list[Message] = []
        self.nacks: list[Message] = []
        self.sent: list[bytes] = []
        self.lock = threading.Lock()
        self.status = StatusMeta(**{"state": "online", "num_train": 10, "num_test": 5,
                                    "session": uuid.uuid4().hex, **status})
        host, port, _ = parse_broker_url(url)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-{federation}-{agent_id}",
                                  protocol=mqtt.MQTTv311, clean_session=True)
        will = self.status.model_copy(update={"state": "offline"})
        self.client.will_set(f"{self.base}/status", self._frame(MessageType.STATUS, -1, will), qos=1, retain=True)
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()

    def _frame(self, type: MessageType, round: int, meta) -> bytes:
        return encode(type, federation=self.federation, sender=self.agent_id, round=round, meta=meta)

    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        client.subscribe(f"{self.base}/task", qos=1)
        client.publish(f"{self.base}/status", self._frame(MessageType.STATUS, -1, self.status), qos=1, retain=True)

    def _on_message(self, client, userdata, msg) -> None:
        message = decode(msg.payload)
        with self.lock:
            (self.nacks if message.type == MessageType.NACK else self.tasks).append(message)
        if message.type == MessageType.TASK:
            for frame in self.behave(self, message):
                self.publish(frame)

    def publish(self, frame: bytes) -> None:
        self.sent.append(frame)
        self.client.publish(f"{self.base}/update", frame, qos=1)

    def close(self) -> None:
        self.client.publish(f"{self.base}/status", b"", qos=1, retain=True).wait_for_publish(5)
        self.client.loop_stop()
        self.client.disconnect()


def honest(agent: WireAgent, task: Message) -> list[bytes]:
    return [answer(agent.agent_id, task)]


def config(federation: str, **overrides) -> RunConfig:
    base = dict(federation=federation, method={"name": "fedavg"},
                model={"arch": "mlp", "feature_dim": 8, "norm": "none"}, rounds=2, round_timeout_s=TIMEOUT_S,
                wait_for_agents_s=60, input_shape=[1, 4, 4], num_classes=3,
                normalization={"mean": [0.5], "std": [0.5]}, device="cpu")
    base.update(overrides)
    return RunConfig(**base)


def run_coordinator(cfg: RunConfig, url: str, out) -> tuple[Coordinator, MqttFleet, threading.Thread, dict]:
    fleet = MqttFleet(cfg.federation, cfg.broker, url=url)
    coordinator = Coordinator(cfg, fleet, out, progress=False)
    thread, box = run_in_thread(coordinator.run)
    return coordinator, fleet, thread, box


def finish(thread: threading.Thread, box: dict, fleet: MqttFleet, agents: list[WireAgent]) -> None:
    thread.join(timeout=240)
    fleet.close()
    for agent in agents:
        agent.close()
    assert not thread.is_alive(), "the coordinator did not finish"
    assert "error" not in box, box.get("error")


def test_rejected_and_refused_tasks_do_not_cost_the_deadline_and_each_agent_is_told_what_the_protocol_says(
        mosquitto, tmp_path):
    fed = f"nack{uuid.uuid4().hex[:8]}"
    url = mosquitto.url

    def wrong_shape(agent: WireAgent, task: Message) -> list[bytes]:
        if task.meta.kind != "train":
            return honest(agent, task)
        tensors = {k: np.zeros((*v.shape[:-1], v.shape[-1] + 1), v.dtype) if v.ndim else v
                   for k, v in task.tensors.items()}
        return [answer(agent.agent_id, task, tensors)]

    def refuses(agent: WireAgent, task: Message) -> list[bytes]:
        return [encode(MessageType.REFUSAL, federation=fed, sender=agent.agent_id, round=task.header.round,
                       meta=RefusalMeta(task_id=task.meta.task_id, reason="bad_options", detail="unknown option"))]

    def inflates(agent: WireAgent, task: Message) -> list[bytes]:
        if task.meta.kind != "train":
            return honest(agent, task)
        return [answer(agent.agent_id, task, eval_correct=6)]  # more correct than tested: malformed

    agents = [
        WireAgent(url, fed, "good-0", honest),
        WireAgent(url, fed, "good-1", honest,
                  capabilities=Capabilities(methods=["fedavg"], archs=["mlp"], max_message_bytes=65_536)),
        WireAgent(url, fed, "shape", wrong_shape),  # (a)
        WireAgent(url, fed, "refuser", refuses),  # (b)
        WireAgent(url, fed, "incapable", honest, capabilities=Capabilities(methods=["fedrep", "dualfed"])),  # (c)
        WireAgent(url, fed, "future", honest, version="2.0"),  # (d)
        WireAgent(url, fed, "old", inflates, version="1.1"),  # (e)
        WireAgent(url, fed, "busy", honest, state="busy"),
    ]
    by_id = {a.agent_id: a for a in agents}
    # five capable trainers: min_agents counts neither "incapable", "busy" nor "future"
    # unsigned: a rejected answer cannot prove it is the agent's, so it answers no task (PROTOCOL §7)
    # and the round runs to its deadline; a short one keeps the test short
    coordinator, fleet, thread, box = run_coordinator(config(fed, min_agents=5, round_timeout_s=5, rounds=3), url,
                                                      tmp_path / "run")
    finish(thread, box, fleet, agents)
    rows = box["result"]

    first = rows[0]
    assert first.sampled == ["good-0", "good-1", "old", "refuser", "shape"]
    # the refusal answered its task; the two rejected answers did not: dropped at the deadline
    assert first.participants == ["good-0", "good-1"] and first.dropped == ["old", "shape"]
    assert first.rejected.get("wrong_shape") == 1 and first.rejected.get("malformed") == 1
    assert first.refused == {"bad_options": 1}
    # unsigned, a refusal cannot prove it is the agent's (anyone may write it, PROTOCOL §7), so
    # it does not keep the agent out of the run: the refuser is asked again every round, and
    # every refusal answers its task at once (a signed refusal excludes: test_signing.py). The
    # dropped agents answered nothing that was accepted: they sit out round 1, then are asked again
    assert rows[1].sampled == ["good-0", "good-1", "refuser"] and rows[1].refused == {"bad_options": 1}
    assert rows[2].sampled == ["good-0", "good-1", "old", "refuser", "shape"]
    assert all(not r.dropped or r.dropped == ["old", "shape"] for r in rows)  # the refuser never waited for
    assert [t.header.round for t in by_id["refuser"].tasks][:3] == [0, 1, 2]
    assert rows[-1].final and rows[-1].evaluated == 4

    # (a) a 1.2 agent is told, on its task topic, which frame was rejected and why
    shape_train_updates = [decode(f) for f in by_id["shape"].sent if decode(f).meta.kind == "train"]
    nacks = by_id["shape"].nacks
    assert [(n.meta.reason, n.meta.rejected_type) for n in nacks] == [("wrong_shape", "update")] * 2
    assert [n.meta.message_id for n in nacks] == [u.header.message_id for u in shape_train_updates]
    assert [n.meta.task_id for n in nacks] == [u.meta.task_id for u in shape_train_updates]
    assert all(n.header.sender == "coordinator" and n.header.round == u.header.round
               for n, u in zip(nacks, shape_train_updates))
    # (b) a refusal is an answer, not a rejection: nothing to NACK
    assert by_id["refuser"].nacks == []
    # (c) and busy: registered, online, never sent a task
    assert by_id["incapable"].tasks == [] and by_id["busy"].tasks == []
    assert {"incapable", "busy"} <= set(coordinator.registry.online("trainer"))
    # (d) another major version: not registered, told why (its status was the frame refused)
    assert not coordinator.registry.known("future") and by_id["future"].tasks == []
    assert [(n.meta.reason, n.meta.rejected_type) for n in by_id["future"].nacks][:1] == [
        ("unsupported_version", "status")]
    # (e) a 1.1 agent: sampled as before; its rejected update is not NACKed (1.1 has no NACKs)
    assert by_id["old"].nacks == [] and len(by_id["old"].tasks) == 3


def test_nacks_to_one_agent_are_rate_bounded_and_the_round_goes_on(mosquitto, tmp_path):
    fed = f"flood{uuid.uuid4().hex[:8]}"
    url = mosquitto.url
    flood = 100
    timing: dict[str, float] = {}

    def floods_then_answers(agent: WireAgent, task: Message) -> list[bytes]:
        if task.header.round != 0:
            return honest(agent, task)
        # answers to tasks never sent (each a new message): every one is rejected, none ends the wait
        bogus = [answer(agent.agent_id, task, task_id=new_message_id()) for _ in range(flood)]
        timing["start"] = time.monotonic()
        return [*bogus, *honest(agent, task)]

    agents = [WireAgent(url, fed, "good", honest), WireAgent(url, fed, "noisy", floods_then_answers)]
    coordinator, fleet, thread, box = run_coordinator(config(fed, rounds=1), url, tmp_path / "run")
    wait_until(lambda: len(agents[1].tasks) >= 1 and coordinator.counters.rejected["unexpected"] >= flood, 120,
               what="the flood admitted")
    elapsed = time.monotonic() - timing["start"]
    finish(thread, box, fleet, agents)
    rows = box["result"]

    assert rows[0].participants == ["good", "noisy"] and rows[0].rejected == {"unexpected": flood}
    assert rows[0].seconds < TIMEOUT_S / 3
    nacks = [n for n in agents[1].nacks if n.meta.reason == "unexpected"]
    # the burst, then at most the refill rate over the time the flood took to be admitted
    assert AGENT_BURST <= len(nacks) <= AGENT_BURST + AGENT_RATE_PER_S * elapsed + 1, (len(nacks), elapsed)
    assert coordinator.inbox.nacks.suppressed == flood - len(nacks)
    assert agents[0].nacks == []


def test_what_is_sent_to_an_agent_is_chunked_to_the_message_size_it_declared(mosquitto, broker_capture):
    fed = f"limit{uuid.uuid4().hex[:8]}"
    fleet = MqttFleet(fed, config(fed).broker, url=mosquitto.url)
    try:
        frame = encode(MessageType.UPDATE, federation=fed, sender="coordinator", round=0,
                       meta=UpdateMeta(task_id=new_message_id(), kind="train", num_train=1, num_test=0,
                                       eval_correct=0), tensors={"w": np.zeros(20_000, np.float32)})
        fleet.agent_limits("small", 16_384)
        fleet.agent_limits("large", 10**9)  # above the coordinator's own M: its own M applies
        for agent in ("small", "large", "undeclared"):
            fleet.send(agent, frame, 0)
        topic = f"edgepfl/v1/{fed}/agents/{{}}/task"
        wait_until(lambda: all(any(t == topic.format(a) for t, _ in broker_capture.snapshot())
                               for a in ("small", "large", "undeclared")), 30, what="the frames")
        time.sleep(0.5)
        got = {a: [p for t, p in broker_capture.snapshot() if t == topic.format(a)]
               for a in ("small", "large", "undeclared")}
    finally:
        fleet.close()
    assert len(frame) > 80_000
    assert got["large"] == [frame] and got["undeclared"] == [frame]
    chunks = [decode(p) for p in got["small"]]
    assert len(chunks) == -(-len(frame) // (16_384 - 2048)) and all(len(p) <= 16_384 for p in got["small"])
    assert b"".join(bytes(c.tensors["data"]) for c in sorted(chunks, key=lambda c: c.meta.index)) == frame
