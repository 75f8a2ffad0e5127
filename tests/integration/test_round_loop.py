"""The round loop against a scripted fleet (tests/unit/coordinator/test_round_loop.py): the
case that waits out real time. An agent that refused for good gets no task until it
restarts; with one trainer left of min_agents=2, the coordinator waits one round timeout
(30 s) before each of the rounds in between.
"""

from __future__ import annotations

from collections import deque

from edgepfl.protocol import Message

from tests.unit.coordinator.test_round_loop import ScriptedFleet, coordinator, honest, refuses, status


def test_an_agent_that_refused_for_good_gets_no_task_until_it_restarts(tmp_path):
    first, second = "a" * 32, "b" * 32
    fleet = ScriptedFleet({"a": honest("a"), "b": refuses("b", "unsupported_method", then=honest("b"))})
    fleet.events = deque([status("a"), status("b", session=first)])
    tasks: list[tuple[int, str]] = []

    def restart_b_after_round_1(agent: str, task: Message) -> None:
        tasks.append((task.header.round, agent))
        if agent == "a" and task.header.round == 2:
            fleet.events.append(status("b", session=second))

    fleet.on_send = restart_b_after_round_1
    coord = coordinator(fleet, tmp_path, rounds=4)
    rows = coord.run()
    assert rows[0].refused == {"unsupported_method": 1} and rows[0].participants == ["a"]
    assert [r.sampled for r in rows[1:3]] == [["a"], ["a"]]  # excluded, and no restart yet
    assert rows[3].sampled == ["a", "b"] and rows[3].participants == ["a", "b"]  # a new session: eligible again
    assert rows[-1].final and rows[-1].evaluated == 2
