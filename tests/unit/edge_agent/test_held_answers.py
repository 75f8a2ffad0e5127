"""An agent's held answers (edge_agent/held_answers.py): a task's answer goes out again only
while its round is open, once per connection and coordinator session; a metrics report in
any round until the run is done; the oldest beyond the bound are forgotten."""

from __future__ import annotations

from edgepfl.edge_agent.held_answers import HeldAnswers
from edgepfl.edge_agent.tiers import ANSWERED_TASKS, Reply
from edgepfl.protocol import AgentChannel, CoordinatorMeta

S1, S2 = "1" * 32, "2" * 32  # two coordinator sessions


def presence(round: int, state: str = "online", session: str = S1) -> CoordinatorMeta:
    return CoordinatorMeta(state=state, round=round, session=session)


def answer(task: str, round: int) -> Reply:
    return Reply(AgentChannel.UPDATE, b"frame-" + task.encode(), round, task_id=task)


def test_a_tasks_answer_goes_out_once_per_connection_while_its_round_is_open_and_is_dropped_after():
    held = HeldAnswers()
    first = held.hold("t1", answer("t1", 2))
    assert [h.reply.task_id for h in held.settle(presence(2), (1, S1))] == ["t1"]
    first.sent_on = (1, S1)  # what the agent records when it publishes
    assert held.settle(presence(2), (1, S1)) == []  # already out on this connection and session
    assert [h.reply.task_id for h in held.settle(presence(2), (2, S1))] == ["t1"]  # a new connection
    assert [h.reply.task_id for h in held.settle(presence(2, session=S2), (1, S2))] == ["t1"]  # a new session
    assert held.settle(presence(3), (3, S1)) == [] and "t1" not in held  # its round is over


def test_a_metrics_report_is_wanted_in_any_round_until_the_run_is_done():
    held = HeldAnswers()
    report = Reply(AgentChannel.METRICS, b"report", 0, release_id="r1")
    held.hold(report.held_as or "", report)
    assert len(held.settle(presence(5), (1, S1))) == 1
    assert held.settle(presence(5, state="done"), (1, S1)) == [] and report.held_as not in held


def test_only_the_newest_answers_are_held_and_a_closed_task_is_forgotten():
    held = HeldAnswers()
    for i in range(ANSWERED_TASKS + 2):
        held.hold(f"t{i}", answer(f"t{i}", 0))
    assert "t0" not in held and "t1" not in held and f"t{ANSWERED_TASKS + 1}" in held
    held.drop("t2")
    assert held.get("t2") is None and "t2" not in held
