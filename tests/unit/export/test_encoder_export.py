"""ONNX export of the series encoders: the built-in 1-D CNN and a user's own, with the parity the
exporter demands and a dynamic batch; an encoder with an op ONNX lacks is one line naming the op."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgepfl.errors import ExitCode, classify
from edgepfl.models import build_encoder
from edgepfl.specs import ModelSpec
from export.heads import make_session
from export.onnx_export import INPUT_NAME, OUTPUT_NAME, PARITY_TOLERANCE, ExportError, encoder_to_onnx

pytest.importorskip("onnxruntime")

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SERIES = (6, 100)


@pytest.fixture(autouse=True)
def plugin_folder(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


def trained_looking(spec: ModelSpec) -> torch.nn.Module:
    """The encoder in eval mode with BatchNorm statistics away from their initial values."""
    torch.manual_seed(0)
    encoder = build_encoder(spec, SERIES)
    encoder.train()
    with torch.no_grad():
        for _ in range(3):
            encoder(3 * torch.randn(16, *SERIES) + 1)
    return encoder.eval()


@pytest.mark.parametrize("arch", ["cnn1d", "sensor_cnn:build"])
@pytest.mark.parametrize("norm", ["batch", "none"])
def test_a_series_encoder_exports_with_a_dynamic_batch_within_the_parity_tolerance(arch, norm):
    encoder = trained_looking(ModelSpec(arch=arch, feature_dim=32, norm=norm))
    session = make_session(encoder_to_onnx(encoder, SERIES))
    windows = (5 * np.random.default_rng(1).standard_normal((9, *SERIES))).astype(np.float32)  # raw sensor ranges
    for batch in (windows, windows[:1]):
        got = session.run([OUTPUT_NAME], {INPUT_NAME: batch})[0]
        with torch.no_grad():
            want = encoder(torch.from_numpy(batch)).numpy()
        assert got.shape == (len(batch), 32)
        assert float(np.abs(got - want).max()) <= PARITY_TOLERANCE


def test_an_encoder_with_an_op_onnx_lacks_is_one_line_naming_the_op_and_the_arch():
    encoder = build_encoder(ModelSpec(arch="sensor_cnn:unexportable", feature_dim=8), SERIES).eval()
    with pytest.raises(ExportError) as caught:
        encoder_to_onnx(encoder, SERIES)
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("the encoder of model.arch sensor_cnn:unexportable cannot be exported to ONNX: it uses "
                           "aten::fft_fft, which has no ONNX export at opset 17")
    assert classify(caught.value) == (ExitCode.DATA, line)
