"""One run spec across process boundaries: the task, the checkpoint and the release manifest
carry the same :class:`RunSpec`; metrics rows and checkpoints read back typed; an agent
refuses a run whose data shape is not its own."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from edgepfl.config import ConfigError
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.edge_agent.trainer import TaskRefused, TrainerRuntime
from edgepfl.export.onnx_export import export_run
from edgepfl.metrics import MetricsError, RoundMetrics, read_metrics
from edgepfl.protocol import MessageType, RunSpec, TaskMeta, decode, encode, read_manifest
from edgepfl.state import CheckpointError, load_checkpoint, read_checkpoint_meta

from tests.fleet_helpers import run_config
from tests.wire_samples import sample_run_spec

AGENTS = 2


class RecordingFleet(LocalFleet):
    """The in-process fleet, keeping every task frame the coordinator sent."""

    def __init__(self, runtimes, federation):
        super().__init__(runtimes, federation)
        self.frames: list[bytes] = []

    def send(self, agent_id, frame, round):
        self.frames.append(frame)
        return super().send(agent_id, frame, round)


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A real in-process federation: 2 rounds of FedRep (options set), a release at the end."""
    out = tmp_path_factory.mktemp("spec") / "run"
    config = run_config(method={"name": "fedrep", "head_epochs": 2}, rounds=2, release_at_end=True,
                        model={"arch": "mlp", "feature_dim": 16},
                        data={"dataset": "digits", "samples_per_client": 80}, device="cpu")
    config = prepare(config, AGENTS)
    fleet = RecordingFleet(local_trainers(config, agent_ids(AGENTS), out), config.federation)
    coordinator = Coordinator(config, fleet, out, progress=False, **data_shape(config))
    rows = coordinator.run()
    return {"config": config, "out": out, "fleet": fleet, "rows": rows}


def test_task_checkpoint_and_manifest_carry_the_same_run_spec(federation, tmp_path):
    config, out = federation["config"], federation["out"]
    shape = data_shape(config)
    expected = config.run_spec(**shape)
    assert expected.method.options == {"head_epochs": 2}
    assert expected.data.input_shape == tuple(shape["input_shape"]) and expected.data.normalization is not None

    # every task frame the coordinator sent decodes to that spec ...
    tasks = [decode(frame) for frame in federation["fleet"].frames]
    assert len(tasks) == AGENTS * 3  # 2 training rounds + the final evaluation
    assert all(t.type == MessageType.TASK and isinstance(t.meta.run, RunSpec) for t in tasks)
    assert all(t.meta.run == expected for t in tasks)
    # ... and a task frame encoded here round-trips to an equal spec
    meta = TaskMeta(task_id="a" * 32, kind="train", run=expected, seed=1, deadline_s=10)
    again = decode(encode(MessageType.TASK, federation=config.federation, sender="c", round=0, meta=meta))
    assert again.meta.run == expected

    # the checkpoint saved and loaded
    _, checkpoint = load_checkpoint(out / "checkpoint")
    assert checkpoint.run == expected and checkpoint.round == 1 and checkpoint.data_spec == config.data
    assert read_checkpoint_meta(out / "checkpoint") == checkpoint

    # the release the coordinator published, and a fresh export of the run
    released = read_manifest(out / "releases" / "round-0001" / "manifest.json")
    exported = read_manifest(export_run(out, tmp_path / "export"))
    assert released.run == exported.run == expected
    assert exported.round == checkpoint.round == 1

    # one JSON shape in all three places
    on_disk = json.loads((out / "checkpoint" / "state.json").read_text())["run"]
    assert on_disk == json.loads((tmp_path / "export" / "manifest.json").read_text())["run"]
    assert on_disk == json.loads(tasks[0].header.model_dump_json())["meta"]["run"]


def test_metrics_rows_of_a_real_federation_read_back_typed(federation):
    rows = federation["rows"]
    assert all(isinstance(r, RoundMetrics) for r in rows)
    read = read_metrics(federation["out"])
    assert read == rows
    assert [r.round for r in read] == [0, 1, 2] and read[-1].final and not read[0].final
    assert all(r.participants == agent_ids(AGENTS) for r in read[:-1])
    assert all(r.accuracy is not None and 0 <= r.accuracy <= 1 for r in read)
    assert read[0].shared_bytes > 0 and read[0].bytes_down > 0 and read[0].bytes_up > 0
    # the file keeps its keys: one JSON object per line, the model's fields (those added later only when not empty)
    first = json.loads((federation["out"] / "metrics.jsonl").read_text().splitlines()[0])
    # nothing late in round 0 (no late or trained_on), no privacy, not a secure round
    empty = ("late", "trained_on", "privacy", "secure", "clipped_by", "sites")
    assert list(first) == [k for k in RoundMetrics.model_fields if k not in empty]


def test_a_metrics_line_written_before_the_typed_row_reads_and_writes_back_identically(tmp_path):
    old = {"round": 0, "final": False, "accuracy": 0.25, "per_client": {"agent-00": 0.2, "agent-01": None},
           "participants": ["agent-00"], "sampled": ["agent-00", "agent-01"], "evaluated": 2,
           "dropped": ["agent-01"], "rejected": {"stale": 1}, "aborted": False, "train_loss": 1.5,
           "bytes_up": 10, "bytes_down": 20, "shared_bytes": 8, "seconds": 0.1234}
    line = json.dumps(old) + "\n"
    (tmp_path / "metrics.jsonl").write_text(line + "\n")
    (row,) = read_metrics(tmp_path)
    assert row.dropped == ["agent-01"] and row.per_client["agent-01"] is None
    assert row.abort_reason is None and row.rolled_back_to is None  # fields added later read as null
    # written back: the old keys with their values in their order, then the later fields
    later = {"abort_reason": None, "rolled_back_to": None, "clipped": [], "refused": {}}
    assert json.loads(row.to_line()) == {**old, **later}
    assert row.to_line().startswith(line[:line.index(', "train_loss"')])

    (tmp_path / "metrics.jsonl").write_text(line + json.dumps({**old, "bytes_up": -1}) + "\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2: bytes_up"):
        read_metrics(tmp_path)


def test_only_a_torn_last_line_is_dropped_and_only_when_asked(tmp_path):
    """A crash can cut the last row short, never one before it: a bad line in the middle
    is still an error, and so is a bad last line that has its newline."""
    row = json.dumps({"round": 0, "final": False, "accuracy": 0.5, "per_client": {"a": 0.5}, "participants": ["a"],
                      "sampled": ["a"], "evaluated": 1, "dropped": [], "rejected": {}, "aborted": False,
                      "train_loss": 1.0, "bytes_up": 1, "bytes_down": 1, "shared_bytes": 1, "seconds": 0.1}) + "\n"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(row + row[:30])
    with pytest.raises(MetricsError, match="metrics.jsonl:2: not JSON"):
        read_metrics(tmp_path)
    assert [r.round for r in read_metrics(tmp_path, drop_torn_tail=True)] == [0]
    for text in (row[:30] + "\n" + row, row + row[:30] + "\n"):
        metrics.write_text(text)
        with pytest.raises(MetricsError, match="not JSON"):
            read_metrics(tmp_path, drop_torn_tail=True)


def test_an_old_checkpoint_is_a_one_line_error_naming_file_and_field(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"round": 3, "method": "fedavg", "tensors_sha256": "0" * 64}))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(tmp_path)
    assert "\n" not in str(info.value) and "state.json" in str(info.value) and "run" in str(info.value)


@pytest.mark.parametrize("change,needle", [
    ({"input_shape": (3, 32, 32), "normalization": None}, "input shape [3, 32, 32], local data [1, 8, 8]"),
    ({"num_classes": 4, "class_names": list("abcd")}, "4 classes, local data 10"),
])
def test_trainer_refuses_a_run_for_other_data_with_a_clear_logged_error(tmp_path, caplog, change, needle):
    from tests.export_fixtures import client_data

    runtime = TrainerRuntime("agent-00", client_data(0), tmp_path, "cpu")
    spec = sample_run_spec()
    assert spec.data.input_shape == runtime.data.input_shape  # the sample fits this data ...
    run = spec.model_copy(update={"data": spec.data.model_copy(update=change)})
    meta = TaskMeta(task_id="b" * 32, kind="train", run=run, seed=1, deadline_s=10)
    task = decode(encode(MessageType.TASK, federation="f", sender="coordinator", round=4, meta=meta))
    with caplog.at_level(logging.ERROR, logger="edgepfl.edge_agent.trainer"), pytest.raises(TaskRefused):
        runtime.handle(task)
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert needle in record.getMessage() and "round 4" in record.getMessage() and "b" * 32 in record.getMessage()
    assert runtime.model is None  # nothing was built for it

    # ... and the fitting run is answered
    ok = TaskMeta(task_id="c" * 32, kind="evaluate", run=spec, seed=1, deadline_s=10)
    update, upload = runtime.handle(decode(encode(MessageType.TASK, federation="f", sender="c", round=4, meta=ok)))
    assert update.num_test == runtime.data.num_test and upload == {} and np.isfinite(update.eval_correct)


@pytest.mark.parametrize("known", [{}, {"input_shape": (1, 28, 28)}, {"num_classes": 10}])
def test_a_coordinator_without_the_data_shape_is_a_config_error(tmp_path, known):
    # Neither the config nor the caller says the input shape or the class count: the
    # error RunConfig.run_spec gives, not a TypeError from tuple(None) / int(None).
    config = run_config()
    assert config.input_shape is None and config.num_classes is None
    with pytest.raises(ConfigError, match="input_shape and num_classes are unknown"):
        Coordinator(config, LocalFleet({}, config.federation), tmp_path / "run", progress=False, **known)


def test_a_checkpoint_is_one_unit_and_one_written_before_the_tensor_file_was_named_still_loads(tmp_path):
    """state.json names its tensor file, written beside the old one: a checkpoint from before
    (``state.safetensors``, no name in the JSON) loads, and the next save replaces it whole."""
    from edgepfl.atomic import write_json, write_tensors
    from edgepfl.methods import ServerState
    from edgepfl.state import CheckpointMeta, save_checkpoint

    state = ServerState(global_tensors={"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, extra={"k": 1})
    meta = CheckpointMeta(round=4, run=sample_run_spec())
    new = tmp_path / "new"
    save_checkpoint(new, state, meta)
    record = json.loads((new / "state.json").read_text())
    legacy = tmp_path / "legacy"
    write_tensors(legacy / "state.safetensors", state.to_flat())
    del record["tensors_file"]
    write_json(legacy / "state.json", record)
    loaded, loaded_meta = load_checkpoint(legacy)
    np.testing.assert_array_equal(loaded.global_tensors["w"], state.global_tensors["w"])
    assert loaded.extra == {"k": 1} and loaded_meta.round == 4
    save_checkpoint(legacy, state, meta.model_copy(update={"round": 5}))
    assert sorted(p.name for p in legacy.iterdir()) == sorted(p.name for p in new.iterdir())
    # a tensor file changed on disk after its state.json was written is refused, in one line
    tensors = next(new.glob("state-*.safetensors"))
    tensors.write_bytes(tensors.read_bytes()[:-1] + b"\x01")
    with pytest.raises(CheckpointError, match="does not match") as info:
        load_checkpoint(new)
    assert "\n" not in str(info.value)


def test_an_unknown_failpoint_name_fails_at_once(monkeypatch):
    from edgepfl.failpoints import ENV, failpoint

    monkeypatch.setenv(ENV, "checkpoint.comitted:2")  # misspelt: it would never fire
    with pytest.raises(ValueError, match="unknown failpoint 'checkpoint.comitted'"):
        failpoint("atomic.written")
