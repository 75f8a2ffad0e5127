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

from pydantic import BaseModel, ConfigDict, Field, JsonValue, PositiveFloat, PositiveInt, model_validator

from edgepfl.specs import ModelSpec, TrainConfig

__all__ = ["DataShape", "MethodChoice", "Normalization", "PIXEL_SCALE", "RunSpec"]

#: raw 8-bit pixel values (0..255) times this give the [0, 1] values normalization starts from
PIXEL_SCALE = 1 / 255


class _Spec(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())


class MethodChoice(_Spec):
    """A registered method's name and the options this run sets for it (JSON values)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    options: dict[str, JsonValue] = Field(default_factory=dict)


class Normalization(_Spec):
    """Per-channel standardization of scaled pixels: ``x[c] = (p[c] * pixel_scale - mean[c]) / std[c]``."""

    mean: list[float] = Field(min_length=1)
    std: list[PositiveFloat] = Field(min_length=1)

    @model_validator(mode="after")
    def _same_channels(self) -> Normalization:
        if len(self.mean) != len(self.std):
            raise ValueError(f"mean has {len(self.mean)} channels, std {len(self.std)}")
        return self


class DataShape(_Spec):
    """The shape of a run's data: model input, classes, and how raw pixels become inputs.

    ``normalization`` is ``None`` when the coordinator was given the input shape and
    class count without reading the data (then nobody can say how agents normalized).
    """

    input_shape: tuple[PositiveInt, PositiveInt, PositiveInt] = Field(description="C, H, W")
    num_classes: int = Field(ge=2)
    class_names: list[str] = Field(description="label i is class_names[i]; exactly num_classes names")
    pixel_scale: PositiveFloat = PIXEL_SCALE
    normalization: Normalization | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DataShape:
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        if self.normalization is not None and len(self.normalization.mean) != self.input_shape[0]:
            raise ValueError(f"normalization has {len(self.normalization.mean)} channels, "
                             f"the input {self.input_shape[0]}")
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
