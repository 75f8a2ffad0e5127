"""A series release whose run named its channels is read by name on the head path:
``fit-head``/``predict`` on a CSV log or npz with the columns in another order, and a head
agent whose own log is swapped, give exactly what the log in the run's order gives; a log
lacking one of the run's channels is one line naming it."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.config import MethodSpec, ModelSpec, RunConfig
from edgepfl.specs import CsvSpec, DataSpec

from tests.unit.data.test_channel_names import CHANNELS, CLASSES, WINDOW, csv_data, write_log

pytest.importorskip("onnxruntime")
pytest.importorskip("sklearn")

SWAPPED = ["az", "ax", "ay"]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """An untrained FedAvg cnn1d run on a log with named channels, exported as a coordinator does."""
    import torch

    from edgepfl.export.onnx_export import export_state
    from edgepfl.methods import create_method
    from edgepfl.state import CheckpointMeta

    tmp = tmp_path_factory.mktemp("named-release")
    spec = DataSpec(dataset="csv", root=str(write_log(tmp / "fleet.csv", CHANNELS)), num_clients=1,
                    csv=CsvSpec(window=WINDOW, stride=WINDOW, classes=CLASSES))
    data = csv_data(tmp / "fleet.csv")
    torch.manual_seed(0)
    method = create_method("fedavg", {})
    model_spec = ModelSpec(arch="cnn1d", feature_dim=8)
    model = method.build_model(model_spec, data.input_shape, data.num_classes)
    run = RunConfig(method=MethodSpec(name="fedavg"), model=model_spec, data=spec, rounds=1).run_spec(
        data.input_shape, data.num_classes, data.class_names, data.normalization, data.channel_names)
    export_state(method.init_server(model), CheckpointMeta(round=0, data_spec=spec, run=run), tmp / "export",
                 calibration=data.x_train)
    return tmp / "export"


def test_the_manifest_names_the_channels_and_predict_reads_logs_and_npz_by_name(release, tmp_path):
    from edgepfl.export.fit_head import load_dataset
    from edgepfl.export.predict import OnnxEncoder, collect_inputs, csv_spec

    encoder = OnnxEncoder.from_dir(release)
    assert encoder.channel_names == CHANNELS
    straight = write_log(tmp_path / "straight.csv", CHANNELS, seed=5)
    swapped = write_log(tmp_path / "swapped.csv", SWAPPED, seed=5)  # the same recording, columns reordered
    _, want = collect_inputs([straight], encoder, csv=csv_spec(encoder))
    _, got = collect_inputs([swapped], encoder, csv=csv_spec(encoder))
    np.testing.assert_array_equal(got, want)
    assert load_dataset(swapped, encoder).x_train.tobytes() == load_dataset(straight, encoder).x_train.tobytes()
    # an npz that names its channels is reordered the same way
    from edgepfl.data.sensors import read_csv_windows

    raw = read_csv_windows(swapped, CsvSpec(window=WINDOW, stride=WINDOW, classes=CLASSES))
    np.savez(tmp_path / "swapped.npz", x=raw.x, channel_names=np.array(raw.channels))
    _, from_npz = collect_inputs([tmp_path / "swapped.npz"], encoder)
    np.testing.assert_array_equal(from_npz, want)
    lacking = write_log(tmp_path / "lacking.csv", ["ax", "ay", "gz"])
    with pytest.raises(ValueError, match="lacking.csv:1: no channel column 'az'"):
        collect_inputs([lacking], encoder, csv=csv_spec(encoder))


def test_a_head_agent_with_a_swapped_log_fits_the_head_of_the_straight_one(release, tmp_path):
    from edgepfl.edge_agent.head_tier import HeadRuntime, ReleaseRefused
    from edgepfl.export.onnx_export import read_release

    manifest, artifact = read_release(release)
    fits = {}
    for name, columns in (("straight", CHANNELS), ("swapped", SWAPPED)):
        data = csv_data(write_log(tmp_path / f"{name}.csv", columns, seed=6))
        runtime = HeadRuntime(tmp_path / name, "lr", data)
        fits[name] = runtime.install_release(manifest, artifact, manifest.encoder.sha256)
        fits[name + " proba"] = runtime.predict_proba(data.x_test)
    assert fits["swapped"].accuracy == fits["straight"].accuracy
    np.testing.assert_allclose(fits["swapped proba"], fits["straight proba"], atol=1e-6)
    other = csv_data(write_log(tmp_path / "other.csv", ["ax", "ay", "gz"], seed=6))
    with pytest.raises(ReleaseRefused, match=r"channel mismatch: .*missing \['az'\]"):
        HeadRuntime(tmp_path / "other", "lr", other).install_release(manifest, artifact, manifest.encoder.sha256)
