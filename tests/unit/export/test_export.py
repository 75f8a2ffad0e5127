"""Encoder export: ONNX file, manifest, global heads, BatchNorm statistics, parity, int8."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
import torch

from edgepfl.export.heads import make_session
from edgepfl.export.onnx_export import ExportError, export_run, load_run, read_release, sha256_file
from edgepfl.export.predict import OnnxEncoder
from edgepfl.protocol import ManifestError, read_manifest

from tests.export_fixtures import TRAIN_CLIENTS, client_data, make_run


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("fedavg") / "run", "fedavg")


@pytest.fixture(scope="module")
def dualfed_run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("dualfed") / "run", "dualfed", rounds=2)


def _torch_features(run_dir, x, calibration=None):
    """Features from the torch encoder the way export_run prepares it (fresh load)."""
    from edgepfl.export.onnx_export import _module_prefix, _prepare_batchnorm

    run = load_run(run_dir)
    enc = run.method.encoder_module(run.model)
    _prepare_batchnorm(enc, _module_prefix(run.model, enc), run.state.shared_params(), calibration, run.meta)
    enc.eval()
    with torch.no_grad():
        return enc(torch.from_numpy(x)).numpy()


def test_encoder_manifest_and_parity_on_real_data(fedavg_run, tmp_path):
    out = tmp_path / "release"
    manifest_path = export_run(fedavg_run, out)
    manifest = read_manifest(manifest_path)
    model = onnx.load(str(out / "encoder.onnx"))
    onnx.checker.check_model(model, full_check=True)

    # the manifest describes exactly the file next to it and the run it came from
    assert manifest.format == "edgepfl.encoder/2"
    assert manifest.encoder.sha256 == sha256_file(out / "encoder.onnx")
    assert manifest.encoder.file == "encoder.onnx" and manifest.encoder.bytes == (out / "encoder.onnx").stat().st_size
    assert manifest.run.method.name == "fedavg" and manifest.round == 2
    assert manifest.run == load_run(fedavg_run).meta.run  # the checkpoint's run spec, unchanged
    assert (manifest.input_name, manifest.output_name, manifest.dtype) == ("input", "features", "float32")
    assert manifest.run.data.input_shape == (1, 8, 8)
    assert manifest.feature_dim == 32 and manifest.opset == 17
    assert manifest.run.data.class_names == [str(i) for i in range(10)]
    data = client_data(4)  # a client that never trained
    assert manifest.run.data.normalization.model_dump() == data.normalization
    assert manifest.head_kinds == ["lr", "svm", "mlp"]
    assert manifest.batchnorm.statistics == "federated"
    assert manifest.edgepfl_version and manifest.created
    # on disk it is the model's JSON, nothing more
    assert json.loads(manifest_path.read_text()) == manifest.model_dump(mode="json")

    # parity on real images, with batch sizes the export never saw (dynamic axis)
    sess = make_session(out / "encoder.onnx")
    x = np.concatenate([data.x_train, data.x_test])
    ref = _torch_features(fedavg_run, x)
    for n in (1, 37, len(x)):
        got = sess.run(["features"], {"input": x[:n]})[0]
        assert got.shape == (n, 32)
        assert np.abs(got - ref[:n]).max() <= 1e-4

    # FedAvg's classifier is shared but not part of the encoder: it is the global head
    run = load_run(fedavg_run)
    from edgepfl.atomic import read_tensors

    gh = read_tensors(out / "global_heads.safetensors")
    assert sorted(gh) == ["head.bias", "head.weight"] == sorted(manifest.global_heads.tensors)
    np.testing.assert_array_equal(gh["head.weight"], run.state.global_tensors["head.weight"])
    assert manifest.global_heads.sha256 == sha256_file(out / "global_heads.safetensors")

    got_manifest, data_bytes = read_release(out)
    assert got_manifest == manifest and len(data_bytes) == manifest.encoder.bytes


@pytest.mark.parametrize("edit,field", [
    (lambda m: m.update(format="edgepfl.encoder/1"), "format"),
    (lambda m: m["run"]["data"].update(input_shape=[1, 8]), "run.data.input_shape"),
    (lambda m: m["encoder"].update(file="../../etc/passwd"), "encoder.file"),
    (lambda m: m.pop("feature_dim"), "feature_dim"),
])
def test_an_invalid_manifest_is_a_one_line_error_naming_file_and_field(fedavg_run, tmp_path, edit, field):
    out = tmp_path / "release"
    path = export_run(fedavg_run, out)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestError) as info:
        read_release(out)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and field in message


def test_a_format_1_manifest_is_refused_with_what_to_do(tmp_path):
    """A manifest written before the run spec was typed (the old flat dict)."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"format": "edgepfl.encoder/1", "method": "fedavg", "sha256": "0" * 64}))
    with pytest.raises(ManifestError, match=r"manifest.json: format: 'edgepfl.encoder/1' .*export the run again"):
        OnnxEncoder.from_dir(tmp_path)


def test_personal_batchnorm_statistics_are_calibrated(dualfed_run, tmp_path):
    """DualFed keeps BN running stats personal: the export re-estimates them and says so."""
    calib = np.concatenate([client_data(i).x_train for i in TRAIN_CLIENTS])
    manifest = read_manifest(export_run(dualfed_run, tmp_path / "a", calibration=calib))
    bn = manifest.batchnorm
    assert bn.statistics == "calibrated" and bn.calibration_samples == len(calib)
    assert "encoder.net.2.running_mean" in bn.encoder_keys_not_federated
    assert sorted(manifest.global_heads.tensors) == ["head.global_classifier.bias", "head.global_classifier.weight"]
    x = client_data(5).x_test
    ref = _torch_features(dualfed_run, x, calib)
    got = make_session(tmp_path / "a" / "encoder.onnx").run(["features"], {"input": x})[0]
    assert np.abs(got - ref).max() <= 1e-4
    # the statistics are those of the calibration images, not the initial (0, 1)
    enc = onnx.load(str(tmp_path / "a" / "encoder.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in enc.graph.initializer}
    means = [v for k, v in inits.items() if k.endswith("running_mean")]
    assert means and not np.allclose(means[0], 0)


def test_missing_calibration_data_is_logged(dualfed_run, tmp_path, caplog, monkeypatch):
    import edgepfl.export.onnx_export as ox

    monkeypatch.setattr(ox, "_calibration_from_run", lambda meta: None)
    with caplog.at_level(logging.WARNING, logger="edgepfl.export.onnx_export"):
        manifest = read_manifest(export_run(dualfed_run, tmp_path / "b"))
    assert manifest.batchnorm.statistics == "initial"
    assert any("initial statistics" in r.getMessage() for r in caplog.records)


def test_default_calibration_reads_the_runs_own_clients(dualfed_run, tmp_path):
    manifest = read_manifest(export_run(dualfed_run, tmp_path / "c"))
    assert manifest.batchnorm.statistics == "calibrated"
    assert manifest.batchnorm.calibration_samples > 100


def test_int8_and_fp16_variants_listed_and_their_accuracy_change_measured(fedavg_run, tmp_path):
    from edgepfl.export.quantize import accuracy_change

    out = tmp_path / "q"
    manifest = read_manifest(export_run(fedavg_run, out, quantize=["int8", "fp16"]))
    assert sorted(manifest.variants) == ["fp16", "int8"]
    for entry in manifest.variants.values():
        assert entry.sha256 == sha256_file(out / entry.file)
        onnx.checker.check_model(onnx.load(str(out / entry.file)))
        assert entry.bytes < manifest.encoder.bytes
    entry = manifest.variants["int8"]
    # a variant named in the manifest opens with its own checksum
    enc8 = OnnxEncoder.from_path(out / entry.file)
    assert enc8.features(client_data(5).x_test[:3]).shape == (3, 32)
    report = accuracy_change(out, client_data(5), head="lr")
    assert 0.5 < report["fp32"]["accuracy"] <= 1.0
    assert abs(report["int8"]["delta"]) <= 0.1  # dynamic int8 must not wreck the encoder
    assert 0 < report["int8"]["max_abs_feature_diff"] < 1.0
    assert report["int8"]["delta"] == pytest.approx(report["int8"]["accuracy"] - report["fp32"]["accuracy"])
    assert abs(report["fp16"]["delta"]) <= 0.02 and report["fp16"]["max_abs_feature_diff"] < 0.1


def test_the_export_command_says_each_step_as_it_begins(fedavg_run, tmp_path, capsys):
    from edgepfl.cli import main

    assert main(["export", "--run", str(fedavg_run), "--out", str(tmp_path / "out"), "--quantize", "int8"]) == 0
    captured = capsys.readouterr()
    steps = [line.removeprefix("export: ") for line in captured.out.splitlines() if line.startswith("export: ")]
    assert steps[0] == "loading torch" and steps[1].startswith("loading the checkpoint")
    assert any(s.startswith("checking onnxruntime against torch") for s in steps) and steps[-1] == \
        "quantizing the int8 variant"
    assert captured.out.splitlines()[-1].startswith("exported to") and not captured.err


def test_unknown_quantization_is_an_error(fedavg_run, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization"):
        export_run(fedavg_run, tmp_path / "x", quantize=["int4"])


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ExportError, match="no checkpoint"):
        export_run(tmp_path, tmp_path / "out")
