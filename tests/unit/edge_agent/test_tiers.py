"""Tier runtimes and the agent's dispatch, without a broker.

The trainer tier answers tasks and answers a re-delivered task from its cache; the
head tier turns releases into metrics (and never imports torch, in a fresh interpreter:
tests/integration/agent/test_tier_runtimes_without_torch.py); the agent hands each message to its tier through the
interface and publishes what comes back.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgepfl.config import AgentConfig
from edgepfl.edge_agent.agent import Agent
from edgepfl.edge_agent.tiers import ANSWERED_TASKS, TIERS, HeadTier, Reply, TrainerTier, create_tier
from edgepfl.protocol import (
    RELEASE_REFUSALS,
    AgentChannel,
    DataShape,
    MessageType,
    MethodChoice,
    MetricsMeta,
    RefusalMeta,
    ReleaseMeta,
    ReleaseRef,
    RunSpec,
    TaskMeta,
    UpdateMeta,
    decode,
    encode,
    new_message_id,
)
from edgepfl.protocol.clock import SIMULATION_EPOCH
from edgepfl.specs import ModelSpec, TrainConfig

from tests.export_fixtures import NEW_CLIENT, client_data, export_dir
from tests.wire_samples import sample_manifest

FED = "tiers"
_DATA = client_data(0)
RUN = RunSpec(method=MethodChoice(name="fedavg"), model=ModelSpec(arch="mlp", feature_dim=8, norm="none"),
              train=TrainConfig(epochs=1, batch_size=32, lr=0.05), seed=0,
              data=DataShape(input_shape=_DATA.input_shape, num_classes=_DATA.num_classes,
                             class_names=list(_DATA.class_names)))


def task(kind: str = "train", round: int = 0, tensors=None):
    meta = TaskMeta(task_id=new_message_id(), kind=kind, run=RUN, seed=round, deadline_s=60)
    return decode(encode(MessageType.TASK, federation=FED, sender="coordinator", round=round, meta=meta,
                         tensors=tensors or {}))


@pytest.fixture
def trainer(tmp_path):
    tier = TrainerTier("t-1", client_data(0), str(tmp_path / "state"), device="cpu")
    calls = []
    answer = tier.runtime.answer
    tier.runtime.answer = lambda message: calls.append(message.meta.task_id) or answer(message)
    return tier, calls


def test_the_trainer_tier_answers_a_task_with_an_update(trainer):
    tier, calls = trainer
    assert tier.accepts == (MessageType.TASK, MessageType.SECAGG) and tier.device == "cpu"
    assert tier.subscriptions(FED, "t-1") == [f"edgepfl/v1/{FED}/agents/t-1/task"]
    t = task()
    reply = tier.handle(t)
    assert reply.channel == AgentChannel.UPDATE and reply.round == 0
    update = decode(reply.frame)
    assert isinstance(update.meta, UpdateMeta) and update.meta.task_id == t.meta.task_id
    assert update.header.sender == "t-1" and update.tensors and update.meta.num_train == client_data(0).num_train


def test_a_redelivered_task_is_answered_from_the_cache_without_training_again(trainer):
    tier, calls = trainer
    t = task()
    first = tier.handle(t)
    assert tier.handle(t) is first and calls == [t.meta.task_id]  # same frame, same message id
    later = [task(round=r) for r in range(1, ANSWERED_TASKS + 1)]
    for other in later:
        tier.handle(other)
    assert tier.handle(later[-1]) is not None and len(calls) == 1 + ANSWERED_TASKS  # still cached
    again = tier.handle(t)  # evicted: the oldest of more than ANSWERED_TASKS
    assert len(calls) == 2 + ANSWERED_TASKS and decode(again.frame).header.message_id != decode(first.frame).header.message_id


def _task_for(run: RunSpec, tensors=None):
    meta = TaskMeta(task_id=new_message_id(), kind="train", run=run, seed=0, deadline_s=60)
    return decode(encode(MessageType.TASK, federation=FED, sender="coordinator", round=0, meta=meta,
                         tensors=tensors or {}))


@pytest.mark.parametrize("change,reason,needle", [
    ({"method": MethodChoice(name="fedavg", options={"no_such_option": 1})}, "bad_options", "no_such_option"),
    ({"method": MethodChoice(name="no_such_method")}, "unsupported_method", "unknown method 'no_such_method'"),
    ({"data": RUN.data.model_copy(update={"num_classes": 3, "class_names": list("abc")})}, "data_mismatch",
     "3 classes"),
])
def test_a_task_the_agent_cannot_run_is_answered_with_a_refusal_naming_the_reason(trainer, caplog, change, reason,
                                                                                   needle):
    tier, calls = trainer
    bad = _task_for(RUN.model_copy(update=change))
    with caplog.at_level("ERROR"):
        reply = tier.handle(bad)
    assert reply is not None and reply.refusal and reply.task_id == bad.meta.task_id
    assert reply.channel == AgentChannel.UPDATE and reply.round == 0
    refusal = decode(reply.frame)
    assert refusal.type == MessageType.REFUSAL and refusal.header.sender == "t-1"
    assert refusal.meta_as(RefusalMeta).reason == reason and needle in refusal.meta.detail
    assert [r for r in caplog.records if r.levelname == "ERROR" and reason in r.getMessage()]  # one logged line
    assert tier.handle(bad) is reply  # a redelivered task gets the same refusal, same message id


@pytest.mark.parametrize("weights", ["/nonexistent/resnet18.pt", "/etc/hostname", "/proc/self/environ"])
def test_a_task_never_makes_the_agent_open_a_local_path(trainer, weights):
    """run.model.weights is the coordinator's file: an agent builds without it, so a task
    cannot probe this device's files (the refusal told "not found" from "exists") or feed
    one to torch.load. Every path gets the same answer: an update."""
    tier, _ = trainer
    reply = tier.handle(_task_for(RUN.model_copy(update={"model": ModelSpec(arch="mobilenet_v3_small",
                                                                            weights=weights)})))
    assert reply is not None and not reply.refusal and decode(reply.frame).type == MessageType.UPDATE


def test_a_local_update_that_raises_is_refused_as_error(trainer, caplog):
    tier, calls = trainer
    # a payload the model cannot load: the local update fails on the device
    broken = _task_for(RUN, tensors={"head.weight": np.zeros((7,), np.float32)})
    with caplog.at_level("ERROR", logger="edgepfl.agent"):
        reply = tier.handle(broken)
    assert reply.refusal and decode(reply.frame).meta_as(RefusalMeta).reason == "error"
    assert "failed" in caplog.text


def test_a_pinned_trainer_whose_clock_is_20_minutes_ahead_refuses_a_new_task_as_expired_and_says_why(tmp_path):
    """With a pinned coordinator key a task past its deadline by the device's clock is not
    run; it is refused with reason ``expired`` (PROTOCOL §7), whose detail names how far
    ahead the clock would be, so the operator sees it in the round's row. A task it is
    told is older than one it ran (``stale``) stays silent: that is a replay."""
    from edgepfl.protocol import RefusalMeta
    from edgepfl.protocol.clock import simulated_time

    tier = TrainerTier("t-1", client_data(0), str(tmp_path / "state"), device="cpu", pinned=True)
    meta = TaskMeta(task_id=new_message_id(), kind="train", run=RUN, seed=1, deadline_s=60)
    made = time.time()
    fresh = decode(encode(MessageType.TASK, federation=FED, sender="coordinator", round=1, meta=meta,
                          tensors={}, recipient="t-1"))
    with simulated_time(lambda: made + 1200 - SIMULATION_EPOCH):  # this device's clock: 20 minutes ahead
        reply = tier.handle(fresh)
    assert reply is not None and reply.refusal and reply.task_id == meta.task_id
    refusal = decode(reply.frame).meta_as(RefusalMeta)
    assert refusal.reason == "expired" and "1200s after the task was made" in refusal.detail
    assert "ahead" in refusal.detail

    tier.guard.accept(fresh)  # round 1 of this run is the newest seen: round 0 is a replay
    older = TaskMeta(task_id=new_message_id(), kind="train", run=RUN, seed=0, deadline_s=60)
    assert tier.handle(decode(encode(MessageType.TASK, federation=FED, sender="coordinator", round=0, meta=older,
                                     tensors={}, recipient="t-1"))) is None


def test_a_task_the_coordinator_closed_is_not_answered_again(trainer):
    tier, calls = trainer
    t = task()
    assert tier.handle(t) is not None
    tier.close(t.meta.task_id)
    assert tier.handle(t) is None and calls == [t.meta.task_id]  # neither re-sent nor trained again


def test_the_trainer_declares_the_methods_and_archs_it_can_run(trainer):
    from edgepfl.methods import available_methods

    tier, _ = trainer
    caps = tier.capabilities()
    assert caps.methods == available_methods()  # every method imports here
    assert {"cnn", "mlp", "resnet18", "mobilenet_v3_small"} <= set(caps.archs)  # torchvision is installed here
    assert caps.head_kinds is None


def test_a_head_agent_declares_the_methods_whose_heads_it_builds(tmp_path):
    from edgepfl.methods import available_methods, get_method

    for kind in ("lr", "dualfed", "onnx"):
        tier = HeadTier("pi", client_data(NEW_CLIENT), str(tmp_path / kind), kind)
        caps = tier.capabilities()
        assert caps.head_kinds == [kind] and caps.archs is None
        # what it declares without importing the method modules is what their classes offer
        offered = [m for m in available_methods() if kind == "onnx" or kind in get_method(m).head_kinds]
        assert caps.methods == offered


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from edgepfl.export.onnx_export import read_release

    manifest, artifact = read_release(export_dir(tmp_path_factory.mktemp("rel"), "fedavg", rounds=1))
    meta = ReleaseMeta(release_id=manifest.release_id, manifest=manifest,
                       sha256=hashlib.sha256(artifact).hexdigest(), size_bytes=len(artifact))
    return encode(MessageType.RELEASE, federation=FED, sender="coordinator", round=0, meta=meta,
                  tensors={"artifact": np.frombuffer(artifact, dtype=np.uint8)})


def test_the_head_tier_answers_a_release_with_metrics(release, tmp_path):
    tier = HeadTier("pi", client_data(NEW_CLIENT), str(tmp_path / "pi"), "lr")
    tier.restore()  # nothing saved yet: logged, not raised
    assert tier.accepts == (MessageType.RELEASE,) and tier.device == "cpu-onnxruntime"
    assert tier.subscriptions(FED, "pi") == [f"edgepfl/v1/{FED}/agents/pi/task"]
    # taken on a connection only when needed (edge_agent/release_fetch.py); part 0 of a release in parts
    assert tier.release_topics(FED) == [f"edgepfl/v1/{FED}/release", f"edgepfl/v1/{FED}/release/0"]
    assert tier.installed_release() is None and tier.installed_report(FED) is None
    reply = tier.handle(decode(release))
    assert reply.channel == AgentChannel.METRICS and reply.round == 0
    report = decode(reply.frame)
    assert report.header.sender == "pi" and report.meta.head == "lr" and report.meta.num_test > 0
    assert report.meta.release_id == decode(release).meta.release_id

    restarted = HeadTier("pi", client_data(NEW_CLIENT), str(tmp_path / "pi"), "lr")
    restarted.restore()
    assert restarted.runtime.ready
    meta = decode(release).meta
    assert restarted.installed_release() == ReleaseRef(release_id=meta.release_id, sequence=meta.sequence)
    # what it reports unasked when the coordinator names its release as current: the same figures
    again = decode(restarted.installed_report(FED).frame).meta
    assert again.model_dump() == report.meta.model_dump()


def test_the_head_tier_refuses_a_release_without_or_with_a_wrong_artifact_and_reports_why(release, tmp_path):
    """A release the device does not install is reported to the coordinator (a
    metrics report naming it, ``refused`` saying why, no counts; only to a coordinator of
    1.5, the reply's ``since``), not only logged on the device."""
    tier = HeadTier("pi", client_data(NEW_CLIENT), str(tmp_path / "pi"), "lr")
    good = decode(release)
    empty = encode(MessageType.RELEASE, federation=FED, sender="coordinator", round=0, meta=good.meta)
    corrupt = encode(MessageType.RELEASE, federation=FED, sender="coordinator", round=0, meta=good.meta,
                     tensors={"artifact": good.tensors["artifact"][:-1]})
    for frame, why in ((empty, "carries no artifact"), (corrupt, "sha256 mismatch")):
        reply = tier.handle(decode(frame))
        assert reply is not None and reply.channel == AgentChannel.METRICS and reply.since == RELEASE_REFUSALS
        assert reply.release_id == good.meta.release_id and not tier.runtime.ready
        report = decode(reply.frame).meta_as(MetricsMeta)
        assert report.release_id == good.meta.release_id and report.tier == "head" and report.head == "lr"
        assert why in report.refused and (report.num_test, report.eval_correct) == (0, 0)


def test_every_configurable_tier_has_a_runtime():
    assert set(TIERS) == set(AgentConfig.model_fields["tier"].annotation.__args__)


# ---------------------------------------------------------------- the agent's dispatch


class FakeTier:
    tier = "trainer"
    accepts = MessageType.TASK
    device = "fake"

    def __init__(self):
        self.handled = []

    def subscriptions(self, federation, agent_id):
        return []

    def restore(self):
        pass

    def installed_release(self):
        return None

    def handle(self, message):
        self.handled.append(message)
        return Reply(AgentChannel.UPDATE, b"answer", message.header.round)


class FakeTransport:
    def __init__(self):
        self.published = []
        self.connected = threading.Event()
        self.connected.set()
        self.connect_count = 1

    def publish(self, topic, frame, *, retain=False, round=-1, wait=False):
        self.published.append((topic, frame, round))
        return len(frame)


def test_the_agent_hands_its_tier_only_the_messages_it_accepts_and_publishes_the_reply(caplog):
    agent = Agent(AgentConfig(agent_id="t-1", federation=FED))
    agent.tier, agent.transport = FakeTier(), FakeTransport()
    mine = task(round=2)
    foreign = decode(encode(MessageType.TASK, federation="other", sender="coordinator", round=2, meta=mine.meta))
    with caplog.at_level("WARNING", logger="edgepfl.agent"):
        agent._dispatch(foreign)
        agent._dispatch(decode(encode(MessageType.RELEASE, federation=FED, sender="coordinator", round=0,
                                      meta=ReleaseMeta(release_id="r", manifest=sample_manifest(), sha256="0" * 64,
                                                      size_bytes=0))))
        agent._dispatch(mine)
    assert agent.tier.handled == [mine]
    assert agent.transport.published == [(f"edgepfl/v1/{FED}/agents/t-1/update", b"answer", 2)]
    assert "ignored task for federation other" in caplog.text and "ignored unexpected release" in caplog.text


def test_a_pinned_agent_takes_no_presence_the_coordinator_did_not_sign(tmp_path):
    """A forged presence naming the agent's installed release (1.4) would keep it from a new
    release: with a pinned coordinator key only a signed one counts (SECURITY.md)."""
    from edgepfl.protocol import CoordinatorMeta
    from edgepfl.protocol.signing import generate_keypair, load_signer

    generate_keypair(tmp_path / "c.key", tmp_path / "c.pub")
    generate_keypair(tmp_path / "x.key", tmp_path / "x.pub")
    agent = Agent(AgentConfig(agent_id="t-1", federation=FED, security={"coordinator_key": str(tmp_path / "c.pub")}))
    agent.tier, agent.transport = FakeTier(), FakeTransport()
    meta = CoordinatorMeta(state="online", release=ReleaseRef(release_id="fedavg-r1-aaaaaaaaaaaa", sequence=1))
    for signer in (None, load_signer(tmp_path / "x.key")):
        agent._dispatch(decode(encode(MessageType.COORDINATOR, federation=FED, sender="coordinator", round=1,
                                      meta=meta, signer=signer)))
    assert agent.coordinator is None and agent.rejected == {"unsigned": 1, "bad_signature": 1}
    agent.transport.connected.clear()  # taken, without the fresh birth a connected agent answers it with
    agent._dispatch(decode(encode(MessageType.COORDINATOR, federation=FED, sender="coordinator", round=1, meta=meta,
                                  signer=load_signer(tmp_path / "c.key"))))
    assert agent.coordinator is not None and agent.coordinator.release == meta.release


def test_create_tier_builds_the_configured_tier(tmp_path):
    config = AgentConfig(agent_id="t-1", federation=FED, state_dir=str(tmp_path), device="cpu")
    assert isinstance(create_tier(config, client_data(0)), TrainerTier)


def test_a_paced_trainer_answers_no_sooner_than_its_device_would(tmp_path):
    """simulation.pace_processes: an agent process keeps its simulated device's pace (the
    same model as the virtual clock's, tests/unit/core/test_virtual_clock.py), so one
    profile runs on both paths. A lower bound only: a busy host may be slower still."""
    import time

    from edgepfl.simulation import DevicePace, task_samples

    pace = DevicePace(seconds_per_sample=0.002, downlink_mbps=1, uplink_mbps=0.5, latency_ms=100)
    config = AgentConfig(agent_id="t-1", federation=FED, state_dir=str(tmp_path / "paced"), device="cpu", pace=pace)
    tier = TrainerTier.from_config(config, client_data(0))
    assert tier.pace == pace
    message = task()
    started = time.monotonic()
    reply = tier.handle(message)
    took = time.monotonic() - started
    assert reply is not None and not reply.refusal
    samples = task_samples("train", _DATA.num_train, _DATA.num_test, RUN.train.epochs)
    due = pace.answer_s(0, samples, len(reply.frame))
    assert due == pytest.approx(0.1 + samples * 0.002 + len(reply.frame) * 8 / 0.5e6 + 0.1)
    assert took >= due
    unpaced = TrainerTier.from_config(config.model_copy(update={"pace": None, "state_dir": str(tmp_path / "free")}),
                                      client_data(0))
    assert unpaced.pace is None and unpaced.handle(task()) is not None


def test_a_trainer_pays_torchs_one_time_costs_before_it_announces_itself(tmp_path):
    """The first optimizer a process builds imports torch._dynamo (11 s of a first task's
    time on a loaded 2-core box, measured): the trainer tier's restore(), which the agent
    runs before its birth status, does it, so no task deadline pays for it."""
    import subprocess
    import sys

    code = f"""
import sys
from edgepfl.edge_agent.tiers import TrainerTier
from tests.export_fixtures import client_data
tier = TrainerTier("t-1", client_data(0), {str(tmp_path)!r}, device="cpu")
before = "torch._dynamo" in sys.modules
tier.restore()
print(before, "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[3]))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_a_head_agent_always_names_its_onnxruntime_threads(monkeypatch):
    """Left to choose, onnxruntime pins its threads to cores, which the hardened unit forbids
    (and onnxruntime then prints an error line per thread into the JSON journal)."""
    from edgepfl.edge_agent.tiers import onnx_threads

    assert onnx_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what the example unit sets
    assert onnx_threads(None) == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert onnx_threads(None) == len(os.sched_getaffinity(0))
    tier = HeadTier.from_config(AgentConfig(agent_id="pi", tier="head"), client_data(NEW_CLIENT))
    assert tier.runtime.threads == len(os.sched_getaffinity(0))


def test_sigterm_during_a_training_task_ends_it_at_once_unanswered(tmp_path):
    """The agent's SIGTERM handler (Agent.terminate) in the middle of a long local training
    (thousands of epochs): the training stops at its next step (Stopped), and the task has no
    answer, cached or sent. Unstopped, the training would finish and answer."""
    import signal

    from edgepfl.service import Stopped, interruptible

    tier = TrainerTier("t-1", client_data(0), str(tmp_path / "state"), device="cpu")
    tier.restore()
    long_run = RUN.model_copy(update={"train": TrainConfig(epochs=3000, batch_size=8, lr=0.05)})
    meta = TaskMeta(task_id=new_message_id(), kind="train", run=long_run, seed=0, deadline_s=600)
    message = decode(encode(MessageType.TASK, federation=FED, sender="coordinator", round=0, meta=meta))
    agent = Agent(AgentConfig(agent_id="t-1"))
    previous = signal.signal(signal.SIGTERM, agent.terminate)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))  # delivered to the main thread
    try:
        with pytest.raises(Stopped), interruptible():
            timer.start()
            tier.handle(message)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert agent._stop.is_set() and meta.task_id not in tier._answered


@pytest.mark.parametrize("coordinator", ["1.12", "1.11"])
def test_a_bad_shares_refusal_names_its_peers_to_a_1_12_coordinator_and_is_an_error_to_an_older_one(trainer,
                                                                                                  coordinator):
    """A coordinator before 1.12 would refuse a refusal with ``peers`` as malformed: it is sent
    the same refusal as ``error``, the peers in its detail only (PROTOCOL.md §5)."""
    from edgepfl.protocol import CoordinatorMeta

    tier, _ = trainer
    refused = task(round=3)
    reply = tier._refusal(refused, "bad_shares", "the shares from a1 do not open", ["a1"])
    agent = Agent(AgentConfig(agent_id="t-1", federation=FED))
    agent.tier, agent.transport = FakeTier(), FakeTransport()
    agent.coordinator = CoordinatorMeta(state="online", version=coordinator)
    agent._send(reply)
    [(topic, frame, round)] = agent.transport.published
    sent = decode(frame).meta_as(RefusalMeta)
    assert (topic, round, sent.task_id) == (f"edgepfl/v1/{FED}/agents/t-1/update", 3, refused.meta.task_id)
    expected = ("bad_shares", ["a1"]) if coordinator == "1.12" else ("error", None)
    assert (sent.reason, sent.peers) == expected and "a1 do not open" in sent.detail
