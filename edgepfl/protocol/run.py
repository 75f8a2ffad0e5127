"""The run spec: what a federation trains, in one typed shape.

The same :class:`RunSpec` travels in every task (``TaskMeta.run``), is recorded in the
coordinator's checkpoint (:class:`edgepfl.state.CheckpointMeta`) and is embedded in
every release manifest (:class:`edgepfl.protocol.manifest.ReleaseManifest`), so an agent,
an export and a device read one description of a run. :meth:`edgepfl.config.RunConfig.run_spec`
builds it once the data's shape is known.

Method options stay a JSON mapping here: the protocol does not know the method
registry. Whoever creates the method (agent, coordinator, export) validates them with
that method's own config class. ``docs/PROTOCOL.md`` documents every field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from edgepfl.specs import ModelSpec, TrainConfig

from .evolution import since

__all__ = ["DataShape", "INPUT_DIMS", "InputKind", "MethodChoice", "Normalization", "PIXEL_SCALE", "RunSpec",
           "kind_of_shape"]

#: raw 8-bit pixel values (0..255) times this give the [0, 1] values normalization starts from
PIXEL_SCALE = 1 / 255

#: what one sample is: an image (C, H, W), a series (C channels over T steps) or a vector (D features)
InputKind = Literal["image", "series", "vector"]
#: the dimensions of one sample of each kind (``input_shape`` has exactly this many entries)
INPUT_DIMS: dict[str, int] = {"image": 3, "series": 2, "vector": 1}


def kind_of_shape(input_shape: Sequence[int]) -> InputKind:
    """The input kind a sample shape of 3 (image), 2 (series) or 1 (vector) dimensions has."""
    for kind, ndim in INPUT_DIMS.items():
        if len(input_shape) == ndim:
            return kind  # type: ignore[return-value]
    raise ValueError(f"an input shape has 1 (vector D), 2 (series C, T) or 3 (image C, H, W) entries, "
                     f"got {list(input_shape)}")


class _Spec(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())


class MethodChoice(_Spec):
    """A registered method's name and the options this run sets for it (JSON values)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    options: dict[str, JsonValue] = Field(default_factory=dict)


class Normalization(_Spec):
    """Per-channel standardization of scaled raw values: ``x[c] = (p[c] * pixel_scale - mean[c]) / std[c]``.

    A channel is axis 1 of a batch: an image's colour channel, a series' channel (statistics over
    time and samples), a vector's feature."""

    mean: list[float] = Field(min_length=1)
    std: list[PositiveFloat] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_channels(self) -> Normalization:
        if len(self.mean) != len(self.std):
            raise ValueError(f"mean has {len(self.mean)} channels, std {len(self.std)}")
        return self


class DataShape(_Spec):
    """The shape of a run's data: model input, classes, and how raw values become inputs.

    ``input_kind`` says what one sample is; ``input_shape`` has its dimensions (image
    C, H, W; series C, T; vector D). Raw image pixels are scaled by ``pixel_scale``; a
    series' or vector's raw values are taken as they are (``pixel_scale`` is 1).
    ``normalization`` is ``None`` when the coordinator was given the input shape and
    class count without reading the data (then nobody can say how agents normalized).
    """

    # left out of an image run's frames, manifests and checkpoints, so they are byte for byte
    # what they were before input kinds existed (older readers and signed files see no change);
    # a field rule, not a serializer function: a signal arriving inside a serializer function
    # surfaces as pydantic's error, not as the signal's exception
    input_kind: InputKind = Field(
        "image", json_schema_extra=since("1.10"), exclude_if=lambda kind: kind == "image",
        description="image (C, H, W), series (C, T) or vector (D); left out of frames and files when image")
    input_shape: tuple[PositiveInt, ...] = Field(
        min_length=1, max_length=3, description="image: C, H, W; series: C, T; vector: D")
    num_classes: int = Field(ge=2)
    class_names: list[str] = Field(description="label i is class_names[i]; exactly num_classes names")
    pixel_scale: PositiveFloat = Field(PIXEL_SCALE, description="raw values times this; 1 for series and vectors")
    normalization: Normalization | None = None
    channel_names: list[str] | None = Field(
        None, min_length=1, json_schema_extra=since("1.10"), exclude_if=lambda names: names is None,
        description="a series' channels or a vector's features by name, in input order (a CSV log's columns, an "
                    "npz's channel_names); null or left out: unnamed. A reader of a named log takes its columns by "
                    "these names, in this order, whatever the file's column order")

    @model_validator(mode="before")
    @classmethod
    def _unscaled_unless_image(cls, data: Any) -> Any:
        # a series' or vector's raw values are the values: its default scale is 1, not 1/255
        if isinstance(data, dict) and data.get("input_kind", "image") != "image" and "pixel_scale" not in data:
            return {**data, "pixel_scale": 1.0}
        return data

    @field_validator("input_shape")
    @classmethod
    def _dimensions_of_the_kind(cls, shape: tuple[int, ...], info: ValidationInfo) -> tuple[int, ...]:
        # a field check, so that the error names run.data.input_shape (input_kind is validated first)
        kind = info.data.get("input_kind")
        if kind in INPUT_DIMS and len(shape) != INPUT_DIMS[kind]:
            raise ValueError(f"{'an' if kind == 'image' else 'a'} {kind} input has {INPUT_DIMS[kind]} dimensions, "
                             f"{list(shape)} has {len(shape)}")
        return shape

    @model_validator(mode="after")
    def _consistent(self) -> DataShape:
        if self.input_kind != "image" and self.pixel_scale != 1:
            raise ValueError(f"pixel_scale applies to images; a {self.input_kind}'s is 1, got {self.pixel_scale}")
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        if self.normalization is not None and len(self.normalization.mean) != self.input_shape[0]:
            raise ValueError(f"normalization has {len(self.normalization.mean)} channels, "
                             f"the input {self.input_shape[0]}")
        if self.channel_names is not None:
            if self.input_kind == "image":
                raise ValueError("channel_names name a series' channels or a vector's features, not an image's")
            if len(self.channel_names) != self.input_shape[0] or len(set(self.channel_names)) != len(self.channel_names):
                raise ValueError(f"channel_names must be {self.input_shape[0]} distinct names, "
                                 f"got {self.channel_names}")
        return self



class RunSpec(_Spec):
    """What to run: method, model, local training, the run's seed and its data's shape."""

    method: MethodChoice
    model: ModelSpec
    train: TrainConfig
    seed: int
    data: DataShape


def seed_for(*parts: object) -> int:
    """A 31-bit seed derived from ``parts`` (joined with ``/``, sha256, first 4 bytes): the
    coordinator's per-(run, round, agent) task seeds and an agent's initial-model seed, the
    same in every process and every implementation."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
