"""Typed configuration: run (coordinator / simulation) and agent configs, loaded from YAML.

Every field is a typed pydantic field; a bad file raises :class:`ConfigError` whose
message names the file and the offending field. Method-specific options live under
``method:`` and are validated by that method's own config class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .aggregation import AggregationSpec
from .heads import OFFLINE_HEAD_KIND
from .methods import Method, available_head_kinds, get_method
from .protocol.run import DataShape, MethodChoice, Normalization, RunSpec
from .protocol.topics import check_segment
from .specs import BrokerConfig, DataSpec, ModelSpec, PartitionSpec, SecuritySpec, TrainConfig, _Strict

__all__ = [
    "AgentConfig", "AggregationSpec", "BrokerConfig", "ConfigError", "DataSpec", "MethodSpec", "ModelSpec",
    "PartitionSpec", "RunConfig", "RunSpec", "SecuritySpec", "TrainConfig", "load_agent_config", "load_run_config", "load_yaml",
    "parse_config",
]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file and field."""


class MethodSpec(BaseModel):
    """``name`` plus that method's options, validated against the method's config class."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"

    # Validated here rather than on RunConfig so that errors are located at
    # ``method.name`` / ``method.<option>`` in the message a user reads.
    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        try:
            get_method(name)
        except KeyError as exc:
            raise ValueError(str(exc.args[0])) from None
        return name

    @model_validator(mode="after")
    def _options(self) -> MethodSpec:
        get_method(self.name).config_class.model_validate(self.options())
        return self

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class RunConfig(_Strict):
    """Everything the coordinator needs to run a federation."""

    federation: str = "demo"
    method: MethodSpec = Field(default_factory=MethodSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataSpec = Field(default_factory=DataSpec)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    rounds: int = Field(10, ge=1)
    fraction: float = Field(1.0, gt=0, le=1, description="share of online agents sampled per round")
    min_agents: int = Field(2, ge=1, description="agents online before round 0 starts")
    quorum: float = Field(0.5, gt=0, le=1, description="share of sampled agents enough to close a round at timeout")
    aggregation: AggregationSpec = Field(
        default_factory=AggregationSpec,
        description="the rule that aggregates every method's shared parameters (default: the weighted mean), "
                    "and the guard on its result (max_change_ratio, rollback_after)")
    round_timeout_s: float = Field(120.0, gt=0)
    wait_for_agents_s: float = Field(300.0, gt=0)
    eval_every: int = Field(1, ge=1, description="agents not sampled are asked to evaluate every k rounds")
    eval_fraction: float = Field(
        1.0, gt=0, le=1,
        description="share of the online agents whose accuracy an evaluation round measures, round 0 included: "
                    "the trainers (each evaluates before training) plus a seeded sample of the others, who get "
                    "an evaluate task (1.0: all of them)")
    final_eval_fraction: float | None = Field(
        None, gt=0, le=1,
        description="the same share for the final evaluation, whose accuracy is the run's result "
                    "(default: eval_fraction)")
    expected_agents: int | None = Field(
        None, ge=1,
        description="trainer agents the fleet should have: fewer online (after the retained statuses came in, "
                    "or when a round starts) is logged as a warning that presence may be truncated")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    input_shape: list[int] | None = Field(None, min_length=3, max_length=3, description="C,H,W; default: from data")
    num_classes: int | None = Field(None, ge=2, description="default: from data")
    release_every: int | None = Field(None, ge=1, description="publish an encoder release every k rounds (and at the end)")
    release_at_end: bool = Field(False, description="export and publish the encoder when training ends")

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        check_segment(self.federation, "federation")
        return self

    def method_config(self):
        return get_method(self.method.name).config_class.model_validate(self.method.options())

    def run_spec(self, input_shape: Sequence[int] | None = None, num_classes: int | None = None,
                 class_names: Sequence[str] | None = None,
                 normalization: Mapping[str, Sequence[float]] | None = None) -> RunSpec:
        """This run as tasks, checkpoints and releases describe it, once its data's shape is known.

        The shape comes from the data (arguments, as :class:`edgepfl.data.ClientData`
        reports them) or, where an argument is absent, from this config's
        ``input_shape`` / ``num_classes``. Without class names, class ``i`` is named ``"i"``.
        """
        input_shape = input_shape or self.input_shape
        num_classes = num_classes or self.num_classes
        if input_shape is None or num_classes is None:
            raise ConfigError("input_shape and num_classes are unknown: read them from the data or set them")
        data = DataShape(
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            class_names=list(class_names or [str(i) for i in range(num_classes)]),
            normalization=Normalization.model_validate(dict(normalization)) if normalization else None,
        )
        return RunSpec(method=MethodChoice(name=self.method.name, options=self.method.options()),
                       model=self.model.model_copy(), train=self.train.model_copy(), seed=self.seed, data=data)


class AgentConfig(_Strict):
    """One edge agent: identity, tier, broker, its own data and where it keeps state."""

    agent_id: str
    federation: str = "demo"
    tier: Literal["trainer", "head"] = "trainer"
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    data: DataSpec = Field(default_factory=DataSpec)
    client_index: int = Field(0, ge=0, description="which partition of a pooled dataset (simulation)")
    state_dir: str = "agent-state"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    head: str = Field("lr", description="head tier: a head kind the releases' method offers (its head_kinds), "
                                        f"fitted on device, or {OFFLINE_HEAD_KIND!r}: only a head fitted offline")

    @field_validator("head")
    @classmethod
    def _known_head(cls, head: str) -> str:
        # the base kinds are offered by every method that keeps Method's default (FedAvg
        # does), so they need no look-up; the registry imports every method module, which
        # imports torch where it is installed — a head-tier device should not pay that
        if head == OFFLINE_HEAD_KIND or head in Method.head_kinds:
            return head
        kinds = available_head_kinds()
        if head not in kinds:
            raise ValueError(f"unknown head kind {head!r}; choose from {', '.join([*kinds, OFFLINE_HEAD_KIND])}")
        return head

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        check_segment(self.agent_id, "agent_id")
        check_segment(self.federation, "federation")
        return self


def _format(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        lines.append(f"  {loc}: {err.get('msg')}")
    return "\n".join(lines)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def parse_config(kind: type[BaseModel], data: dict[str, Any], source: str = "<dict>"):
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, source)) from None


def load_run_config(path: str | Path, **overrides: Any) -> RunConfig:
    data = load_yaml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_config(RunConfig, data, str(path))


def load_agent_config(path: str | Path, **overrides: Any) -> AgentConfig:
    data = load_yaml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_config(AgentConfig, data, str(path))
