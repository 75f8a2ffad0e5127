"""Encoder export: the CNN encoder's ONNX parity on Fashion-MNIST, which trains a CNN first
(the rest of the export: tests/unit/export/test_export.py)."""

from __future__ import annotations

import numpy as np
import pytest

from edgepfl.data import fmnist_available
from edgepfl.export.onnx_export import export_run
from edgepfl.export.predict import OnnxEncoder
from edgepfl.protocol import read_manifest

from tests.export_fixtures import client_data, make_run
from tests.unit.export.test_export import _torch_features


# trains a CNN on Fashion-MNIST: 10-20 s on 2 cores
@pytest.mark.skipif(not fmnist_available(), reason="Fashion-MNIST not installed (dataset-fashion-mnist)")
@pytest.mark.parametrize("arch", ["cnn", "fedpac_cnn"])
def test_cnn_encoder_parity_on_fashion_mnist(tmp_path, arch):
    run = make_run(tmp_path / "run", "fedbn", arch=arch, dataset="fmnist", rounds=1, epochs=1, feature_dim=64)
    calib = client_data(0, "fmnist").x_train
    manifest = read_manifest(export_run(run, tmp_path / "out", calibration=calib))
    assert manifest.batchnorm.statistics == "calibrated"
    x = client_data(4, "fmnist").x_test
    ref = _torch_features(run, x, calib)
    got = OnnxEncoder.from_dir(tmp_path / "out").features(x)
    assert np.abs(got - ref).max() <= 1e-4
