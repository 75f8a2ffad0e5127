"""The edge agent's config: identity, tier, broker, its own data and where it keeps state.

Apart from :mod:`edgepfl.config` (the run's config, which carries the aggregation, simulation
and method models) so that an agent — a head agent on a Raspberry Pi above all — reads its
config without importing the coordinator's side.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .config_loading import load_config
from .heads import GENERIC_HEAD_KINDS, OFFLINE_HEAD_KIND
from .protocol.topics import check_segment
from .simulation import DevicePace
from .specs import BrokerConfig, ConfigPath, DataSpec, SecuritySpec, _Strict

__all__ = ["DEFAULT_MAX_MODEL_PARAMS", "AgentConfig", "load_agent_config"]

#: the most parameters a trainer builds a task's model with, by default: twice the largest model of
#: the shipped configs (FedRIR's, 2.5 million on 28x28 images) and MobileNetV3-Small's 0.9 to 3.7
#: million pass; ResNet-18 (11.2 million) must be allowed by the agent's config
DEFAULT_MAX_MODEL_PARAMS = 5_000_000


class AgentConfig(_Strict):
    """One edge agent: identity, tier, broker, its own data and where it keeps state."""

    agent_id: str = Field(description="this device's name, unique in the federation ([A-Za-z0-9_-]); the broker "
                                      "ACL can confine it to its own topics")
    federation: str = Field("demo", description="the federation to join (the coordinator's federation)")
    tier: Literal["trainer", "head"] = Field("trainer", description="trainer: torch, full local training; head: "
                                                                     "ONNX encoder releases + a personal head, no torch")
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    data: DataSpec = Field(default_factory=DataSpec)
    client_index: int = Field(0, ge=0, description="which partition of a pooled dataset (simulation)")
    state_dir: ConfigPath = Field("agent-state", description="where the agent keeps its state (releases, heads, "
                                                             "personal parameters); relative: to the working directory")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="trainer tier: torch device")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    head: str = Field("lr", description="head tier: a head kind the releases' method offers (its head_kinds), "
                                        f"fitted on device, or {OFFLINE_HEAD_KIND!r}: only a head fitted offline")
    pace: DevicePace | None = Field(None, description="simulation (trainer tier): answer no sooner than a device of "
                                                      "this pace would; none: as fast as this machine can")
    max_model_params: int | None = Field(
        DEFAULT_MAX_MODEL_PARAMS, ge=1,
        description="trainer tier: the most parameters a task's model may have; a task with a larger one is refused "
                    "(unsupported_arch) before it is built (counted on torch's meta device, no memory). The default "
                    "passes every shipped config; ResNet-18 needs 12000000. none: no limit")

    @field_validator("head")
    @classmethod
    def _known_head(cls, head: str) -> str:
        # the base kinds are offered by every method that keeps Method's default (FedAvg
        # does), so they need no look-up; the registry imports every method module, which
        # imports torch where it is installed — a head-tier device should not pay that
        if head == OFFLINE_HEAD_KIND or head in GENERIC_HEAD_KINDS:
            return head
        from .methods import available_head_kinds

        kinds = available_head_kinds()
        if head not in kinds:
            raise ValueError(f"unknown head kind {head!r}; choose from {', '.join([*kinds, OFFLINE_HEAD_KIND])}")
        return head

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        check_segment(self.agent_id, "agent_id")
        check_segment(self.federation, "federation")
        return self


def load_agent_config(path: str | Path, sets: Iterable[str] = (), **overrides: Any) -> AgentConfig:
    """An :class:`AgentConfig` from a YAML file, like :func:`load_run_config`."""
    return load_config(AgentConfig, path, sets, overrides)
