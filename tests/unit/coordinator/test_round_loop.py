"""The round loop against a scripted fleet: no broker, no processes, every event chosen by the test.

What is checked here is the coordinator's own logic: when a round closes (all answered,
quorum + everyone missing offline, quorum + timeout, hard deadline), what it counts
(rejections from the fleet, the gate and the aggregation rule, by reason), what it tells
the fleet (agents coming online), that a hostile sample count cannot crash it, that a
round of 1,000 agents costs time proportional to its messages, and what becomes of the
round's aggregate: refused when not finite or moved too far, rolled back after repeated
failures, and (with a streaming rule) holding no update's tensors.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import pytest

from edgepfl.aggregation import UPDATE_HISTORY, UPDATE_NORM_MEDIAN
from edgepfl.config import RunConfig
from edgepfl.coordinator.clock import VirtualClock
from edgepfl.coordinator.fleet import AgentFrame, Fleet
from edgepfl.coordinator.gate import Rejection
from edgepfl.coordinator.ops.report import write_report
from edgepfl.coordinator.registry import Registry
from edgepfl.coordinator.releases.channel import ReleaseChannel
from edgepfl.coordinator.result import RoundResult
from edgepfl.coordinator.round_tasks import MAX_TASK_COPIES, Task
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.metrics import MetricsError, read_head_metrics, read_metrics
from edgepfl.protocol import (
    AgentChannel,
    Capabilities,
    CoordinatorMeta,
    Message,
    MessageType,
    MetricsMeta,
    RefusalMeta,
    StatusMeta,
    UpdateMeta,
    decode,
    encode,
    unbounded_values,
)

FED = "loop"
# A protocol-level agent: answers with the tensors it got, 2 of 5 correct.
Responder = Callable[[Message], list[bytes]]


def honest(agent_id: str, num_train: int = 10, **meta) -> Responder:
    def answer(task: Message) -> list[bytes]:
        fields = dict(task_id=task.meta.task_id, kind=task.meta.kind, num_train=num_train, num_test=5, eval_correct=2)
        fields.update(meta)
        tensors = dict(task.tensors) if task.meta.kind == "train" else {}
        return [encode(MessageType.UPDATE, federation=FED, sender=agent_id, round=task.header.round,
                       meta=UpdateMeta(**fields), tensors=tensors)]
    return answer


def silent(task: Message) -> list[bytes]:
    return []


def status(agent_id: str, state: str = "online", tier: str = "trainer", num_train: int = 10, **meta) -> AgentFrame:
    """An agent's status as a current agent sends it once it has read the presence: with its
    capabilities (none limiting), unless ``capabilities`` says otherwise."""
    meta.setdefault("capabilities", Capabilities())
    frame = encode(MessageType.STATUS, federation=FED, sender=agent_id, round=-1,
                   meta=StatusMeta(state=state, tier=tier, num_train=num_train, num_test=5, **meta))
    return AgentFrame(agent_id, AgentChannel.STATUS, frame, len(frame))


class ScriptedFleet(Fleet):
    """Agents as responder functions; events the test injects come out of poll() in order."""

    def __init__(self, agents: dict[str, Responder]):
        self.agents = agents
        self.events: deque[AgentFrame | Rejection] = deque(status(a) for a in agents)
        self.online_calls: list[tuple[str, str]] = []
        self.on_send: Callable[[str, Message], None] | None = None
        #: the NACKs sent, in order: (agent id, decoded frame)
        self.told: list[tuple[str, Message]] = []

    def send(self, agent_id: str, frame: bytes, round: int) -> int:
        task = decode(frame)
        if self.on_send:
            self.on_send(agent_id, task)
        for answer in self.agents[agent_id](task):
            self.events.append(AgentFrame(agent_id, AgentChannel.UPDATE, answer, len(answer)))
        return len(frame)

    def tell(self, agent_id: str, frame: bytes) -> int:
        self.told.append((agent_id, decode(frame)))
        return len(frame)

    def poll(self, timeout: float) -> AgentFrame | Rejection | None:
        if self.events:
            return self.events.popleft()
        time.sleep(min(timeout, 0.01))
        return None

    def agent_status(self, agent_id: str, status: StatusMeta, came_online: bool) -> None:
        if came_online:
            self.online_calls.append((agent_id, status.tier))

    def announce(self, meta: CoordinatorMeta) -> None:
        """Presence is not scripted."""

    def close(self) -> None:
        """Nothing to release."""


class OwnFleet(ScriptedFleet):
    """A fleet whose frames are provably its agents' own (as in-process agents' are), on a
    virtual clock: an answer of an agent in ``late_s`` comes that many seconds after the one
    before it, and a poll with nothing to deliver lets its whole timeout pass."""

    own_frames = True

    def __init__(self, agents: dict[str, Responder], late_s: dict[str, float] | None = None):
        super().__init__(agents)
        self.clock = VirtualClock()
        self.late_s = late_s or {}

    def poll(self, timeout: float) -> AgentFrame | Rejection | None:
        if not self.events:
            self.clock.advance_to(self.clock.now() + timeout)
            return None
        event = self.events.popleft()
        if isinstance(event, AgentFrame) and event.channel == AgentChannel.UPDATE:
            self.clock.advance_to(self.clock.now() + self.late_s.get(event.agent_id, 0.0))
        return event


class BrokerFleetOnAVirtualClock(OwnFleet):
    """As a broker's fleet (frames not provably their agents' own: a first miss may be a
    reconnect's lost task), on :class:`OwnFleet`'s virtual clock."""

    own_frames = False


def config(**overrides) -> RunConfig:
    base = dict(federation=FED, method={"name": "fedavg"}, model={"arch": "mlp", "feature_dim": 8, "norm": "none"},
                rounds=1, round_timeout_s=30, wait_for_agents_s=5, input_shape=[1, 4, 4],
                num_classes=3, normalization={"mean": [0.5], "std": [0.5]}, device="cpu")
    base.update(overrides)
    return RunConfig(**base)


def coordinator(fleet: ScriptedFleet, tmp_path, **overrides) -> Coordinator:
    """A coordinator that starts once all of the fleet's trainers are online."""
    return Coordinator(config(**{"min_agents": len(fleet.agents), **overrides}), fleet, tmp_path / "run",
                       progress=False)


def test_a_round_closes_when_everyone_answered(tmp_path):
    fleet = ScriptedFleet({a: honest(a) for a in ("a", "b", "c")})
    # a deadline no busy machine reaches: a round that waited for it instead of closing on the
    # last answer would take 3600 s (an event, not a margin on how fast this machine is)
    rows = coordinator(fleet, tmp_path, round_timeout_s=3600).run()
    assert rows[0].seconds < 3600
    assert rows[0].participants == ["a", "b", "c"] and rows[0].dropped == [] and not rows[0].aborted
    assert rows[0].accuracy == pytest.approx(0.4) and rows[-1].final and rows[-1].evaluated == 3
    assert fleet.online_calls == [("a", "trainer"), ("b", "trainer"), ("c", "trainer")]


def test_a_round_with_a_quorum_closes_as_soon_as_the_missing_agents_are_offline(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"), "c": silent})

    def c_dies_with_its_task(agent: str, task: Message) -> None:
        if agent == "c" and task.header.round == 0:
            fleet.events.append(status("c", state="offline"))

    fleet.on_send = c_dies_with_its_task
    started = time.monotonic()
    rows = coordinator(fleet, tmp_path, quorum=0.5).run()
    assert time.monotonic() - started < 10
    assert rows[0].participants == ["a", "b"] and rows[0].dropped == ["c"] and not rows[0].aborted


def test_a_round_with_a_quorum_closes_at_the_timeout(tmp_path):
    fleet = BrokerFleetOnAVirtualClock({"a": honest("a"), "b": honest("b"), "c": silent})
    rows = coordinator(fleet, tmp_path, quorum=0.5, round_timeout_s=1.0).run()
    assert rows[0].seconds >= 1.0
    assert rows[0].participants == ["a", "b"] and rows[0].dropped == ["c"] and not rows[0].aborted


def test_a_round_without_a_quorum_waits_twice_the_timeout_and_is_aborted(tmp_path):
    fleet = BrokerFleetOnAVirtualClock({"a": honest("a"), "b": silent, "c": silent})
    coord = coordinator(fleet, tmp_path, quorum=1.0, round_timeout_s=0.5)
    coord.init_or_resume()
    before = {k: v.copy() for k, v in coord.state.global_tensors.items()}
    rows = coord.run()
    assert rows[0].seconds >= 1.0
    assert rows[0].aborted and rows[0].participants == ["a"] and rows[0].dropped == ["b", "c"]
    assert all((coord.state.global_tensors[k] == v).all() for k, v in before.items())


def test_rejections_from_the_fleet_and_the_gate_are_counted_by_reason(tmp_path, caplog):
    def mallory(task: Message) -> list[bytes]:
        good = honest("m")(task)
        if task.meta.kind != "train":
            return good
        return [b"junk", *honest("m", num_train=10**400)(task), *good]

    fleet = ScriptedFleet({"a": honest("a"), "m": mallory})
    fleet.events.append(Rejection(None, "bad_topic", "edgepfl/v1/loop/nope"))
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        coord = coordinator(fleet, tmp_path, round_timeout_s=60)
        rows = coord.run()
    # junk is nobody's frame; the inflated update names m but is unsigned, so it answers
    # nothing (anyone could have sent it): m's good update after it is accepted
    assert rows[0].participants == ["a", "m"] and rows[0].dropped == []
    assert rows[0].rejected == {"bad_topic": 1, "malformed": 2} and rows[1].rejected == {}
    assert coord.counters.rejected == {"bad_topic": 1, "malformed": 2}
    assert "rejected message from ?: bad_topic" in caplog.text
    assert "rejected message from m: malformed (num_train exceeds the 10 samples its status announced)" in caplog.text
    # m announced 1.2: told of the frame in its name, with the reason, the message and the task
    assert [(a, m.meta.reason) for a, m in fleet.told] == [("m", "malformed")]
    nack = fleet.told[0][1]
    assert nack.type == MessageType.NACK and nack.meta.rejected_type == "update" and nack.header.round == 0
    assert nack.meta.task_id is not None


def test_a_hostile_sample_count_is_rejected_and_cannot_take_over_or_crash_the_server_step(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"), "m": honest("m", num_train=10**400)})
    rows = coordinator(fleet, tmp_path, quorum=0.5, round_timeout_s=2).run()
    assert rows[0].participants == ["a", "b"] and rows[0].rejected == {"malformed": 1}
    # unsigned, m's rejected update answers nothing: the round closes on its deadline without m
    assert rows[0].dropped == ["m"] and not rows[0].aborted


def test_a_1_1_agents_rejected_update_is_counted_but_it_is_not_told(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "old": honest("old", num_train=10**400)})
    fleet.events = deque([status("a"), status("old", version="1.1")])
    rows = coordinator(fleet, tmp_path, round_timeout_s=2).run()
    assert rows[0].participants == ["a"] and rows[0].rejected == {"malformed": 1}
    # unsigned: the rejection did not answer old's task (a forgery could have), so the round
    # closed on its deadline without old's answer
    assert rows[0].dropped == ["old"]
    assert fleet.told == []


def refuses(agent_id: str, reason: str, then: Responder | None = None) -> Responder:
    """Refuses its first task with ``reason``; later tasks go to ``then`` (default: refused too)."""
    refused: list[int] = []

    def answer(task: Message) -> list[bytes]:
        if refused and then is not None:
            return then(task)
        refused.append(task.header.round)
        return [encode(MessageType.REFUSAL, federation=FED, sender=agent_id, round=task.header.round,
                       meta=RefusalMeta(task_id=task.meta.task_id, reason=reason, detail="cannot"))]
    return answer


def test_a_refused_task_is_answered_counted_by_reason_and_keeps_the_agent_eligible_when_busy(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "b": refuses("b", "busy", then=honest("b")),
                           "c": refuses("c", "no_such_reason")})
    rows = coordinator(fleet, tmp_path, rounds=2, round_timeout_s=60).run()
    assert max(r.seconds for r in rows) < 20  # not the 60 s timeout
    assert rows[0].refused == {"busy": 1, "error": 1} and rows[0].participants == ["a"] and rows[0].dropped == []
    assert rows[1].refused == {"error": 1} and rows[1].participants == ["a", "b"]  # busy stays eligible
    assert rows[0].rejected == {} and fleet.told == []  # a refusal is an answer, not a rejection


def test_agents_whose_capabilities_exclude_the_run_and_busy_agents_get_no_task(tmp_path, caplog):
    agents = {a: honest(a) for a in ("a", "b", "cnn_only", "no_fedavg", "busy", "small_frames")}
    fleet = ScriptedFleet(agents)
    fleet.events = deque([
        status("a", capabilities=Capabilities(methods=["fedavg", "fedrep"], archs=["mlp", "cnn"])),
        status("cnn_only", capabilities=Capabilities(archs=["cnn"])),
        # 1.4: it takes no frame as large as this run's tasks (an MLP's, a few kB)
        status("small_frames", capabilities=Capabilities(max_payload_bytes=16_384)),
        status("no_fedavg", capabilities=Capabilities(methods=["fedrep"])),
        status("busy", state="busy"),
        status("b"),  # 1.1-like: nothing declared, so anything
    ])
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        coord = coordinator(fleet, tmp_path, min_agents=2, rounds=2)
        rows = coord.run()
    for row in rows[:-1]:
        assert row.sampled == ["a", "b"] and row.participants == ["a", "b"]
    assert rows[-1].evaluated == 2  # nor evaluate tasks
    assert "cnn_only gets no task" in caplog.text and "arch mlp" in caplog.text
    assert "no_fedavg gets no task" in caplog.text and "method fedavg" in caplog.text
    assert caplog.text.count("cnn_only gets no task") == 1
    assert "small_frames gets no task" in caplog.text and "above the 16384 it accepts" in caplog.text
    assert coord.registry.online("trainer") == ["a", "b", "busy", "cnn_only", "no_fedavg", "small_frames"]


def test_min_agents_counts_capable_trainers_only(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "x": honest("x")})
    fleet.events = deque([status("a"), status("x", capabilities=Capabilities(methods=["fedrep"]))])
    with pytest.raises(TimeoutError, match="only 1 of min_agents=2 capable"):
        coordinator(fleet, tmp_path, min_agents=2, wait_for_agents_s=1).run()


def test_a_status_of_another_major_version_is_not_registered_and_is_told_why(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "future": honest("future")})
    fleet.events = deque([status("a"), status("future", version="2.0")])
    coord = coordinator(fleet, tmp_path, min_agents=1)
    rows = coord.run()
    assert not coord.registry.known("future") and rows[0].sampled == ["a"]
    assert coord.counters.rejected == {"unsupported_version": 1}
    assert [(a, m.meta.reason, m.meta.rejected_type) for a, m in fleet.told] == [
        ("future", "unsupported_version", "status")]


def test_statuses_keep_the_registry_and_tell_the_fleet_who_came_online(tmp_path):
    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b")})
    fleet.events += [status("pi", tier="head"), status("pi", tier="head"), status("pi", state="offline", tier="head"),
                     status("pi", tier="head"), status("x", num_train=2**60),
                     AgentFrame("y", AgentChannel.STATUS, status("z").frame, 10)]
    coord = coordinator(fleet, tmp_path)
    coord.run()
    # re-announcing while online is not "coming online"; coming back after offline is
    assert fleet.online_calls == [("a", "trainer"), ("b", "trainer"), ("pi", "head"), ("pi", "head")]
    assert coord.registry.online("head") == ["pi"] and not coord.registry.known("x")
    assert coord.counters.rejected == {"malformed": 1, "wrong_sender": 1}


class HeadFleet(ScriptedFleet):
    """Two head agents that report as soon as a release is published; ``refusing`` ones
    report that they did not install it (protocol 1.5)."""

    def __init__(self, agents: dict[str, Responder], refusing: tuple[str, ...] = (),
                 values: dict[str, dict[str, float]] | None = None):
        super().__init__(agents)
        self.events += [status("pi-1", tier="head"), status("pi-2", tier="head")]
        self.published: list[int] = []
        self.refusing = refusing
        self.values = values or {}
        self.releases = HeadsReport(self)


class HeadsReport(ReleaseChannel):
    """The release channel of :class:`HeadFleet`: its two head agents report on each release."""

    def __init__(self, fleet: HeadFleet):
        self.fleet = fleet

    def publish(self, frame: bytes, round: int, earlier_parts: int = 0, ref=None, delta=None, restore=None,
                have=()) -> int:
        self.fleet.published.append(round)
        release_id = decode(frame).meta.release_id
        for agent_id, correct in (("pi-1", 7), ("pi-2", 9)):
            meta = MetricsMeta(tier="head", release_id=release_id, head="lr", num_test=10, eval_correct=correct,
                               values=self.fleet.values.get(agent_id, {}))
            if agent_id in self.fleet.refusing:
                meta = MetricsMeta(tier="head", release_id=release_id, head="lr",
                                   refused=f"release {release_id} refused: input shape mismatch")
            report = encode(MessageType.METRICS, federation=FED, sender=agent_id, round=round, meta=meta)
            self.fleet.events.append(AgentFrame(agent_id, AgentChannel.METRICS, report, len(report)))
        return len(frame)


def test_head_reports_are_collected_until_every_online_head_reported(tmp_path):
    fleet = HeadFleet({"a": honest("a"), "b": honest("b")})
    coord = coordinator(fleet, tmp_path, round_timeout_s=20, release_at_end=True)
    started = time.monotonic()
    coord.run()
    assert time.monotonic() - started < 20  # the reports end the wait, not the timeout
    assert fleet.published == [0]
    assert {a: r.accuracy for a, r in coord.head_reports.items()} == {"pi-1": 0.7, "pi-2": 0.9}
    (release_id, entry), = read_head_metrics(tmp_path / "run").items()  # keyed by release
    assert release_id in coord.releases and entry.round == 0 and entry.accuracy() == pytest.approx(0.8)


def test_a_release_a_head_agent_refused_shows_in_the_report_the_view_and_the_log_and_ends_the_wait(tmp_path, caplog):
    """A head agent that cannot install a release tells the coordinator why. The
    refusal answers the wait for reports (no timeout), is kept as that agent's report on the
    release (no counts, out of the accuracy), is logged, and shows in the fleet view."""
    fleet = HeadFleet({"a": honest("a"), "b": honest("b")}, refusing=("pi-2",))
    coord = coordinator(fleet, tmp_path, round_timeout_s=20, release_at_end=True)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        coord.run()
    assert time.monotonic() - started < 20
    (release_id, entry), = read_head_metrics(tmp_path / "run").items()
    refused = entry.reports["pi-2"]
    assert refused.refused == f"release {release_id} refused: input shape mismatch" and refused.accuracy is None
    assert entry.accuracy() == pytest.approx(0.7)  # pi-1's alone
    assert f"head agent pi-2 did not install release {release_id}: release {release_id} refused" in caplog.text
    view = {a.id: a for a in coord.observer.view().agents}
    assert view["pi-2"].release_refused == f"{release_id}: release {release_id} refused: input shape mismatch"
    assert view["pi-1"].release_refused is None
    table, summary = write_report(tmp_path / "run", "fedavg")  # what simulate and `edgepfl report` print
    assert summary["head_tier"]["agents"]["pi-2"]["refused"] and f"pi-2 did not install release {release_id}" in table


def test_a_report_whose_values_could_carry_a_fitted_head_keeps_its_counts_and_loses_its_values(tmp_path, caplog):
    """PROTOCOL.md §5 (1.15): `values` are at most 32 figures named in at most 64 characters. A
    report past that (here 330 numbers: a small linear head's weights) counts in the release's
    accuracy, but none of its values are kept in head_metrics.json; it is logged."""
    leaked = {f"head.w{i}": 0.01 * i for i in range(330)}
    fleet = HeadFleet({"a": honest("a"), "b": honest("b")},
                      values={"pi-1": {"fit_seconds": 0.5, "train_accuracy": 0.9}, "pi-2": leaked})
    coord = coordinator(fleet, tmp_path, round_timeout_s=20, release_at_end=True)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        coord.run()
    (_, entry), = read_head_metrics(tmp_path / "run").items()
    assert entry.reports["pi-1"].values == {"fit_seconds": 0.5, "train_accuracy": 0.9}
    assert entry.reports["pi-2"].values == {} and entry.reports["pi-2"].accuracy == pytest.approx(0.9)
    assert entry.accuracy() == pytest.approx(0.8)
    assert "the metrics of pi-2 carry 330 values, more than 32: its counts are kept, its values are not" in caplog.text
    long_name = {"x" * 65: 1.0}
    assert unbounded_values(long_name) and unbounded_values({f"v{i}": 0.0 for i in range(32)}) is None


def test_a_round_of_1000_agents_costs_time_proportional_to_its_messages(tmp_path, monkeypatch):
    """At 1,000 agents the old loop rebuilt and sorted the online list once per waiting agent
    per message (40-73 s per round); the registry is now asked for a sorted list once per round."""
    n = 1000
    fleet = ScriptedFleet({f"agent-{i:04d}": honest(f"agent-{i:04d}") for i in range(n)})
    calls = {"online": 0}
    original = Registry.online

    def counting(self, tier=None):
        calls["online"] += 1
        return original(self, tier)

    monkeypatch.setattr(Registry, "online", counting)
    started = time.monotonic()
    rows = coordinator(fleet, tmp_path).run()
    seconds = time.monotonic() - started
    assert len(rows[0].participants) == n and rows[-1].evaluated == n
    assert calls["online"] <= 4  # once per round (sampling), not per message
    assert seconds < 60, seconds  # 4,000 frames encoded and decoded; the old loop took minutes


def test_rejection_totals_survive_a_restart(tmp_path):
    def mallory(task: Message) -> list[bytes]:
        junk = [b"junk"] if task.meta.kind == "train" else []
        return [*junk, *honest("m")(task)]

    def checkpointed() -> dict:
        return json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())

    coordinator(ScriptedFleet({"a": honest("a"), "m": mallory}), tmp_path, rounds=1).run()
    assert checkpointed()["round"] == 0 and checkpointed()["rejected_total"] == {"malformed": 1}
    resumed = coordinator(ScriptedFleet({"a": honest("a"), "m": mallory}), tmp_path, rounds=2)
    rows = resumed.run()
    assert [r.round for r in rows] == [1, 2] and rows[0].rejected == {"malformed": 1}
    assert checkpointed()["round"] == 1 and checkpointed()["rejected_total"] == {"malformed": 2}


# --------------------------------------------------------------------------- aggregation in the round


def shifted(agent_id: str, by: float | Callable[[int], float], num_train: int = 10) -> Responder:
    """A trainer whose update moves every float tensor it got by ``by`` (or ``by(round)``)."""
    def answer(task: Message) -> list[bytes]:
        if task.meta.kind != "train":
            return honest(agent_id, num_train)(task)
        delta = by(task.header.round) if callable(by) else by
        tensors = {k: (v + delta).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in task.tensors.items()}
        meta = UpdateMeta(task_id=task.meta.task_id, kind="train", num_train=num_train, num_test=5, eval_correct=2)
        return [encode(MessageType.UPDATE, federation=FED, sender=agent_id, round=task.header.round, meta=meta,
                       tensors=tensors)]
    return answer


def scaled(agent_id: str, factor: float) -> Responder:
    """A trainer that answers with the tensors it got times ``factor``."""
    def answer(task: Message) -> list[bytes]:
        if task.meta.kind != "train":
            return honest(agent_id)(task)
        tensors = {k: (v * factor).astype(v.dtype) for k, v in task.tensors.items()}
        meta = UpdateMeta(task_id=task.meta.task_id, kind="train", num_train=10, num_test=5, eval_correct=2)
        return [encode(MessageType.UPDATE, federation=FED, sender=agent_id, round=task.header.round, meta=meta,
                       tensors=tensors)]
    return answer


def global_tensors(coord: Coordinator) -> dict:
    assert coord.state is not None
    return {k: v.copy() for k, v in coord.state.global_tensors.items()}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_an_update_scaled_a_millionfold_is_rejected_out_of_range_and_the_round_completes(tmp_path, caplog):
    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"), "m": scaled("m", 1e6)})
    coord = coordinator(fleet, tmp_path)
    coord.init_or_resume()
    before = global_tensors(coord)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coord.run()
    assert time.monotonic() - started < 10  # m's answer counts as an answer: no wait for the timeout
    assert rows[0].rejected == {"out_of_range": 1} and coord.counters.rejected == {"out_of_range": 1}
    assert rows[0].participants == ["a", "b"] and rows[0].dropped == [] and not rows[0].aborted
    assert rows[0].evaluated == 2  # nothing of a refused update counts, its evaluation neither
    assert same_tensors(global_tensors(coord), before)  # the mean of a's and b's echo
    assert "rejected message from m: out_of_range" in caplog.text


def test_an_aggregate_that_moves_too_far_is_not_adopted_and_a_robust_rule_outvotes_the_attacker(tmp_path, caplog):
    # +50 on every coordinate is within the rule's range (64 x max(1, |w|)): without the
    # update bound only the closed mean shows it, moving the model by ~17 per coordinate
    agents = {"a": shifted("a", 0.001), "b": shifted("b", 0.001), "m": shifted("m", 50.0)}
    unbounded = {"max_update_ratio": None, "max_update_vs_median": None}
    coord = coordinator(ScriptedFleet(agents), tmp_path / "mean", aggregation=unbounded)
    coord.init_or_resume()
    before = global_tensors(coord)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coord.run()
    assert rows[0].aborted and rows[0].abort_reason == "diverged" and rows[0].rolled_back_to is None
    assert rows[0].participants == ["a", "b", "m"]  # all three went into the refused aggregate
    assert same_tensors(global_tensors(coord), before)
    assert "round 0: aggregate not adopted: diverged" in caplog.text

    robust = coordinator(ScriptedFleet(agents), tmp_path / "median",
                         aggregation={"rule": "median", **unbounded})
    rows = robust.run()
    assert not rows[0].aborted and rows[0].abort_reason is None
    after = global_tensors(robust)
    for key, value in before.items():  # the median of (+0.001, +0.001, +50) is +0.001
        np.testing.assert_allclose(after[key], value + 0.001, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", ["mean", "median"])
def test_the_update_bound_refuses_or_clips_one_update_whatever_the_rule(tmp_path, caplog, rule):
    """The +50 attacker of the test above, under the default bound (10 x the model's norm):
    refused as out_of_range and the round adopted from a's and b's updates; with
    on_large_update: clip its change is scaled onto the bound, it is counted as clipped
    in the metrics row, and the round is adopted with the model moved at most by the
    bound times m's share."""
    agents = {"a": shifted("a", 0.001), "b": shifted("b", 0.001), "m": shifted("m", 50.0)}
    coord = coordinator(ScriptedFleet(agents), tmp_path / "reject", aggregation={"rule": rule})
    coord.init_or_resume()
    before = global_tensors(coord)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coord.run()
    assert rows[0].rejected == {"out_of_range": 1} and rows[0].participants == ["a", "b"] and not rows[0].aborted
    assert "rejected message from m: out_of_range (out_of_range: the update changes the learned parameters by a norm" \
        in caplog.text
    for key, value in before.items():
        np.testing.assert_allclose(coord.state.global_tensors[key], value + 0.001, rtol=0, atol=1e-6)

    clip = coordinator(ScriptedFleet(agents), tmp_path / "clip", aggregation={"rule": rule, "on_large_update": "clip"})
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = clip.run()
    assert rows[0].rejected == {} and rows[0].participants == ["a", "b", "m"] and rows[0].clipped == ["m"]
    # the log line and the row name the bound that fired: in a first round the tighter one
    # relative to the model (1 x its norm, max_first_update_ratio)
    assert not rows[0].aborted and "the update from m went past aggregation.max_first_update_ratio" in caplog.text
    assert read_metrics(tmp_path / "clip" / "run")[0].clipped == ["m"]
    assert read_metrics(tmp_path / "clip" / "run")[0].clipped_by["m"][0] == "max_first_update_ratio"
    learned = [k for k, v in before.items() if v.dtype.kind == "f" and "running_" not in k]
    norm = np.sqrt(sum(float(np.sum(before[k].astype(np.float64) ** 2)) for k in learned))
    moved = np.sqrt(sum(float(np.sum((clip.state.global_tensors[k].astype(np.float64) - before[k]) ** 2))
                        for k in learned))
    honest_share = 0.001 * np.sqrt(sum(before[k].size for k in learned))
    # the learned parameters: m's change scaled onto 10 x their norm, a third of the mean (median: the middle value)
    assert 0 < moved <= 10 * max(1.0, norm) / 3 + honest_share
    for mean_key in [k for k in before if k.endswith("running_mean")]:
        # each running mean: m's +50 clamped to 20 reference deviations per channel, a third of the mean
        var = before[mean_key.replace("running_mean", "running_var")].astype(np.float64)
        shift = clip.state.global_tensors[mean_key].astype(np.float64) - before[mean_key]
        assert (0 < shift).all() and (shift <= 20 * np.sqrt(var + np.median(var)) / 3 + 0.001 + 1e-6).all()


def test_a_change_far_past_the_fleets_is_clipped_to_five_medians_of_the_round_before_and_resume_keeps_the_record(
        tmp_path):
    """Round 0: three trainers each move every parameter by 0.01. Round 1: m moves them by
    0.2, twenty times the others and far inside the bound relative to the model. The default
    max_update_vs_median (5) clips m's change onto 5 x the median change of round 0, so each
    parameter moves by (0.01 + 0.01 + 0.05) / 3. The median is the state's record: a
    coordinator restarted after round 0 clips the same."""
    def fleet() -> ScriptedFleet:
        return ScriptedFleet({"a": shifted("a", 0.01), "b": shifted("b", 0.01),
                              "m": shifted("m", lambda r: 0.2 if r == 1 else 0.01)})

    coord = coordinator(fleet(), tmp_path / "once", rounds=2)
    coord.init_or_resume()
    before = global_tensors(coord)
    learned = [k for k, v in before.items() if v.dtype.kind == "f"]
    step = 0.01 * np.sqrt(sum(before[k].size for k in learned))  # one honest change's norm
    rows = coord.run()
    assert [r.rejected for r in rows[:2]] == [{}, {}] and [r.clipped for r in rows[:2]] == [[], ["m"]]
    for key in learned:
        np.testing.assert_allclose(coord.state.global_tensors[key], before[key] + 0.01 + 0.07 / 3, rtol=0, atol=1e-5)
    meta = json.loads((tmp_path / "once" / "run" / "checkpoint" / "state.json").read_text())
    # round 1's record: the median of a's, b's and m's clipped change, the honest one
    assert meta["server_extra"][UPDATE_NORM_MEDIAN] == pytest.approx(step, rel=1e-4)

    coordinator(fleet(), tmp_path / "twice", rounds=1).run()
    resumed = coordinator(fleet(), tmp_path / "twice", rounds=2)
    rows = resumed.run()
    assert [r.clipped for r in rows if not r.final][-1] == ["m"]
    assert same_tensors(global_tensors(resumed), global_tensors(coord))


def test_a_device_clipped_round_after_round_does_not_widen_its_own_bound(tmp_path):
    """m sends the same huge change (1.0 per parameter, a hundred times a's and b's) in every
    round. Its first update is clipped (relative to the model) and recorded as the round's
    median, and each later one is clipped onto 5 medians and recorded no higher than its
    record before: the shared state moves by (0.01 + 0.01 + 0.05) / 3 in every round after
    the first. A clipped update that raised its sender's record widened the bound 5 times
    every two rounds (noise announcing 2^24 samples took FedAvg on digits to 7.6 %)."""
    def fleet() -> ScriptedFleet:
        return ScriptedFleet({"a": shifted("a", 0.01), "b": shifted("b", 0.01), "m": shifted("m", 1.0)})

    first = coordinator(fleet(), tmp_path, rounds=1)
    first.run()
    after_first = global_tensors(first)
    coord = coordinator(fleet(), tmp_path, rounds=6)  # resumed: five more rounds
    rows = coord.run()
    assert [r.clipped for r in rows if not r.final] == [["m"]] * 5
    learned = [k for k, v in after_first.items() if v.dtype.kind == "f"]
    step = 0.01 * np.sqrt(sum(after_first[k].size for k in learned))  # one honest change's norm
    meta = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert all(change <= step * 1.0001 for change, *_ in meta["server_extra"][UPDATE_HISTORY]["m"])
    for key in learned:
        np.testing.assert_allclose(global_tensors(coord)[key], after_first[key] + 5 * (0.01 + 0.01 + 0.05) / 3,
                                   rtol=0, atol=1e-5)


def test_a_device_far_from_the_fleet_round_after_round_is_judged_against_its_own_record_and_never_clipped(
        tmp_path):
    """Different is not hostile: m moves every parameter by 0.075 in every round, fifteen
    times a's and b's 0.005, as the device whose data is least like the others' does. A bound
    relative to the fleet alone (5 medians) clipped it in every round after the first;
    judged against its own record as well (its round-0 change, recorded at most 5 of that
    round's medians, then its own changes) it is clipped in none, and the state is the
    plain mean of the three. The record is the state's: a coordinator restarted after
    round 1 judges the same, and turning the record off (a bound relative to the fleet
    alone) clips m again, so this test can fail."""
    def fleet() -> ScriptedFleet:
        return ScriptedFleet({"a": shifted("a", 0.005), "b": shifted("b", 0.005), "m": shifted("m", 0.075)})

    coord = coordinator(fleet(), tmp_path / "own", rounds=4)
    coord.init_or_resume()
    before = global_tensors(coord)
    learned = [k for k, v in before.items() if v.dtype.kind == "f"]
    norm = np.sqrt(sum(float(np.sum(before[k].astype(np.float64) ** 2)) for k in learned))
    assert 0.075 * np.sqrt(sum(before[k].size for k in learned)) < max(1.0, norm)  # inside the first round's bound
    rows = coord.run()
    assert [r.clipped for r in rows if not r.final] == [[]] * 4 and all(r.rejected == {} for r in rows)
    for key in learned:
        np.testing.assert_allclose(coord.state.global_tensors[key], before[key] + 4 * 0.085 / 3, rtol=0, atol=1e-5)
    meta = json.loads((tmp_path / "own" / "run" / "checkpoint" / "state.json").read_text())
    assert sorted(meta["server_extra"][UPDATE_HISTORY]) == ["a", "b", "m"]
    assert len(meta["server_extra"][UPDATE_HISTORY]["m"]) == 3  # its last three updates

    coordinator(fleet(), tmp_path / "twice", rounds=2).run()
    resumed = coordinator(fleet(), tmp_path / "twice", rounds=4)
    assert [r.clipped for r in resumed.run() if not r.final] == [[], []]
    assert same_tensors(global_tensors(resumed), global_tensors(coord))

    import edgepfl.methods.base as base
    original = base.RoundAggregate.own_record
    base.RoundAggregate.own_record = lambda self, agent_id: None  # type: ignore[method-assign]
    try:
        fleet_only = coordinator(fleet(), tmp_path / "fleet-only", rounds=4).run()
    finally:
        base.RoundAggregate.own_record = original  # type: ignore[method-assign]
    assert [r.clipped for r in fleet_only if not r.final] == [[], ["m"], ["m"], ["m"]]


def test_a_non_finite_aggregate_is_not_adopted(tmp_path, caplog):
    coord = coordinator(ScriptedFleet({"a": honest("a"), "b": honest("b")}), tmp_path)
    coord.init_or_resume()
    before = global_tensors(coord)
    finish = coord.method.finish_round

    def overflowing(state, shared, updates, round):  # a server step with a numerical bug
        new = finish(state, shared, updates, round)
        key = next(iter(new.global_tensors))
        new.global_tensors[key] = np.full_like(new.global_tensors[key], np.inf)
        return new

    coord.method.finish_round = overflowing  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coord.run()
    assert rows[0].aborted and rows[0].abort_reason == "non_finite"
    assert same_tensors(global_tensors(coord), before)
    assert "aggregate not adopted: non_finite" in caplog.text


#: rollback after 2 aborted rounds, and no bound on one update's norm, so that an attacker's aggregate diverges
UNBOUNDED_ROLLBACK = {"rollback_after": 2, "max_update_ratio": None, "max_update_vs_median": None}


def test_rounds_that_keep_failing_roll_back_to_the_last_good_state_and_resume_keeps_it(tmp_path, caplog):
    """Round 0 is adopted (from the initial state S0); rounds 1 and 2 fail from its result
    S1; with rollback_after=2 the state goes back to S0, the last state a round was adopted
    from, and round 3 trains from S0. A coordinator restarted after round 1 does the same."""
    def poison(r: int) -> float:
        return 50.0 if r in (1, 2) else 0.01

    def fleet() -> ScriptedFleet:
        return ScriptedFleet({"a": shifted("a", 0.01), "b": shifted("b", 0.01), "m": shifted("m", poison)})

    def run(out, rounds: int) -> tuple[Coordinator, list]:
        coord = coordinator(fleet(), out, rounds=rounds, aggregation=UNBOUNDED_ROLLBACK)
        return coord, coord.run()

    sent: dict[int, dict] = {}
    coord = coordinator(fleet(), tmp_path / "once", rounds=4,
                        aggregation=UNBOUNDED_ROLLBACK)
    coord.fleet.on_send = lambda agent, task: sent.setdefault(task.header.round, dict(task.tensors))  # type: ignore[attr-defined]
    coord.init_or_resume()
    s0 = global_tensors(coord)
    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coord.run()
    assert [r.abort_reason for r in rows[:4]] == [None, "diverged", "diverged", None]
    assert [r.rolled_back_to for r in rows[:4]] == [None, None, -1, None]
    s1 = sent[1]
    assert not same_tensors(s1, s0) and same_tensors(sent[2], s1)  # round 2 still trains from S1
    assert same_tensors(sent[3], s0)  # round 3 from the rolled-back S0
    for key, value in s0.items():
        np.testing.assert_allclose(coord.state.global_tensors[key], value + 0.01, rtol=0, atol=1e-6)
    assert "2 rounds in a row aborted (last: diverged); rolled back to the last good state, the global state " \
           "after round -1" in caplog.text
    checkpoint = tmp_path / "once" / "run" / "checkpoint"
    assert sorted(p.name for p in checkpoint.glob("good-*")) == ["good-2"]  # S0 again proved good in round 3

    # a coordinator killed after round 1 resumes with the failure count and the good state
    run(tmp_path / "twice", rounds=2)
    meta = json.loads((tmp_path / "twice" / "run" / "checkpoint" / "state.json").read_text())
    assert meta["aborted_streak"] == 1 and meta["good_round"] == -1
    resumed, rows2 = run(tmp_path / "twice", rounds=4)
    assert [r.rolled_back_to for r in rows2[:2]] == [-1, None]
    assert same_tensors(global_tensors(resumed), global_tensors(coord))


def replacing(agent_id: str, step: float, attack_rounds: range) -> Responder:
    """Model replacement (Bagdasaryan et al.): in ``attack_rounds`` the device drags every
    parameter by ``step`` towards its own target and announces 2^24 samples, so that an
    uncapped mean takes its state whole; later it answers 10^6 x the task, which every
    rule refuses."""
    def answer(task: Message) -> list[bytes]:
        if task.meta.kind != "train":
            return honest(agent_id)(task)
        r = task.header.round
        tensors = {k: ((v + step) if r in attack_rounds else v * 1e6).astype(v.dtype) if v.dtype.kind == "f" else v
                   for k, v in task.tensors.items()}
        meta = UpdateMeta(task_id=task.meta.task_id, kind="train", num_train=2**24, num_test=5, eval_correct=2)
        return [encode(MessageType.UPDATE, federation=FED, sender=agent_id, round=r, meta=meta, tensors=tensors)]
    return answer


def test_a_rollback_restores_a_state_one_inflated_device_moved_by_at_most_its_clipped_share(tmp_path):
    """The red team's row: a device announcing 2^24 samples shaped the adopted states, and a
    rollback then restored one of them. Rounds 0-2: a, b and c move every parameter by 0.01,
    m drags it by 0.3 announcing 2^24. Rounds 3-4: every update is 10^6 x its task (each
    refused), the rounds abort, and with rollback_after=2 the state goes back to the last
    good one (the state round 2 was adopted from). With the defaults m weighs one device
    (max_weight_ratio 1) and its change is clipped (round 0: to 1 x the parameters' norm;
    then to 5 x its own record, itself at most 5 medians of its round: 25 medians, short of
    its 30), so the restored state is within those shares of the honest path; with both
    bounds off, m's 0.3 per round is the state."""
    def fleet(attack: float) -> ScriptedFleet:
        def broken(agent_id: str) -> Responder:
            return lambda task: (shifted(agent_id, 0.01) if task.header.round < 3 else scaled(agent_id, 1e6))(task)
        scripted = ScriptedFleet({"a": broken("a"), "b": broken("b"), "c": broken("c"),
                                  "m": replacing("m", attack, range(3))})
        scripted.events = deque(status(a, num_train=2**24 if a == "m" else 10) for a in scripted.agents)
        return scripted

    def run(out, aggregation: dict) -> tuple[Coordinator, list, dict]:
        coord = coordinator(fleet(0.3), out, rounds=5, aggregation={"rollback_after": 2, **aggregation})
        coord.init_or_resume()
        s0 = global_tensors(coord)
        return coord, coord.run(), s0

    coord, rows, s0 = run(tmp_path / "defaults", {})
    assert [r.abort_reason is not None for r in rows[:5]] == [False, False, False, True, True]
    assert rows[4].rolled_back_to == 1 and [r.clipped for r in rows[:3]] == [["m"], ["m"], ["m"]]
    assert [r.clipped_by for r in rows[:3]] == [{"m": ["max_first_update_ratio"]}] + [{"m": ["max_update_vs_median"]}] * 2
    learned = [k for k, v in s0.items() if v.dtype.kind == "f"]
    size = sum(s0[k].size for k in learned)
    norm = np.sqrt(sum(float(np.sum(s0[k].astype(np.float64) ** 2)) for k in learned))
    honest_step = 0.01 * np.sqrt(size)  # one honest change's norm, the median of every round

    def off_the_honest_path(state: dict, rounds: int) -> float:  # norm of state - (s0 + 0.01 per round)
        return float(np.sqrt(sum(float(np.sum((state[k].astype(np.float64) - s0[k] - 0.01 * rounds) ** 2))
                                 for k in learned)))

    # the restored state is the one after round 1: m's share of round 0 (clipped to the norm) and round 1
    restored = global_tensors(coord)  # round 4 aborted too: the state is the restored one
    bound = (max(1.0, norm) + 25 * honest_step) / 4
    assert 0 < off_the_honest_path(restored, 2) <= bound * (1 + 1e-4)

    unbounded, rows, _ = run(tmp_path / "unbounded", {"max_weight_ratio": None, "max_update_vs_median": None})
    assert rows[4].rolled_back_to == 1
    taken = global_tensors(unbounded)
    for key in learned:  # m's count took both rounds: 0.3 each, the honest 0.01s weigh 30 / 2^24
        np.testing.assert_allclose(taken[key], s0[key] + 0.6, rtol=0, atol=1e-4)


def reachable_arrays(root: object) -> dict[int, int]:
    """Every numpy buffer reachable from ``root`` through attributes and containers: base id -> bytes."""
    seen: set[int] = set()
    found: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            found[id(base)] = base.nbytes
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


@pytest.mark.parametrize("rule", ["mean", "clipped_mean", "median"])
def test_a_streaming_rule_keeps_no_update_in_the_open_round(tmp_path, rule):
    """Structural: what the open round holds while 20 updates come in. With a streaming rule
    it is the round's reference and its sums, whatever the number of updates; a buffered
    rule (median) holds every update, which is what this check would see."""
    n = 20
    peak = {"bytes": 0, "added": 0}

    class Probe(ScriptedFleet):
        coord: Coordinator | None = None

        def poll(self, timeout: float):
            sink = self.coord.inbox._sink if self.coord else None
            if isinstance(sink, RoundResult) and sink.aggregate is not None:
                peak["bytes"] = max(peak["bytes"], sum(reachable_arrays(sink).values()))
                peak["added"] = max(peak["added"], sink.aggregate.count)
            return super().poll(timeout)

    fleet = Probe({f"agent-{i:02d}": shifted(f"agent-{i:02d}", 0.001 * i) for i in range(n)})
    coord = fleet.coord = coordinator(fleet, tmp_path, aggregation={"rule": rule})
    coord.init_or_resume()
    model = sum(v.nbytes for v in coord.state.shared_params().values())
    coord.run()
    assert peak["added"] == n - 1  # measured with all but the last update in
    if RunConfig(aggregation={"rule": rule}).aggregation.build().streaming:
        # the state (1x) and two int64 words per float32 coordinate (4x); per update 1x more
        assert peak["bytes"] <= 6 * model, (peak, model)
    else:
        assert peak["bytes"] >= (n - 1) * model, (peak, model)


def test_an_answer_that_comes_after_its_round_closed_is_stale(tmp_path):
    """c goes offline with its round-0 task (the round closes on quorum without it), and
    its round-0 answer arrives while the coordinator waits for it before round 1: too late
    for a round whose aggregate is already closed."""
    late: list[bytes] = []

    def c(task: Message) -> list[bytes]:
        if task.header.round == 0 and task.meta.kind == "train":
            late.extend(honest("c")(task))
            fleet.events.append(status("c", state="offline"))
            return []
        return honest("c")(task)

    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"), "c": c})
    coord = coordinator(fleet, tmp_path, rounds=2, quorum=0.5)
    original = coord.collect

    def collect_then_c_answers_late(tasks, result, started):
        original(tasks, result, started)
        if result.round == 0:
            fleet.events.extend(AgentFrame("c", AgentChannel.UPDATE, f, len(f)) for f in late)
            fleet.events.append(status("c"))

    coord.collect = collect_then_c_answers_late  # type: ignore[method-assign]
    rows = coord.run()
    assert rows[0].participants == ["a", "b"] and rows[0].dropped == ["c"] and not rows[0].aborted
    assert coord.counters.rejected == {"stale": 1}
    assert rows[1].participants == ["a", "b", "c"]


def _count_encodings(monkeypatch) -> list[int]:
    """How many bodies the round loop's task writer encodes (a spy on the real encode_body)."""
    from edgepfl.coordinator import tasks

    calls: list[int] = []
    real = tasks.encode_body
    monkeypatch.setattr(tasks, "encode_body", lambda tensors: calls.append(len(tensors)) or real(tensors))
    return calls


def test_a_payload_every_agent_shares_is_encoded_once_per_round(tmp_path, monkeypatch):
    fleet = ScriptedFleet({a: honest(a) for a in ("a", "b", "c")})
    calls = _count_encodings(monkeypatch)
    coordinator(fleet, tmp_path, rounds=2).run()
    assert len(calls) == 3  # rounds 0 and 1 and the final evaluation: one body each, not one per agent


def test_a_personal_payload_gets_its_own_body(tmp_path, monkeypatch):
    fleet = ScriptedFleet({a: honest(a) for a in ("a", "b", "c")})
    calls = _count_encodings(monkeypatch)
    sent: dict[str, Message] = {}
    fleet.on_send = lambda agent_id, task: sent.setdefault(agent_id, task)  # round 0's task
    coord = coordinator(fleet, tmp_path)
    shared = coord.method.payload_for

    def personal(state, agent_id):  # like FedPAC's per-agent combined heads
        payload = shared(state, agent_id)
        first = sorted(payload)[0]
        return {**payload, first: payload[first] + np.float32(1e-3 * "abc".index(agent_id))}

    coord.method.payload_for = personal  # type: ignore[method-assign]
    coord.run()
    assert len(calls) == 6  # round 0 and the final evaluation, three agents each
    first = sorted(sent["a"].tensors)[0]
    assert not np.array_equal(sent["a"].tensors[first], sent["c"].tensors[first])
    np.testing.assert_allclose(sent["c"].tensors[first] - sent["a"].tensors[first], 2e-3, atol=1e-6)


def test_an_agent_whose_answer_was_lost_sits_out_one_round_and_trains_again_without_a_word(tmp_path):
    """Its round-0 update is lost (a chunk dropped on the way) and it sends nothing else, as an
    agent waiting for its next task does: it sits out round 1 and is asked again in round 2
    (it used to wait for a sign of life that an idle agent never sends: out for the run)."""
    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"),
                           "c": lambda task: [] if task.header.round == 0 else honest("c")(task)})
    sent_to: dict[int, list[str]] = {}
    fleet.on_send = lambda agent_id, task: sent_to.setdefault(task.header.round, []).append(agent_id)
    rows = coordinator(fleet, tmp_path, rounds=4, round_timeout_s=1.5).run()
    assert rows[0].dropped == ["c"] and rows[0].participants == ["a", "b"]
    assert sorted(sent_to[1]) == ["a", "b"] and rows[1].dropped == []  # not waited for again at once
    assert sorted(sent_to[2]) == ["a", "b", "c"] and rows[2].participants == ["a", "b", "c"]
    assert rows[3].participants == ["a", "b", "c"]


class LossyFleet(ScriptedFleet):
    """A fleet whose tasks can be lost on the way, as over a broker that restarts."""

    loses_tasks = True


def reconnecting(agent_id: str, fleet: ScriptedFleet, session: str) -> Responder:
    """An agent whose first task is lost with its connection: it re-announces itself on the
    same connection (as for a roll call), then reconnects (a birth on connection 2), and
    answers whatever task it gets after that."""
    calls = []

    def answer(task: Message) -> list[bytes]:
        calls.append(task)
        if len(calls) > 1:
            return honest(agent_id)(task)
        fleet.events.append(status(agent_id, session=session, connection=1))
        fleet.events.append(status(agent_id, session=session, connection=2))
        return []
    return answer


@pytest.mark.parametrize("loses_tasks", [True, False], ids=["lossy-fleet", "fleet-that-loses-nothing"])
def test_a_task_lost_with_a_connection_goes_again_once_on_the_agents_next_connection(tmp_path, loses_tasks):
    """PROTOCOL.md §10: c's round-0 task is lost; its birth on the same connection brings
    nothing, its birth on connection 2 brings the same task (id, seed, payload) once, and
    the round closes with c's answer. A fleet that cannot lose a task sends no copy."""
    fleet = (LossyFleet if loses_tasks else ScriptedFleet)({"a": honest("a"), "b": honest("b")})
    fleet.agents["c"] = reconnecting("c", fleet, session="c" * 32)
    fleet.events = deque(status(a, session=a * 32, connection=1) for a in ("a", "b", "c"))
    sent: list[tuple[str, Message]] = []
    fleet.on_send = lambda agent_id, task: sent.append((agent_id, task))
    rows = coordinator(fleet, tmp_path, rounds=1, round_timeout_s=20 if loses_tasks else 1.5).run()
    to_c = [task for agent, task in sent if agent == "c" and task.header.round == 0]
    if not loses_tasks:
        assert len(to_c) == 1 and rows[0].dropped == ["c"]
        return
    assert len(to_c) == 2 and to_c[0].meta.task_id == to_c[1].meta.task_id
    assert to_c[0].meta.seed == to_c[1].meta.seed and to_c[0].header.message_id != to_c[1].header.message_id
    assert all(np.array_equal(to_c[0].tensors[k], to_c[1].tensors[k]) for k in to_c[0].tensors)
    assert sorted(rows[0].participants) == ["a", "b", "c"] and rows[0].dropped == [] and rows[0].rejected == {}


def test_statuses_with_ever_higher_connection_numbers_bring_at_most_max_copies_of_a_task(tmp_path):
    """On an unsigned deployment anyone can publish c's status: a flood of them with rising
    connection numbers while c's task is open makes the coordinator send that task at most
    MAX_TASK_COPIES times more, not once per status (each copy is the whole model)."""
    fleet = LossyFleet({"a": honest("a"), "b": honest("b")})
    sent: list[str] = []

    def flooded(task: Message) -> list[bytes]:
        sent.append(task.meta.task_id)
        if len(sent) == 1:
            fleet.events.extend(status("c", session="c" * 32, connection=n) for n in range(2, 40))
            return []
        return []  # c never answers: the round closes at its deadline with a and b
    fleet.agents["c"] = flooded
    fleet.events = deque(status(a, session=a * 32, connection=1) for a in ("a", "b", "c"))
    rows = coordinator(fleet, tmp_path, rounds=1, round_timeout_s=1.5).run()
    assert sent.count(sent[0]) == 1 + MAX_TASK_COPIES  # round 0's task (the final evaluation sends another)
    assert rows[0].dropped == ["c"]


def test_only_a_later_connection_of_the_same_session_means_a_task_may_be_lost():
    task = Task("c", "t1", "train", 10, session="s1", connection=2)
    assert task.lost_with_connection("s1", 3)
    assert not task.lost_with_connection("s1", 2)  # a roll call's answer, a re-announcement
    assert not task.lost_with_connection("s1", 1)  # an old birth
    assert not task.lost_with_connection("s2", 9)  # another process: it gets what a new one gets
    assert not task.lost_with_connection("s1", None)  # an agent before protocol 1.3
    assert not Task("c", "t1", "train").lost_with_connection("s1", 3)  # sent before any birth was heard
    # sent when its status had no number (made before it heard a 1.3 coordinator): it may have gone
    # out on the connection the first numbered status comes from (after a broker restart, every agent's)
    unnumbered = Task("c", "t1", "train", 10, session="s1")
    assert not unnumbered.lost_with_connection("s1", 2)


def test_a_present_agent_that_never_answers_costs_a_deadline_ever_more_rarely(tmp_path):
    """The red team's cheap denial of service: an enrolled device announces itself in every
    round and never answers. Its first miss is excused (a reconnect loses a task); then it
    sits out 1, 2, 4, ... rounds, so 12 rounds wait for it 5 times, not 12; and it is never
    shut out for good (an honest device that recovers is asked again)."""
    # on a virtual clock: a deadline is an event, not a race with how busy this machine is (on
    # the wall clock an honest answer could miss a 0.5 s deadline on a loaded CI machine)
    fleet = BrokerFleetOnAVirtualClock({"a": honest("a"), "b": honest("b"), "m": lambda task: []})
    sampled: dict[int, list[str]] = {}

    def on_send(agent_id: str, task: Message) -> None:
        sampled.setdefault(task.header.round, []).append(agent_id)
        if agent_id == "a":  # a second into the round, "still here"
            fleet.clock.advance_to(fleet.clock.now() + 1.0)
            fleet.events.append(status("m"))

    fleet.on_send = on_send
    rows = coordinator(fleet, tmp_path, rounds=12, round_timeout_s=30, quorum=0.5).run()
    training = [row for row in rows if not row.final]
    assert [row.round for row in training if "m" in row.dropped] == [0, 1, 3, 6, 11]
    assert all(row.participants == ["a", "b"] for row in training)
    assert [r for r in range(12) if "m" in sampled[r]] == [0, 1, 3, 6, 11]
    # the final evaluation asks it all the same: silent or slow, its accuracy is the fleet's too
    assert "m" in sampled[12] and rows[-1].final and rows[-1].dropped == ["m"]


@pytest.mark.parametrize("answer", ["refusal", "update_the_rule_refuses"])
def test_a_device_that_refuses_each_task_after_everyone_else_answered_costs_a_wait_ever_more_rarely(tmp_path, answer):
    """The red team's late refusal: an enrolled device answers each task with its own refusal
    just before the deadline (25 s of 30 after every other device answered), so the round
    waits for it and gets nothing. That is a miss: it sits out 1, 2, 4, ... rounds (a refusal
    used to reset the count), and the final evaluation, which it used to cost a wait too,
    skips it. The same for an update the round's rule refuses (a millionfold one, out_of_range)."""
    late = refuses("z", "busy") if answer == "refusal" else scaled("z", 1e6)
    fleet = OwnFleet({"a": honest("a"), "b": honest("b"), "z": late}, late_s={"z": 25.0})
    sampled: dict[int, list[str]] = {}
    fleet.on_send = lambda agent_id, task: sampled.setdefault(task.header.round, []).append(agent_id)
    coord = coordinator(fleet, tmp_path, rounds=12, round_timeout_s=30)
    rows = coord.run()
    assert [r for r in range(12) if "z" in sampled.get(r, [])] == [0, 2, 5, 10]
    # the rows say when it was asked
    assert [row.round for row in rows if row.refused or row.rejected] == [0, 2, 5, 10]
    final = rows[-1]
    assert final.final and "z" not in sampled[12] and final.refused == final.rejected == {} and final.evaluated == 2
    assert coord.registry.benched_until("z") == 18  # asked again in round 19


HONEST_REFUSERS = {
    # refuses at once while the others still train; the slow update of z comes last, 20 s on
    "at_once": (lambda: OwnFleet({"a": refuses("a", "busy"), "b": honest("b"), "z": honest("z")},
                                 late_s={"z": 20.0})),
    # a clock 20 minutes ahead refuses every task as expired the moment it arrives: last, but
    # 7 s after the others (a loaded device), inside a 30 s round's patience of 7.5 s
    "last_but_soon": (lambda: OwnFleet({"a": honest("a"), "b": honest("b"), "z": refuses("z", "expired")},
                                       late_s={"z": 7.0})),
}


@pytest.mark.parametrize("case", sorted(HONEST_REFUSERS))
def test_a_refusal_at_once_or_soon_after_the_others_and_a_slow_update_last_cost_nobody_a_round(tmp_path, case):
    """The honest side: a device that refuses at once, one whose refusal comes last but soon,
    and a slow device whose update comes last (the round waited, for an update) are asked
    every round, the final evaluation included."""
    fleet = HONEST_REFUSERS[case]()
    sampled: dict[int, list[str]] = {}
    fleet.on_send = lambda agent_id, task: sampled.setdefault(task.header.round, []).append(agent_id)
    coord = coordinator(fleet, tmp_path, rounds=4, round_timeout_s=30)
    rows = coord.run()
    assert all(sorted(sampled[r]) == ["a", "b", "z"] for r in range(5)), sampled
    assert all(sum(row.refused.values()) == 1 for row in rows) and rows[-1].evaluated == 2
    assert coord.registry.benched_until("a") is None and coord.registry.benched_until("z") is None


def test_an_agent_that_reconnected_during_the_round_keeps_getting_tasks(tmp_path):
    lost: set[int] = {0}  # c's round-0 task is lost with its old connection; it reconnects mid-round

    def reconnecting(task: Message) -> list[bytes]:
        return [] if task.header.round in lost else honest("c")(task)

    fleet = ScriptedFleet({"a": honest("a"), "b": honest("b"), "c": reconnecting})
    sent_to: dict[int, list[str]] = {}

    def on_send(agent_id: str, task: Message) -> None:
        sent_to.setdefault(task.header.round, []).append(agent_id)
        if task.header.round == 0 and agent_id == "c":
            fleet.events.append(status("c"))  # its birth status after reconnecting

    fleet.on_send = on_send
    rows = coordinator(fleet, tmp_path, rounds=2, round_timeout_s=1.5).run()
    assert rows[0].dropped == ["c"]
    assert sorted(sent_to[1]) == ["a", "b", "c"] and rows[1].participants == ["a", "b", "c"]


def _task_log(fleet: ScriptedFleet) -> list[tuple[int, str, str]]:
    sent: list[tuple[int, str, str]] = []
    fleet.on_send = lambda agent_id, task: sent.append((task.header.round, agent_id, task.meta.kind))
    return sent


def _run_sampled(tmp_path, name: str, n: int = 20, **overrides) -> tuple[list[tuple[int, str, str]], list]:
    fleet = ScriptedFleet({f"agent-{i:02d}": honest(f"agent-{i:02d}") for i in range(n)})
    sent = _task_log(fleet)
    rows = Coordinator(config(min_agents=n, **overrides), fleet, tmp_path / name, progress=False).run()
    return sent, rows


def test_evaluation_sampling_sends_evaluate_tasks_to_a_seeded_sample_only_round_0_and_final_included(tmp_path):
    n, rounds = 20, 3
    sent, rows = _run_sampled(tmp_path, "a", n, rounds=rounds, fraction=0.25, eval_fraction=0.5)
    for r in range(rounds + 1):  # round `rounds` is the final evaluation
        kinds = [kind for rnd, _, kind in sent if rnd == r]
        trainers = 0 if r == rounds else 5
        evaluators = 10 - trainers  # half the fleet is evaluated; the trainers count
        assert kinds.count("train") == trainers and kinds.count("evaluate") == evaluators, (r, kinds)
        evaluated = {a for rnd, a, kind in sent if rnd == r and kind == "evaluate"}
        trained = {a for rnd, a, kind in sent if rnd == r and kind == "train"}
        assert not evaluated & trained
        assert rows[r].evaluated == 10  # trainers report their pre-training evaluation too
    # the evaluators differ between rounds: not the same few agents every time
    assert len({frozenset(a for rnd, a, k in sent if rnd == r and k == "evaluate") for r in range(rounds)}) > 1

    again, _ = _run_sampled(tmp_path, "b", n, rounds=rounds, fraction=0.25, eval_fraction=0.5)
    assert sorted(again) == sorted(sent)  # samples depend only on seed and round: a resumed run draws the same
    other, _ = _run_sampled(tmp_path, "c", n, rounds=rounds, fraction=0.25, eval_fraction=0.5, seed=7)
    assert sorted(other) != sorted(sent)


def test_evaluation_sampling_cuts_the_bytes_sent_and_the_final_fraction_can_differ(tmp_path):
    n = 20
    _, full = _run_sampled(tmp_path, "full", n, rounds=2, fraction=0.1)
    sent, sampled = _run_sampled(tmp_path, "sampled", n, rounds=2, fraction=0.1, eval_fraction=0.1,
                                 final_eval_fraction=1.0)
    for r in range(2):
        # the 2 trainers are the tenth evaluated, no evaluate task; in full, 2 trainers + 18 evaluators
        assert [k for rnd, _, k in sent if rnd == r] == ["train", "train"]
        assert sampled[r].bytes_down / full[r].bytes_down == pytest.approx(2 / 20, rel=0.01)
    assert sampled[-1].final and sampled[-1].evaluated == n  # final_eval_fraction: everyone
    assert sum(1 for rnd, _, k in sent if rnd == 2 and k == "evaluate") == n
    _, final_sampled = _run_sampled(tmp_path, "final", n, rounds=1, fraction=0.1, eval_fraction=0.1)
    assert final_sampled[-1].evaluated == 2  # without final_eval_fraction, the final round samples too


def test_eval_fraction_one_is_every_idle_agent_as_before(tmp_path):
    sent, rows = _run_sampled(tmp_path, "one", 10, rounds=1, fraction=0.3)
    assert sum(1 for rnd, _, k in sent if rnd == 0 and k == "evaluate") == 7
    assert rows[-1].evaluated == 10


def test_while_the_send_window_is_full_the_round_loop_admits_answers_instead_of_sending(tmp_path):
    """The transport says when too many sent bytes wait for acknowledgement; until it has
    room again the round loop routes inbound traffic (here: the answers already in)."""
    n = 6

    class SlowLink(ScriptedFleet):
        def __init__(self, agents):
            super().__init__(agents)
            self.sent = 0
            self.log: list[tuple[str, int]] = []

        def send(self, agent_id, frame, round):
            self.sent += 1
            self.log.append(("send", len(self.events)))
            return super().send(agent_id, frame, round)

        def send_ready(self) -> bool:
            # room again once every answer of the tasks sent so far has been routed
            return not self.events

    fleet = SlowLink({f"agent-{i}": honest(f"agent-{i}") for i in range(n)})
    rows = coordinator(fleet, tmp_path).run()
    assert len(rows[0].participants) == n
    # each task went out only after the answer to the one before had been admitted
    assert [pending for what, pending in fleet.log] == [0] * len(fleet.log)


def test_a_row_cut_short_by_a_crash_is_dropped_on_resume_and_written_again(tmp_path, caplog):
    """Power lost while round 2's row was being appended: half a line after round 1's row,
    no checkpoint of round 2. The resumed run drops the torn line with a warning, runs
    round 2 again and leaves a file every line of which parses."""
    def fleet() -> ScriptedFleet:
        return ScriptedFleet({"a": shifted("a", 0.01), "b": shifted("b", 0.02)})

    coordinator(fleet(), tmp_path, rounds=2).run()
    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = [line for line in metrics.read_text().splitlines(keepends=True) if '"final": true' not in line]
    assert [json.loads(line)["round"] for line in whole] == [0, 1]
    metrics.write_text("".join(whole) + whole[-1].replace('"round": 1', '"round": 2')[:60])
    with pytest.raises(MetricsError, match="metrics.jsonl:3: not JSON"):
        read_metrics(metrics)  # what a resume read before

    with caplog.at_level("WARNING", logger="edgepfl.coordinator"):
        rows = coordinator(fleet(), tmp_path, rounds=4).run()
    assert "its last row was cut short by a crash" in caplog.text
    assert [r.round for r in rows if not r.final] == [2, 3]
    assert [(r.round, r.final) for r in read_metrics(metrics)] == [(0, False), (1, False), (2, False), (3, False),
                                                                   (4, True)]


def resign(frame: bytes, signer) -> bytes:
    """``frame`` as its sender would have signed it (same id, time, meta and tensors)."""
    m = decode(frame)
    return encode(m.type, federation=m.header.federation, sender=m.header.sender, round=m.header.round, meta=m.meta,
                  tensors=dict(m.tensors), message_id=m.header.message_id, created=m.header.created, signer=signer)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_an_agent_that_refused_for_good_gets_no_task_until_it_restarts_when_the_refusal_is_provably_its_own(
        tmp_path, signed):
    """Signed by its enrolled key, a refusal for good (``unsupported_method``) keeps the agent
    out of the run until a new session (a restart). Unsigned, anyone who read the task topic
    could have written it (the red team excluded an agent for the run with one such frame):
    it answers that one task, and the agent is asked again the next round."""
    from edgepfl.protocol.signing import generate_keypair, load_signer

    first, second = "a" * 32, "b" * 32
    responders = {"a": honest("a"), "b": refuses("b", "unsupported_method", then=honest("b"))}
    statuses = [status("a"), status("b", session=first)]
    security = {}
    if signed:
        (tmp_path / "enrolled").mkdir()
        signers = {}
        for agent in responders:
            generate_keypair(tmp_path / f"{agent}.key", tmp_path / "enrolled" / f"{agent}.pub")
            signers[agent] = load_signer(tmp_path / f"{agent}.key")
        responders = {agent: (lambda task, r=r, s=signers[agent]: [resign(f, s) for f in r(task)])
                      for agent, r in responders.items()}
        statuses = [AgentFrame(i.agent_id, i.channel, f := resign(i.frame, signers[i.agent_id]), len(f))
                    for i in statuses]
        security = {"security": {"enrolled_dir": str(tmp_path / "enrolled")}}
    fleet = ScriptedFleet(responders)
    fleet.events = deque(statuses)
    tasks: list[tuple[int, str]] = []

    def restart_b_after_round_1(agent: str, task: Message) -> None:
        tasks.append((task.header.round, agent))
        if agent == "a" and task.header.round == 2:
            restart = status("b", session=second)
            fleet.events.append(restart if not signed else
                                AgentFrame("b", AgentChannel.STATUS, f := resign(restart.frame, signers["b"]), len(f)))

    fleet.on_send = restart_b_after_round_1
    # between rounds the coordinator waits up to one round timeout for min_agents (b is excluded): 2 s, not 30
    coord = coordinator(fleet, tmp_path, rounds=4, round_timeout_s=2.0, **security)
    rows = coord.run()
    assert rows[0].refused == {"unsupported_method": 1} and rows[0].participants == ["a"]
    if signed:
        assert [r.sampled for r in rows[1:3]] == [["a"], ["a"]]  # excluded, and no restart yet
        assert [agent for round, agent in tasks if round in (1, 2)] == ["a", "a"]  # nothing was sent to b meanwhile
    else:
        assert [r.participants for r in rows[1:3]] == [["a", "b"], ["a", "b"]]  # asked again at once
    assert rows[3].sampled == ["a", "b"] and rows[3].participants == ["a", "b"]  # a new session: eligible again
    assert rows[-1].final and rows[-1].evaluated == 2


def test_an_in_process_agents_non_finite_update_is_one_rejection_and_the_round_goes_on(tmp_path):
    """A diverged trainer (NaN in its upload) in the in-process fleet: the gate rejects its
    frame ``non_finite`` like any agent's, and the others' round closes (the simulator read
    the frame's counts with the tensors' finiteness check on, and crashed)."""
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
    from edgepfl.data import load_client_data
    from edgepfl.edge_agent.tiers import TrainerTier
    from edgepfl.edge_agent.trainer import TrainerRuntime

    from tests.fleet_helpers import run_config

    class Diverged(TrainerRuntime):
        def handle(self, task):
            meta, upload = super().handle(task)
            return meta, {k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in upload.items()}

    config = prepare(run_config(rounds=2, model={"arch": "mlp", "feature_dim": 8}, device="cpu",
                                data={"dataset": "digits", "samples_per_client": 60}), 3)
    out = tmp_path / "run"
    agents = {}
    for i, agent in enumerate(agent_ids(3)):
        data, state = load_client_data(config.data, i), out / "agents" / agent
        agents[agent] = TrainerTier(agent, data, str(state), "cpu")
        if i == 0:
            agents[agent].runtime = Diverged(agent, data, state, "cpu")
    rows = Coordinator(config, LocalFleet(agents, config.federation), out, progress=False, **data_shape(config)).run()
    assert rows[0].rejected == {"non_finite": 1} and sorted(rows[0].participants) == ["agent-01", "agent-02"]
    assert not rows[0].aborted and [r.round for r in rows] == [0, 1, 2]


def test_a_task_the_fleet_could_not_deliver_answers_it_as_a_refusal_and_the_round_does_not_wait(tmp_path):
    """A fleet that holds back a task larger than the agent declared it takes hands the round
    a refusal ``too_large`` in its place: counted, the agent left out of the run, no wait."""
    from edgepfl.coordinator.gate import Refused

    class HoldsBack(ScriptedFleet):
        def send(self, agent_id: str, frame: bytes, round: int) -> int:
            if agent_id == "small":
                self.events.append(Refused(agent_id, "too_large", "a task above its max_payload_bytes", ""))
                return 0
            return super().send(agent_id, frame, round)

    fleet = HoldsBack({a: honest(a) for a in ("a", "b", "small")})
    rows = coordinator(fleet, tmp_path, rounds=3, round_timeout_s=60, min_agents=2).run()
    assert max(r.seconds for r in rows) < 20 and not any(r.dropped for r in rows)  # not the 60 s timeout
    refused = next(i for i, r in enumerate(rows) if r.refused)  # the first round that sampled it
    assert rows[refused].refused == {"too_large": 1} and rows[refused].participants == ["a", "b"]
    assert all("small" not in r.sampled and not r.refused for r in rows[refused + 1:])  # left out of the run
