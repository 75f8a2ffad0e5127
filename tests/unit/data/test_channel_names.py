"""A run whose data names its channels reads every named file by name: the names travel as
``run.data.channel_names`` in tasks and manifests, a trainer or head whose log holds the same
columns in another order takes them in the run's order, and one with other names is refused
in one line. Unnamed on either side, channels go by position (and a log whose columns were
swapped is then silently another input: the third runtime below shows what names prevent)."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.config import MethodSpec, ModelSpec, RunConfig
from edgepfl.data import load_client_data
from edgepfl.data.datasets import DataError
from edgepfl.data.preprocess import channel_order
from edgepfl.edge_agent.trainer import TaskRefused, TrainerRuntime
from edgepfl.protocol import DataShape, MessageType, TaskMeta, decode, encode
from edgepfl.specs import CsvSpec, DataSpec

CHANNELS = ["ax", "ay", "az"]
CLASSES = ["still", "walk"]
WINDOW = 20


def write_log(path, columns: list[str], seed: int = 0):
    """The same recording (channel ``ax`` around 0, ``ay`` around 10, ``az`` around 100) with
    its columns in the order ``columns`` names them."""
    rng = np.random.default_rng(seed)
    rows = ["label," + ",".join(columns)]
    for _ in range(4):
        for k, name in enumerate(CLASSES):
            t = np.arange(3 * WINDOW)[:, None]
            values = {c: 10.0 ** i + (k + 1) * np.sin(t[:, 0] * (k + 1) / 3 + i) + rng.normal(0, 0.1, len(t))
                      for i, c in enumerate(CHANNELS + [c for c in columns if c not in CHANNELS])}
            rows += [",".join([name, *(f"{values[c][j]:.4f}" for c in columns)]) for j in range(len(t))]
    path.write_text("\n".join(rows) + "\n")
    return path


def csv_data(path, **csv):
    spec = DataSpec(dataset="csv", root=str(path), num_clients=1,
                    csv=CsvSpec(window=WINDOW, stride=WINDOW, classes=CLASSES, **csv))
    return load_client_data(spec, 0)


def test_channel_order_goes_by_name_and_refuses_other_names():
    assert channel_order(CHANNELS, CHANNELS) is None
    assert channel_order(None, CHANNELS) is None and channel_order(CHANNELS, None) is None
    assert channel_order(["az", "ax", "ay"], CHANNELS).tolist() == [1, 2, 0]
    with pytest.raises(ValueError, match=r"missing \['az'\].*not in the run: \['gz'\]"):
        channel_order(["ax", "ay", "gz"], CHANNELS)


def test_a_log_records_its_channel_columns_and_the_run_carries_them(tmp_path):
    data = csv_data(write_log(tmp_path / "log.csv", ["az", "ax", "ay"]))
    assert data.channel_names == ["az", "ax", "ay"]  # file order where csv.channels is not set
    run = RunConfig(data=DataSpec(dataset="csv"), model=ModelSpec(arch="cnn1d", feature_dim=8)).run_spec(
        data.input_shape, data.num_classes, data.class_names, data.normalization, data.channel_names)
    assert run.data.channel_names == ["az", "ax", "ay"]
    assert '"channel_names":["az","ax","ay"]' in run.model_dump_json()
    unnamed = run.data.model_copy(update={"channel_names": None})
    assert "channel_names" not in unnamed.model_dump_json()  # frames as before names existed
    with pytest.raises(ValueError, match="3 distinct names"):
        DataShape.model_validate({**run.data.model_dump(), "channel_names": ["ax", "ax", "ay"]})
    with pytest.raises(ValueError, match="not an image's"):
        DataShape(input_shape=(1, 8, 8), num_classes=2, class_names=CLASSES, channel_names=["grey"])


def test_an_npz_names_its_channels_and_a_wrong_count_is_one_data_error(tmp_path):
    x = np.random.default_rng(0).normal(size=(8, 3, WINDOW)).astype(np.float32)
    np.savez(tmp_path / "w.npz", x=x, y=np.arange(8) % 2, channel_names=np.array(CHANNELS))
    spec = DataSpec(dataset="npz", root=str(tmp_path / "w.npz"), num_clients=1, input={"kind": "series"})
    assert load_client_data(spec, 0).channel_names == CHANNELS
    np.savez(tmp_path / "bad.npz", x=x, y=np.arange(8) % 2, channel_names=np.array(["ax", "ay"]))
    with pytest.raises(DataError, match="channel_names must be 3 distinct names"):
        load_client_data(spec.model_copy(update={"root": str(tmp_path / "bad.npz")}), 0)


def _evaluate_task(data) -> bytes:
    run = RunConfig(method=MethodSpec(name="fedavg"), model=ModelSpec(arch="cnn1d", feature_dim=8),
                    data=DataSpec(dataset="csv")).run_spec(
        data.input_shape, data.num_classes, data.class_names, data.normalization, data.channel_names)
    meta = TaskMeta(task_id="e" * 32, kind="evaluate", run=run, seed=3, deadline_s=30)
    return decode(encode(MessageType.TASK, federation="f", sender="coordinator", round=0, meta=meta))


def test_a_trainer_takes_a_swapped_log_by_name_and_refuses_other_channels(tmp_path):
    in_order = csv_data(write_log(tmp_path / "a.csv", CHANNELS))
    task = _evaluate_task(in_order)
    swapped = csv_data(write_log(tmp_path / "b.csv", ["az", "ax", "ay"]))
    want, _ = TrainerRuntime("dev", in_order, tmp_path / "a", "cpu").handle(task)
    got, _ = TrainerRuntime("dev", swapped, tmp_path / "b", "cpu").handle(task)  # same id: same initial model
    assert got.num_test == want.num_test and got.eval_loss == pytest.approx(want.eval_loss, rel=1e-5)
    # the same swapped log without names goes by position: another input, another loss
    blind, _ = TrainerRuntime("dev", swapped.__class__(**{**swapped.__dict__, "channel_names": None}),
                              tmp_path / "c", "cpu").handle(task)
    assert blind.eval_loss != pytest.approx(want.eval_loss, rel=1e-3)
    other = csv_data(write_log(tmp_path / "d.csv", CHANNELS), channels=None)
    other.channel_names = ["ax", "ay", "gz"]
    with pytest.raises(TaskRefused, match=r"data_mismatch.*missing \['az'\]"):
        TrainerRuntime("dev", other, tmp_path / "d", "cpu").handle(task)
