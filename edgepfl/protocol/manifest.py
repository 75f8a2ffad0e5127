"""The release manifest: what a device needs to know about an exported encoder.

``edgepfl export`` (and a coordinator's release) writes it as ``manifest.json`` next to
``encoder.onnx``; the ``release`` message carries it as ``ReleaseMeta.manifest``; the head
tier, ``edgepfl predict`` and ``edgepfl fit-head`` read it. It embeds the run's
:class:`~edgepfl.protocol.run.RunSpec` (method, model, input shape, classes,
preprocessing), so a manifest, a task and a checkpoint describe a run identically, and
adds what export measured and wrote. ``docs/PROTOCOL.md`` (§12) documents every field.

Torch-free: the head tier imports this.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import bounded_json
from .run import RunSpec
from .validation import first_validation_error

__all__ = [
    "MANIFEST_FORMAT", "BatchNormOrigin", "FileEntry", "GlobalHeadsEntry", "ManifestError", "ReleaseManifest",
    "parse_manifest", "read_manifest", "release_tensors",
]

#: the manifest's ``format``; version 2 embeds the run spec (version 1 was a flat dict)
MANIFEST_FORMAT: Final = "edgepfl.encoder/2"

# A bare file name: the manifest names files beside it, never a path out of its directory.
_FILE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"
_SHA256 = r"^[0-9a-f]{64}$"


class _Spec(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())


class ManifestError(ValueError):
    """A manifest that cannot be read; the one-line message names the file and the field."""


class FileEntry(_Spec):
    """A file of the release, beside the manifest."""

    file: str = Field(pattern=_FILE_NAME)
    sha256: str = Field(pattern=_SHA256)
    bytes: int = Field(ge=0)


class GlobalHeadsEntry(_Spec):
    """``global_heads.safetensors``: the shared parameters outside the encoder, name -> shape."""

    file: str = Field(pattern=_FILE_NAME)
    sha256: str = Field(pattern=_SHA256)
    tensors: dict[str, list[int]]


class BatchNormOrigin(_Spec):
    """Where the encoder's BatchNorm running statistics come from.

    ``federated``: aggregated by the federation; ``calibrated``: re-estimated at export on
    ``calibration_samples`` images (the method keeps them personal); ``initial``: personal
    and no calibration data was found; ``none``: the encoder has no BatchNorm layer.
    """

    layers: int = Field(ge=0)
    statistics: Literal["federated", "calibrated", "initial", "none"]
    calibration_samples: int | None = Field(None, ge=0)
    encoder_keys_not_federated: list[str] = Field(default_factory=list)


class ReleaseManifest(_Spec):
    """An exported encoder: the run it came from, its graph interface, its files and checks.

    The graph takes ``input_name`` (``dtype``, ``(N, *run.data.input_shape)``: images (N, C, H, W), series
    (N, C, T), vectors (N, D); any N)
    and returns ``output_name`` (``dtype``, ``(N, feature_dim)``).
    """

    format: Literal["edgepfl.encoder/2"] = MANIFEST_FORMAT  # mypy flags this default if the two ever differ
    release_id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    round: int = Field(ge=-1, description="last completed round; -1: an untrained model")
    run: RunSpec
    input_name: str = Field(min_length=1)
    output_name: str = Field(min_length=1)
    dtype: Literal["float32"] = "float32"
    feature_dim: int = Field(ge=1)
    opset: int = Field(ge=1)
    encoder: FileEntry
    global_heads: GlobalHeadsEntry | None = None
    variants: dict[str, FileEntry] = Field(default_factory=dict, description="quantization kind -> encoder file")
    head_kinds: list[str] = Field(min_length=1)
    batchnorm: BatchNormOrigin
    parity_max_abs: float = Field(ge=0, description="largest |torch - onnxruntime| feature difference at export")
    edgepfl_version: str
    created: str = Field(description="ISO 8601 UTC time of the export")


def parse_manifest(data: Any, source: str = "<manifest>") -> ReleaseManifest:
    """Validate a decoded manifest; :class:`ManifestError` names ``source`` and the first bad field."""
    if isinstance(data, dict) and "format" in data and data["format"] != MANIFEST_FORMAT:
        raise ManifestError(f"{source}: format: {data['format']!r} is not {MANIFEST_FORMAT!r} "
                            "(written by another edgepfl version; export the run again)")
    try:
        return ReleaseManifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(f"{source}: invalid release manifest: {first_validation_error(exc)}") from None


def read_manifest(path: str | Path) -> ReleaseManifest:
    """Read ``manifest.json``; :class:`ManifestError` (one line, naming file and field) if unusable."""
    path = Path(path)
    try:
        data = bounded_json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest") from None
    except (OSError, ValueError) as exc:
        raise ManifestError(f"{path}: not a JSON manifest ({exc})") from None
    return parse_manifest(data, str(path))


def release_tensors(artifact: bytes, global_heads: bytes | None = None) -> dict[str, np.ndarray]:
    """The tensors of a ``release`` frame (docs/PROTOCOL.md §12): ``artifact``, the encoder
    file's bytes, and ``global_heads``, the global heads file's bytes when the manifest has them."""
    tensors = {"artifact": np.frombuffer(artifact, dtype=np.uint8)}
    if global_heads is not None:
        tensors["global_heads"] = np.frombuffer(global_heads, dtype=np.uint8)
    return tensors
