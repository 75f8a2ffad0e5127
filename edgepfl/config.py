"""Typed configuration: run (coordinator / simulation) and agent configs, loaded from YAML.

Every field is a typed pydantic field; a bad file raises :class:`ConfigError` whose
message names the file and the offending field. Method-specific options live under
``method:`` and are validated by that method's own config class.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .aggregation import AggregationSpec
from .heads import GENERIC_HEAD_KINDS, OFFLINE_HEAD_KIND
from .protocol.bounded_json import MAX_DEPTH
from .protocol.codec import DEFAULT_BLOCK, CodecName, UplinkSpec
from .protocol.run import DataShape, MethodChoice, Normalization, RunSpec
from .protocol.topics import check_segment
from .simulation import DevicePace, SimulationSpec

if TYPE_CHECKING:  # pragma: no cover
    from .methods import Method

from .specs import (
    BrokerConfig,
    ConfigPath,
    DataSpec,
    ModelSpec,
    PartitionSpec,
    PathField,
    SecuritySpec,
    TrainConfig,
    _Strict,
)

__all__ = [
    "AgentConfig", "AggregationSpec", "BrokerConfig", "ConfigError", "DataSpec", "MethodSpec", "ModelSpec",
    "AsynchronySpec", "ObserveSpec", "PartitionSpec", "RunConfig", "StragglerSpec", "RunSpec", "SecuritySpec",
    "TrainConfig", "apply_overrides", "load_agent_config", "load_run_config", "load_yaml", "parse_config",
    "resolve_paths",
]


def get_method(name: str) -> type[Method]:
    """The registered method ``name`` (:func:`edgepfl.methods.get_method`), imported on first
    use: the registry imports every method module, which a head agent reading its own config
    never needs."""
    from .methods import get_method as registered

    return registered(name)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file and field."""


class MethodSpec(BaseModel):
    """``name`` plus that method's options, validated against the method's config class."""

    model_config = ConfigDict(defer_build=True, extra="allow")
    name: str = Field("fedavg", description="a registered method (edgepfl methods)")

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


class ObserveSpec(_Strict):
    """How operators watch a running federation: the JSON fleet view and Prometheus metrics."""

    view: bool = Field(True, description="publish the retained JSON fleet view on edgepfl/v1/<federation>/view")
    view_interval_s: float = Field(1.0, gt=0, description="at most one view per interval (presence changes in "
                                                          "between are batched); phase changes publish at once")
    view_heartbeat_s: float = Field(30.0, gt=0, description="republish an unchanged view this often (fresh 'updated')")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     description="serve Prometheus /metrics on this port (0: any free port); off if unset")
    metrics_host: str = Field("127.0.0.1", description="address the metrics endpoint binds (0.0.0.0: every interface)")


#: rounds (sync) or states (buffered) an update may be late by default. Buffered: no bound
#: by count, so no device is too slow to count (a 50-device fleet with a state per 10
#: updates saw its slowest devices' updates arrive 17 to 20 states late, every one of them
#: refused under a bound of 16); the discount weighs them down, and a state is kept only
#: while a task built from it is unanswered
DEFAULT_MAX_STALENESS: dict[str, int | None] = {"sync": 2, "buffered": None}


class StragglerSpec(_Strict):
    """What a synchronous round does with a device that answers after it closed."""

    max_staleness: int | None = Field(
        None, ge=0, description="a training update that arrives up to this many rounds (buffered: states) after its "
                                "round closed, from a device that round dropped (buffered: any), is applied to the "
                                "open round's aggregate, its change discounted by its staleness; later ones (and every "
                                "late one for a method whose server step is not an average of the round's updates: "
                                "FedPAC) are rejected 'stale'; 0: none; null: 2 rounds (sync), no bound (buffered: "
                                "each state is kept while a task built from it is unanswered; set one to bound that "
                                "memory on a large fleet with a large model)")

    def staleness_limit(self, mode: str) -> int | None:
        """``max_staleness``, or its default for ``mode`` (``sync`` or ``buffered``; None: no bound)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return DEFAULT_MAX_STALENESS[mode]

    staleness_exponent: float = Field(
        0.5, ge=0, description="a late update's change counts (1 + staleness) ** -exponent, staleness in rounds "
                               "(FedBuff's discount; 0.5: 0.71 for one round late, 0.58 for two)")


class AsynchronySpec(_Strict):
    """Synchronous rounds, or buffered asynchronous ones (FedBuff)."""

    mode: Literal["sync", "buffered"] = Field(
        "sync", description="sync: rounds with a deadline, every sampled agent trains on the same state; buffered: "
                            "every online trainer trains continuously on the freshest state it was sent, and each "
                            "buffer_size accepted updates (changes discounted by staleness, stragglers) make the "
                            "next state: a row of metrics.jsonl per state (rounds counts states)")
    buffer_size: int = Field(10, ge=1, description="buffered: accepted updates folded into one new state (K), "
                                                     "at most one per device: keep it at or below the number of "
                                                     "trainers (a state short of it closes at round_timeout_s)")


class CompressionSpec(_Strict):
    """Fewer bytes on the uplink: each trainer's update change compressed (docs/COMPRESSION.md)."""

    uplink: CodecName = Field(
        "none", description="the codec each training update's change is sent with, by every agent that announces it "
                            "(others send theirs uncompressed): q8 / q4 (stochastic 8- or 4-bit levels, one float32 "
                            "step per block), topk+q8 / topk+q4 (only the keep share of largest changes, quantized); "
                            "the device keeps what rounding and top-k leave out for its next update (error "
                            "feedback), and BatchNorm statistics go exact")
    block: int = Field(DEFAULT_BLOCK, ge=1, le=2**20, description="values sharing one float32 step (256: 1.6 % of "
                                                                      "an 8-bit payload)")
    keep: float = Field(0.1, gt=0, lt=1, description="top-k codecs: the share of each tensor's values sent")

    def uplink_spec(self, exact: tuple[str, ...] = ()) -> UplinkSpec | None:
        """What a task asks a codec-capable agent for, or None when uplink is none."""
        if self.uplink == "none":
            return None
        return UplinkSpec(codec=self.uplink, block=self.block, keep=self.keep if self.uplink.startswith("topk+")
                          else None, exact=exact)


class RunConfig(_Strict):
    """Everything the coordinator needs to run a federation."""

    federation: str = Field("demo", description="the federation's name: the first MQTT topic segment; agents "
                                                 "must use the same")
    method: MethodSpec = Field(default_factory=MethodSpec)
    model: ModelSpec = Field(default_factory=ModelSpec)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataSpec = Field(default_factory=DataSpec)
    broker: BrokerConfig = Field(default_factory=BrokerConfig)
    security: SecuritySpec = Field(default_factory=SecuritySpec)
    rounds: int = Field(10, ge=1, description="training rounds")
    time_budget_s: float | None = Field(
        None, gt=0, description="stop training once this many seconds have passed since this coordinator session "
                                "started (the fleet's clock: virtual in a simulation), even before rounds, then run "
                                "the final evaluation; null: rounds alone decide")
    fraction: float = Field(1.0, gt=0, le=1, description="share of online agents sampled per round")
    min_agents: int = Field(2, ge=1, description="agents online before round 0 starts")
    min_head_agents: int = Field(0, ge=0, description="head agents the run's end waits for (up to wait_for_agents_s) "
                                                      "to collect their reports on the last release; simulate "
                                                      "--head-agents sets it to the head agents it starts")
    quorum: float = Field(0.5, gt=0, le=1, description="share of sampled agents enough to close a round at timeout")
    aggregation: AggregationSpec = Field(
        default_factory=AggregationSpec,
        description="the rule that aggregates every method's shared parameters (default: the weighted mean), "
                    "and the guard on its result (max_change_ratio, rollback_after)")
    round_timeout_s: float = Field(120.0, gt=0, description="a round closes at this deadline with whoever answered "
                                                            "(if quorum is met)")
    wait_for_agents_s: float = Field(300.0, gt=0, description="how long to wait for min_agents before round 0")
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
    seed: int = Field(0, description="seeds sampling, model initialisation and every agent's local training")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="the coordinator's torch device (auto: cuda "
                                                                         "when available)")
    input_shape: list[int] | None = Field(None, min_length=3, max_length=3, description="C,H,W; default: from data")
    num_classes: int | None = Field(None, ge=2, description="default: from data")
    normalization: Normalization | None = Field(
        None, description="per-channel mean and std of the agents' inputs, sent in every task; default: from data")
    release_every: int | None = Field(None, ge=1, description="publish an encoder release every k rounds (and at the end)")
    release_at_end: bool = Field(False, description="export and publish the encoder when training ends")
    observe: ObserveSpec = Field(default_factory=ObserveSpec, description="fleet view and Prometheus metrics")
    asynchrony: AsynchronySpec = Field(default_factory=AsynchronySpec,
                                       description="synchronous rounds, or buffered asynchronous ones (FedBuff)")
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec,
                                      description="what happens to an update that arrives after its round closed")
    compression: CompressionSpec = Field(default_factory=CompressionSpec,
                                         description="update compression on the uplink (protocol 1.6)")
    simulation: SimulationSpec = Field(
        default_factory=SimulationSpec, description="simulate --in-process: how the devices differ (compute, links, "
                                                    "availability); time there is virtual")
    release_ttl_s: float = Field(
        30 * 86400.0, gt=0, description="a release expires this long after it is published: head agents refuse to "
                                        "install it later (one that installed it keeps it)")

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        check_segment(self.federation, "federation")
        agg = self.aggregation
        if agg.rule == "multi_krum" and agg.krum_select is not None and agg.krum_select >= self.min_agents:
            raise ValueError(f"aggregation.krum_select {agg.krum_select} averages every update of a round of "
                             f"min_agents = {self.min_agents}: multi_krum would drop nothing; choose fewer")
        if self.asynchrony.mode == "buffered" and not get_method(self.method.name).streaming:
            raise ValueError(f"asynchrony.mode buffered: {self.method.name}'s server step needs every update of a "
                             "synchronous round together (it is not an average of each update's shared parts); "
                             "use mode: sync")
        return self

    def quorum_of(self, sampled: int) -> int:
        """Updates that close a round of ``sampled`` agents at its deadline."""
        return math.ceil(self.quorum * sampled)

    @property
    def staleness_limit(self) -> int | None:
        """How many rounds (buffered: states) late an update may be (``stragglers.max_staleness``; None: no bound)."""
        return self.stragglers.staleness_limit(self.asynchrony.mode)

    def method_config(self):
        return get_method(self.method.name).config_class.model_validate(self.method.options())

    def run_spec(self, input_shape: Sequence[int] | None = None, num_classes: int | None = None,
                 class_names: Sequence[str] | None = None,
                 normalization: Normalization | Mapping[str, Sequence[float]] | None = None) -> RunSpec:
        """This run as tasks, checkpoints and releases describe it, once its data's shape is known.

        The shape comes from the data (arguments, as :class:`edgepfl.data.ClientData`
        reports them) or, where an argument is absent, from this config's
        ``input_shape`` / ``num_classes`` / ``normalization``. Without class names, class
        ``i`` is named ``"i"``.
        """
        input_shape = input_shape or self.input_shape
        num_classes = num_classes or self.num_classes
        if input_shape is None or num_classes is None:
            raise ConfigError("input_shape and num_classes are unknown: read them from the data or set them")
        if normalization and not isinstance(normalization, Normalization):
            normalization = Normalization.model_validate(dict(normalization))
        data = DataShape(
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            class_names=list(class_names or [str(i) for i in range(num_classes)]),
            normalization=normalization or self.normalization,
        )
        return RunSpec(method=MethodChoice(name=self.method.name, options=self.method.options()),
                       model=self.model.model_copy(), train=self.train.model_copy(), seed=self.seed, data=data)


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


def _format(exc: ValidationError, source: str) -> str:
    problems = [f"{'.'.join(str(p) for p in err.get('loc', ())) or '<root>'}: {err.get('msg')}" for err in exc.errors()]
    return f"invalid config {source}: " + "; ".join(problems)


#: the most nodes a YAML document may stand for once its aliases are expanded: a config
#: is a few hundred; a "billion laughs" of nested aliases is what this stops
MAX_YAML_NODES = 100_000


def load_yaml_bounded(text: str) -> Any:
    """``yaml.safe_load(text)``, after checking on the event stream (which PyYAML produces
    without recursing) that collections nest at most :data:`MAX_DEPTH` deep and that the
    document, its aliases expanded, has at most :data:`MAX_YAML_NODES` nodes. Either
    excess is a :class:`yaml.YAMLError`: the composer would otherwise recurse once per
    level (RecursionError) or a validator walk every expanded alias."""
    sizes: list[list] = [[None, 0]]  # per open collection: its anchor, its expanded node count
    anchored: dict[str, int] = {}
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            if len(sizes) > MAX_DEPTH:
                raise yaml.YAMLError(f"collections nest more than {MAX_DEPTH} deep")
            sizes.append([event.anchor, 1])
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, size = sizes.pop()
            if anchor is not None:
                anchored[anchor] = size
            sizes[-1][1] += size
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchored[event.anchor] = 1
            sizes[-1][1] += 1
        elif isinstance(event, yaml.AliasEvent):
            sizes[-1][1] += anchored.get(event.anchor, 1)
        if sizes[-1][1] > MAX_YAML_NODES:
            raise yaml.YAMLError(f"more than {MAX_YAML_NODES} nodes once aliases are expanded")
    return yaml.safe_load(text)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; :class:`ConfigError` when it is missing or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = load_yaml_bounded(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML in {path}: {' '.join(str(exc).split())}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return data


def parse_config(kind: type[BaseModel], data: dict[str, Any], source: str = "<dict>"):
    """Validate ``data`` as ``kind``; :class:`ConfigError` naming ``source`` and every bad field."""
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format(exc, source)) from None


def apply_overrides(data: dict[str, Any], assignments: Iterable[str]) -> dict[str, Any]:
    """``data`` with ``key.path=value`` assignments applied (``--set``); values are YAML (``3``, ``[1, 2]``, ``null``).

    Intermediate mappings are created; :class:`ConfigError` for a malformed assignment or
    a key path through a value that is not a mapping.
    """
    out = dict(data)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"--set {assignment!r}: expected key.path=value, e.g. --set train.lr=0.05")
        try:
            value = load_yaml_bounded(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"--set {assignment!r}: the value is not valid YAML ({' '.join(str(exc).split())})") from None
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {assignment!r}: {'.'.join(parts[:depth + 1])} is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of ``X | None`` / ``Optional[X]`` (or ``[annotation]``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_path(annotation: Any) -> bool:
    return any(typing.get_origin(a) is typing.Annotated and any(isinstance(m, PathField) for m in a.__metadata__)
               for a in _unwrap(annotation))


def resolve_paths(kind: type[BaseModel], data: dict[str, Any], base: Path) -> dict[str, Any]:
    """``data`` (raw YAML for ``kind``) with every relative :data:`~edgepfl.specs.ConfigPath` joined to ``base``.

    ``~`` is expanded; absolute paths and values of the wrong type are left to validation.
    """
    out = dict(data)
    hints = typing.get_type_hints(kind, include_extras=True)
    for name, field in kind.model_fields.items():
        key = field.alias or name
        if key not in out:
            continue
        annotation = hints.get(name, field.annotation)
        value = out[key]
        if _is_path(annotation) and isinstance(value, str) and value:
            path = Path(value).expanduser()
            out[key] = str(path if path.is_absolute() else base / path)
            continue
        models = [a for a in _unwrap(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if models and isinstance(value, dict):
            out[key] = resolve_paths(models[0], value, base)
    return out


def _load(kind: type[BaseModel], path: str | Path, sets: Iterable[str], overrides: dict[str, Any]):
    path = Path(path)
    data = resolve_paths(kind, load_yaml(path), path.expanduser().absolute().parent)
    sets = list(sets)
    data = apply_overrides(data, sets)
    data.update({k: v for k, v in overrides.items() if v is not None})
    source = str(path) + (f" (with --set {', '.join(sets)})" if sets else "")
    return parse_config(kind, data, source)


def load_run_config(path: str | Path, sets: Iterable[str] = (), **overrides: Any) -> RunConfig:
    """A :class:`RunConfig` from a YAML file: its paths resolved against the file's folder, then ``--set`` applied."""
    return _load(RunConfig, path, sets, overrides)


def load_agent_config(path: str | Path, sets: Iterable[str] = (), **overrides: Any) -> AgentConfig:
    """An :class:`AgentConfig` from a YAML file, like :func:`load_run_config`."""
    return _load(AgentConfig, path, sets, overrides)
