"""A trainer's labels are the run's: local data that names its classes in another order is
mapped onto the run's numbering, other names are refused, unnamed data is taken as it is
(docs/PROTOCOL.md §5, Labels).

The bug these tests pin: an image folder whose ``classes.txt`` says ["cat", "dog"] while the
run says ["dog", "cat"] trained every "cat" as the run's "dog", silently. Real trainer
runtimes train a real model on the same images named in two orders; the updates must
be the same bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from edgepfl.edge_agent.tiers import TrainerTier
from edgepfl.edge_agent.trainer import TaskRefused, TrainerRuntime
from edgepfl.heads.labels import FEDERATION, label_space_for
from edgepfl.protocol import MessageType, TaskMeta, decode, encode

from tests.export_fixtures import client_data
from tests.wire_samples import sample_run_spec

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _named(order: list[str]):
    """Client 0's digits, label ``i`` named ``order[i]``: the same images whatever the order."""
    data = client_data(0)
    to_local = np.array([order.index(name) for name in NAMES])  # digit d is local label to_local[d]
    return replace(data, y_train=to_local[data.y_train], y_test=to_local[data.y_test], class_names=list(order))


def _task(run_names: list[str], kind: str = "train", task_id: str = "a" * 32):
    spec = sample_run_spec()
    run = spec.model_copy(update={"data": spec.data.model_copy(update={"class_names": run_names})})
    meta = TaskMeta(task_id=task_id, kind=kind, run=run, seed=7, deadline_s=10)
    return decode(encode(MessageType.TASK, federation="f", sender="coordinator", round=2, meta=meta))


def test_local_labels_in_another_class_order_train_exactly_as_the_runs(tmp_path, caplog):
    in_order = TrainerRuntime("agent-00", _named(NAMES), tmp_path / "a", "cpu")
    shuffled = list(reversed(NAMES))
    other_order = TrainerRuntime("agent-00", _named(shuffled), tmp_path / "b", "cpu")
    assert (other_order.data.y_train != in_order.data.y_train).any()  # the local numbers differ

    expected, expected_upload = in_order.handle(_task(NAMES))
    with caplog.at_level(logging.INFO, logger="edgepfl.edge_agent.trainer"):
        update, upload = other_order.handle(_task(NAMES))
        other_order.handle(_task(NAMES, kind="evaluate", task_id="b" * 32))
    assert update.eval_correct == expected.eval_correct and update.train_loss == expected.train_loss
    assert upload.keys() == expected_upload.keys()
    for key, value in upload.items():
        assert value.tobytes() == expected_upload[key].tobytes(), key
    mapped = [r for r in caplog.records if "mapping the local labels onto the run's class order" in r.getMessage()]
    assert len(mapped) == 1  # once, not per task


def test_local_class_names_that_are_not_the_runs_are_refused_naming_them(tmp_path, caplog):
    runtime = TrainerRuntime("agent-00", _named(NAMES), tmp_path, "cpu")
    run_names = ["cat", *NAMES[1:]]
    with caplog.at_level(logging.ERROR, logger="edgepfl.edge_agent.trainer"), pytest.raises(TaskRefused) as info:
        runtime.handle(_task(run_names))
    assert info.value.reason == "data_mismatch"
    assert "lacks ['cat']" in info.value.detail and "has ['zero'], which the run does not" in info.value.detail
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "data_mismatch" in record.getMessage() and "'cat'" in record.getMessage()
    assert runtime.model is None  # nothing was trained on it


def test_data_without_names_takes_the_runs_numbering_as_it_is(tmp_path):
    unnamed = client_data(0)
    assert unnamed.class_names == [str(i) for i in range(10)]  # the placeholders of data without names
    runtime = TrainerRuntime("agent-00", unnamed, tmp_path / "u", "cpu")
    named = TrainerRuntime("agent-00", _named(NAMES), tmp_path / "n", "cpu")
    update, upload = runtime.handle(_task(NAMES))
    expected, expected_upload = named.handle(_task(NAMES))
    assert update.eval_correct == expected.eval_correct
    assert all(upload[k].tobytes() == expected_upload[k].tobytes() for k in expected_upload)
    # and named data in a run without names (placeholders) is taken as it is, too
    evaluated, _ = named.handle(_task(NAMES, kind="evaluate", task_id="c" * 32))
    update, _ = named.handle(_task([str(i) for i in range(10)], kind="evaluate", task_id="d" * 32))
    assert update.eval_correct == evaluated.eval_correct and update.eval_loss == evaluated.eval_loss


def test_a_head_takes_placeholder_named_data_in_the_federations_numbering():
    space, index = label_space_for(["0", "1", "2"], NAMES)
    assert space.kind == FEDERATION and space.names == tuple(NAMES) and index.tolist() == [0, 1, 2]


def test_the_in_process_fleet_answers_a_refused_task_with_a_refusal_frame(tmp_path):
    """``LocalFleet`` carries what an MQTT agent would send: a task the trainer cannot run
    comes back as a ``refusal`` with the trainer's reason, and the round loop goes on."""
    from edgepfl.coordinator.fleet import LocalFleet
    from edgepfl.protocol import AgentChannel, RefusalMeta

    fleet = LocalFleet({"agent-00": TrainerTier("agent-00", _named(NAMES), str(tmp_path), "cpu")}, "f")
    assert fleet.poll(0.1).channel == AgentChannel.STATUS
    task = _task(["cat", *NAMES[1:]])
    fleet.send("agent-00", encode(MessageType.TASK, federation="f", sender="coordinator", round=2,
                                  meta=task.meta_as(TaskMeta)), 2)
    answer = fleet.poll(10.0)  # virtual seconds: the refusal travels back with the device's link delay
    assert answer.channel == AgentChannel.UPDATE
    refusal = decode(answer.frame)
    assert refusal.type == MessageType.REFUSAL and refusal.header.sender == "agent-00"
    meta = refusal.meta_as(RefusalMeta)
    assert meta.reason == "data_mismatch" and meta.task_id == "a" * 32 and "'cat'" in meta.detail
