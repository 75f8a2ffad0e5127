"""Compressed uplinks and task deltas live (protocols 1.6 and 1.7, docs/COMPRESSION.md): a real coordinator asks every agent that
announces a codec for it, and only those. A real trainer process compresses its updates
(error feedback on its disk), a protocol 1.2 device without codecs sends plain updates in
the same federation, and a hostile device's malformed compressed frames are rejected with
their reasons while its real update, sent after them, is taken. Real Mosquitto; what
crosses the broker is recorded by a plain client."""

from __future__ import annotations

import uuid

import numpy as np

from edgepfl import codecs
from edgepfl.coordinator.fleet import MqttFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import data_shape, prepare, spawn_agent, stop_agents
from edgepfl.protocol import Capabilities, Message, MessageType, UpdateMeta, agent_topic, decode, encode

from tests.fleet_helpers import run_config
from tests.integration.rounds.test_nack_live import WireAgent, honest

TRAINER = "agent-00"


def compressed_answer(agent: WireAgent, task: Message, **spoil) -> bytes:
    """A valid FedAvg update (the task's tensors moved a little), compressed as its task asks;
    ``spoil`` replaces arrays or header fields to make it malformed."""
    reference = dict(task.tensors)
    update = {k: (v + np.float32(0.001)).astype(v.dtype) if v.dtype == np.float32 else v for k, v in reference.items()}
    assert task.meta.uplink is not None
    encoded = codecs.encode(update, reference, codecs.CodecSpec.from_uplink(task.meta.uplink),
                            np.random.default_rng(task.header.round))
    arrays = {**encoded.arrays(), **spoil.pop("arrays", {})}
    if "step" in spoil:  # every block's step
        arrays[codecs.SCALES] = np.full_like(arrays[codecs.SCALES], spoil.pop("step"))
    header = encoded.header.model_copy(update=spoil)
    meta = UpdateMeta(task_id=task.meta.task_id, kind="train", num_train=10, num_test=5, eval_correct=3, codec=header)
    return encode(MessageType.UPDATE, federation=task.header.federation, sender=agent.agent_id,
                  round=task.header.round, meta=meta, tensors=arrays)


def hostile(agent: WireAgent, task: Message) -> list[bytes]:
    """Three malformed compressed frames, then the real one."""
    if task.meta.kind != "train":
        return honest(agent, task)
    first = task.meta.uplink
    assert first is not None
    cut = np.zeros(3, np.uint8)  # a payload far shorter than its header says
    return [compressed_answer(agent, task, arrays={codecs.PAYLOAD: cut}),
            compressed_answer(agent, task, codec="q4"),  # not the codec its task asked for
            compressed_answer(agent, task, step=3e38),  # decodes past float32's range
            compressed_answer(agent, task)]


def test_codec_agents_compress_a_plain_12_agent_does_not_and_malformed_compressed_frames_are_rejected(
        mosquitto, broker_capture, tmp_path):
    config = prepare(run_config(f"cz{uuid.uuid4().hex[:8]}", rounds=3, compression={"uplink": "q8", "downlink": "q8"}),
                     1)
    config = config.model_copy(update={"min_agents": 3})
    out, url, fed = tmp_path / "run", mosquitto.url, config.federation
    agents = [WireAgent(url, fed, "plain-12", honest, version="1.2",
                        capabilities=Capabilities(methods=["fedavg"])),
              WireAgent(url, fed, "hostile", hostile, version="1.6",
                        capabilities=Capabilities(methods=["fedavg"], codecs=["q8", "q4"]))]
    procs = [spawn_agent(config, out, url, TRAINER, 0)]
    fleet = MqttFleet(fed, config.broker, url=url)
    try:
        coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
        rows = coordinator.run()
    finally:
        fleet.close()
        stop_agents(procs)
        for agent in agents:
            agent.close()

    training = [r for r in rows if not r.final]
    assert len(training) == 3
    for row in training:  # everyone trained in every round: the hostile device's real update too
        assert row.participants == sorted([TRAINER, "hostile", "plain-12"]), row
        assert row.rejected == {"malformed": 2, "non_finite": 1}, row.rejected

    captured = broker_capture.snapshot()

    def sent(agent_id: str, kind: str) -> list[Message]:
        return [decode(p) for t, p in captured if t == agent_topic(fed, agent_id, kind)]

    # tasks ask for the codec only where it was announced: never the 1.2 agent; every one of the
    # trainer's, round 0's too (its first birth, made before it read the coordinator's presence,
    # declares nothing: the coordinator waits for the birth that declares its codecs)
    assert all(t.meta.uplink is None for t in sent("plain-12", "task"))
    asked = {t.meta.task_id: t.meta.uplink for t in sent(TRAINER, "task") if t.meta.kind == "train"}
    assert [u.codec if u is not None else None for u in asked.values()] == ["q8"] * 3, asked
    # the real trainer compressed each update whose task asked: a quarter of the task's bytes and less
    train_updates = [p for p in (p for t, p in captured if t == agent_topic(fed, TRAINER, "update"))
                     if decode(p).meta.kind == "train"]
    assert len(train_updates) == len(asked) == 3
    task_bytes = coordinator.task_writer.task_bytes(coordinator.state)
    for frame in train_updates:
        meta = decode(frame).meta
        assert (meta.codec is not None) == (asked[meta.task_id] is not None), meta
        if meta.codec is not None:
            assert meta.codec.codec == "q8" and len(frame) <= 0.3 * task_bytes, (len(frame), task_bytes)
    assert all(m.meta.codec is None for m in sent("plain-12", "update"))
    # task deltas (protocol 1.7): only the 1.7 trainer, once it answered a round, gets the state's change
    def tasks(agent_id: str) -> list[Message]:  # the task topic carries nacks too
        return [m for m in sent(agent_id, "task") if m.type == MessageType.TASK]

    assert all(t.meta.downlink is None for a in ("plain-12", "hostile") for t in tasks(a))
    trainer_tasks = tasks(TRAINER)
    deltas = [t for t in trainer_tasks if t.meta.downlink is not None]
    assert len(deltas) >= 2 and not any(r.refused for r in rows), [r.refused for r in rows]
    whole = max(sum(v.nbytes for v in t.tensors.values()) for t in trainer_tasks if t.meta.downlink is None)
    assert all(sum(v.nbytes for v in t.tensors.values()) < 0.3 * whole for t in deltas)
    # its error feedback is on its disk, for the next update
    assert list((out / "agents").rglob("feedback-*.safetensors")), sorted((out / "agents").rglob("*"))
