"""Every trainer task says how inputs are preprocessed (pixel scale, per-channel mean and
std), and the trainer trains on exactly that: local data normalized otherwise is
converted (with a warning), local data that does not say how it was normalized is
refused, a run that says nothing is trained on with a warning. The coordinator never
sends a task without the normalization, in the simulator here and in the ``edgepfl
coordinator`` service alike (tests/integration/rounds/test_task_preprocessing_live.py)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from edgepfl.config import ConfigError
from edgepfl.coordinator.fleet import LocalFleet
from edgepfl.coordinator.rounds import Coordinator
from edgepfl.coordinator.simulate import agent_ids, data_shape, prepare, service_data_shape
from edgepfl.data.preprocess import conversion
from edgepfl.edge_agent.tiers import local_trainers
from edgepfl.edge_agent.trainer import TaskRefused, TrainerRuntime
from edgepfl.protocol import DataShape, MessageType, Normalization, TaskMeta, decode, encode

from tests.export_fixtures import client_data, client_pixels
from tests.fleet_helpers import run_config
from tests.wire_samples import sample_run_spec

TRAINER_LOG = "edgepfl.edge_agent.trainer"
RUN_NORM = Normalization(mean=[0.45], std=[0.2])


def _task(norm: Normalization | None, kind: str = "train", pixel_scale: float | None = None, task_id: str = "a" * 32):
    spec = sample_run_spec()
    data = spec.data.model_copy(update={"normalization": norm, **({"pixel_scale": pixel_scale} if pixel_scale else {})})
    meta = TaskMeta(task_id=task_id, kind=kind, run=spec.model_copy(update={"data": data}), seed=7, deadline_s=10)
    return decode(encode(MessageType.TASK, federation="f", sender="coordinator", round=2, meta=meta))


def _from_raw(norm: Normalization, pixel_scale: float = 1 / 255):
    """Client 0 of the digits run, normalized from its raw pixels as ``norm`` says."""
    local = client_data(0)
    pixels, _, _ = client_pixels(0)
    # digits are stored as floats in [0, 1], i.e. already 8-bit values times 1/255
    raw8 = pixels.astype(np.float64) * (255 if pixels.dtype == np.float32 else 1)
    x = raw8 * pixel_scale
    x = ((x - np.asarray(norm.mean).reshape(1, -1, 1, 1)) / np.asarray(norm.std).reshape(1, -1, 1, 1)).astype(np.float32)
    n = local.num_train
    return dataclasses.replace(local, x_train=x[:n], x_test=x[n:], normalization=norm.model_dump())


@pytest.mark.parametrize("pixel_scale", [1 / 255, 1 / 127.5])
def test_conversion_equals_normalizing_the_raw_pixels_the_run_s_way(pixel_scale):
    local = client_data(0)
    target = DataShape(input_shape=local.input_shape, num_classes=10, class_names=list("0123456789"),
                       pixel_scale=pixel_scale, normalization=RUN_NORM)
    affine = conversion(local.normalization, target)
    assert affine is not None
    np.testing.assert_allclose(affine.apply(local.x_train), _from_raw(RUN_NORM, pixel_scale).x_train, atol=2e-5)
    same = target.model_copy(update={"pixel_scale": 1 / 255, "normalization": Normalization(**local.normalization)})
    assert conversion(local.normalization, same) is None
    with pytest.raises(ValueError, match="does not say"):
        conversion(local.normalization, target.model_copy(update={"normalization": None}))


def test_a_trainer_trains_on_the_run_s_normalization_not_its_own(tmp_path, caplog):
    """The agent whose data is normalized otherwise answers bit-near the agent whose data
    already is the run's; a third that ignored the task's normalization would not."""
    local = client_data(0)
    assert local.normalization != RUN_NORM.model_dump()
    converting = TrainerRuntime("a", local, tmp_path / "a", "cpu")
    native = TrainerRuntime("a", _from_raw(RUN_NORM), tmp_path / "b", "cpu")  # same id: same initial model
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        got, got_up = converting.handle(_task(RUN_NORM))
        again, _ = converting.handle(_task(RUN_NORM, kind="evaluate", task_id="d" * 32))
    want, want_up = native.handle(_task(RUN_NORM))
    converted = [r for r in caplog.records if "converting the local data" in r.getMessage()]
    assert len(converted) == 1  # once per preprocessing, not per task
    assert got.eval_correct == want.eval_correct and got.num_test == want.num_test
    assert got.eval_loss == pytest.approx(want.eval_loss, rel=1e-4)
    assert got.train_loss == pytest.approx(want.train_loss, rel=1e-3)
    for key in want_up:
        np.testing.assert_allclose(got_up[key], want_up[key], rtol=1e-3, atol=1e-4)
    assert again.eval_correct >= 0

    # the same task with the agent's own normalization in it: another model comes out
    ignoring = TrainerRuntime("a", local, tmp_path / "c", "cpu")
    _, own_up = ignoring.handle(_task(Normalization(**local.normalization)))
    assert any(not np.allclose(own_up[k], want_up[k], rtol=1e-3, atol=1e-4) for k in want_up)


def test_local_data_of_unknown_normalization_is_refused_and_a_silent_run_is_warned_about(tmp_path, caplog):
    unknown = dataclasses.replace(client_data(0), normalization={})
    runtime = TrainerRuntime("a", unknown, tmp_path, "cpu")
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG), pytest.raises(TaskRefused, match="normalizes with"):
        runtime.handle(_task(RUN_NORM))
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "a" * 32 in error.getMessage() and "\n" not in error.getMessage()

    caplog.clear()
    known = TrainerRuntime("b", client_data(0), tmp_path / "b", "cpu")
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        update, _ = known.handle(_task(None))
    assert update.num_train == known.data.num_train
    assert any("does not say how inputs are normalized" in r.getMessage() for r in caplog.records)


def test_a_coordinator_that_cannot_say_the_normalization_does_not_start(tmp_path):
    config = run_config(input_shape=[1, 8, 8], num_classes=10)
    with pytest.raises(ConfigError, match="normalization is unknown"):
        Coordinator(config, LocalFleet({}, config.federation), tmp_path, progress=False)


def test_the_service_reads_only_what_its_config_leaves_open():
    config = run_config(data={"dataset": "digits"})
    from_data = data_shape(config)
    assert service_data_shape(config) == from_data and from_data["normalization"]["mean"]
    shaped = config.model_copy(update={"input_shape": [1, 8, 8], "num_classes": 10})
    assert service_data_shape(shaped) == {"normalization": from_data["normalization"]}  # the bug: it used to be {}
    explicit = shaped.model_copy(update={"normalization": RUN_NORM})
    assert service_data_shape(explicit) == {}
    assert explicit.run_spec(**service_data_shape(explicit)).data.normalization == RUN_NORM


class RecordingFleet(LocalFleet):
    def __init__(self, runtimes, federation):
        super().__init__(runtimes, federation)
        self.tasks = []

    def send(self, agent_id, frame, round):
        self.tasks.append(decode(frame))
        return super().send(agent_id, frame, round)


def test_the_round_loop_sends_the_configured_normalization_and_agents_train_on_it(tmp_path, caplog):
    config = prepare(run_config(rounds=1, normalization=RUN_NORM.model_dump(), device="cpu",
                                model={"arch": "mlp", "feature_dim": 16},
                                data={"dataset": "digits", "samples_per_client": 60}), 2)
    fleet = RecordingFleet(local_trainers(config, agent_ids(2), tmp_path), config.federation)
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        rows = Coordinator(config, fleet, tmp_path / "run", progress=False, **service_data_shape(config)).run()
    assert fleet.tasks and all(t.meta.run.data.normalization == RUN_NORM for t in fleet.tasks)
    assert rows[0].participants == agent_ids(2) and rows[-1].accuracy is not None
    assert sum("converting the local data" in r.getMessage() for r in caplog.records) == 2  # once per agent
