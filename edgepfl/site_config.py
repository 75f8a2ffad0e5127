"""The config of ``edgepfl aggregator``, a site aggregator (docs/PROTOCOL.md §20): who it is
at the central coordinator, how it reaches it, and the coordinator it is to its site."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from .config import RunConfig
from .config_loading import load_config
from .protocol.topics import NAME_PATTERN
from .specs import BrokerConfig, ConfigPath, SecuritySpec, _Strict


class CentralLink(_Strict):
    """The aggregator's side of the central federation: one participant of it."""

    federation: str = Field("demo", description="the central coordinator's federation")
    broker: BrokerConfig = Field(default_factory=BrokerConfig, description="the central broker")
    security: SecuritySpec = Field(
        default_factory=SecuritySpec,
        description="signing_key: the aggregator's own key, enrolled at the central coordinator under site_id; "
                    "coordinator_key: the central coordinator's public key, whose tasks alone it acts on")


class AggregatorConfig(_Strict):
    """``edgepfl aggregator --config site.yaml``."""

    site_id: str = Field(pattern=NAME_PATTERN, description="the aggregator's agent id at the central coordinator")
    mode: Literal["exact", "summary"] = Field(
        "exact", description="what its status tells the central coordinator (whose sites.mode must be the same): "
                             "exact, every online device; summary, how many there are (it then draws its own devices "
                             "each round and keeps their records). It runs either kind of task it is sent")
    state_dir: ConfigPath | None = Field(
        None, description="where a summary site keeps its devices' records (records.json, written atomically), so "
                          "that a restart judges them as before; None: in memory, forgotten on restart")
    central: CentralLink = Field(default_factory=CentralLink)
    site: RunConfig = Field(
        default_factory=RunConfig,
        description="the coordinator it is to its site's devices: their federation, broker and keys (security: its "
                    "own signing key, which the devices pin, and their enrolled dir), round_timeout_s and quorum of "
                    "its rounds, and the method and model its devices must run (the central run's)")


def load_aggregator_config(path: str | Path, sets: Iterable[str] = (), **overrides: Any) -> AggregatorConfig:
    """An :class:`AggregatorConfig` from a YAML file (paths resolved against its folder, ``--set`` applied)."""
    return load_config(AggregatorConfig, path, sets, overrides)


__all__ = ["AggregatorConfig", "CentralLink", "load_aggregator_config"]
