"""The in-process fleet hands an agent's answer to the gate as it is: an answer whose meta
does not validate is the gate's to reject, never a crash of the run (a FedPick update with a
non-finite `extra` metric stopped an in-process study once)."""

from __future__ import annotations

from dataclasses import dataclass

from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.protocol import MessageType, StatusMeta, TaskMeta, UpdateMeta, encode, new_message_id
from edgepfl.protocol.envelope import peek_header

from tests.unit.edge_agent.test_tiers import RUN


@dataclass
class Reply:
    frame: bytes


class Agent:
    def status(self) -> StatusMeta:
        return StatusMeta(state="online", tier="trainer", num_train=10, num_test=5)

    def handle(self, message):
        task = message.meta_as(TaskMeta)
        meta = UpdateMeta.model_construct(task_id=task.task_id, kind="train", num_train=10, num_test=5,
                                          eval_correct=1, extra={"mask_ratio": "not a number"})
        return Reply(encode(MessageType.UPDATE, federation="f", sender="a", round=0, meta=meta))


def test_an_answer_whose_meta_does_not_validate_is_passed_on_not_raised():
    fleet = LocalFleet({"a": Agent()}, "f")
    task = encode(MessageType.TASK, federation="f", sender="coordinator", round=0,
                  meta=TaskMeta(task_id=new_message_id(), kind="train", run=RUN, seed=0, deadline_s=60))
    assert fleet.send("a", task, 0) == len(task)
    frames = [fleet.poll(3600.0) for _ in range(3)]
    answer = next(f for f in frames if f is not None and f.channel == "update")
    assert peek_header(answer.frame)["meta"]["extra"] == {"mask_ratio": "not a number"}  # as sent, for the gate
