"""The plugin's own tests: edgepfl's public checks run against its method and its encoder, as
scikit-learn's ``parametrize_with_checks`` runs an estimator's. Run with the package installed."""

from __future__ import annotations

import pytest
from edgepfl_toy_plugin.method import SmoothPer

from edgepfl.export.head_contract import check_method_heads
from edgepfl.models import build_encoder
from edgepfl.specs import ModelSpec
from edgepfl.testing import method_checks


@pytest.mark.parametrize("check", method_checks(SmoothPer, {"smoothing": 0.05}), ids=str)
def test_smooth_per_keeps_the_method_contract(check):
    check()


def test_smooth_per_heads_fit_and_export(tmp_path):
    check_method_heads(SmoothPer, tmp_path)


@pytest.mark.parametrize("norm", ["batch", "none"])
def test_the_encoder_passes_edgepfls_check_under_its_entry_point_name(norm):
    # build_encoder loads the installed entry point and runs edgepfl.models.check_encoder on it
    encoder = build_encoder(ModelSpec(arch="toy-cnn1d", feature_dim=16, norm=norm), (6, 100))
    assert type(encoder.net).__module__ == "edgepfl_toy_plugin.encoder"
