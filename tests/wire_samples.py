"""Small valid run specs and release manifests for tests that need one on the wire."""

from __future__ import annotations

from edgepfl.protocol import (
    BatchNormOrigin,
    DataShape,
    FileEntry,
    MethodChoice,
    Normalization,
    ReleaseManifest,
    RunSpec,
)
from edgepfl.specs import ModelSpec, TrainConfig


def sample_run_spec(method: str = "fedavg", **options) -> RunSpec:
    """A run of ``method`` on 1x8x8 images of 10 classes."""
    return RunSpec(
        method=MethodChoice(name=method, options=options),
        model=ModelSpec(arch="mlp", feature_dim=16),
        train=TrainConfig(epochs=1, batch_size=8),
        seed=3,
        data=DataShape(input_shape=(1, 8, 8), num_classes=10, class_names=[str(i) for i in range(10)],
                       normalization=Normalization(mean=[0.5], std=[0.25])),
    )


def sample_manifest(run: RunSpec | None = None) -> ReleaseManifest:
    """A manifest for a (fictitious) exported encoder of ``run``."""
    return ReleaseManifest(
        release_id="fedavg-r1-0123456789ab", round=1, run=run or sample_run_spec(), input_name="input",
        output_name="features", feature_dim=16, opset=17,
        encoder=FileEntry(file="encoder.onnx", sha256="e" * 64, bytes=1234), head_kinds=["lr", "svm", "mlp"],
        batchnorm=BatchNormOrigin(layers=0, statistics="none"), parity_max_abs=0.0, edgepfl_version="0.1.0",
        created="2025-01-01T00:00:00+00:00",
    )
