"""Typed configuration of a run (coordinator / simulation), loaded from YAML.

Every field is a typed pydantic field; a bad file raises :class:`ConfigError` whose
message names the file and the offending field. Method-specific options live under
``method:`` and are validated by that method's own config class. The agent's config is
:mod:`edgepfl.agent_config` and the YAML reading :mod:`edgepfl.config_loading`; both are
re-exported here for the apps and tests that read either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .agent_config import AgentConfig, load_agent_config
from .aggregation import AUTO, PER_UPDATE_BOUNDS, AggregationSpec
from .codec_stages import DELTA_CODECS, is_sparse
from .config_loading import (
    ConfigError,
    apply_overrides,
    load_config,
    load_yaml,
    load_yaml_bounded,
    parse_config,
    resolve_paths,
)
from .privacy import PrivacySpec
from .protocol.codec import DEFAULT_BLOCK, CodecName, UplinkSpec
from .protocol.run import DataShape, MethodChoice, Normalization, RunSpec, kind_of_shape
from .protocol.topics import check_segment
from .rollout import RolloutSpec
from .secagg import SecureAggregationSpec
from .simulation import SimulationSpec

if TYPE_CHECKING:  # pragma: no cover
    from .methods import Method

    DeltaChoice = str  # the names are the codec table's, which a static checker cannot read
else:
    #: a task or release delta's codec, or none: sent whole
    DeltaChoice = Literal[("none",) + DELTA_CODECS]

from .specs import (
    BrokerConfig,
    DataSpec,
    ModelSpec,
    PartitionSpec,
    SecuritySpec,
    TrainConfig,
    _Strict,
)

__all__ = [
    "AgentConfig", "AggregationSpec", "BrokerConfig", "ConfigError", "DataSpec", "MethodSpec", "ModelSpec",
    "AsynchronySpec", "ObserveSpec", "PartitionSpec", "RunConfig", "StragglerSpec", "RunSpec", "SecuritySpec",
    "TrainConfig", "apply_overrides", "load_agent_config", "load_run_config", "load_yaml", "load_yaml_bounded",
    "parse_config", "resolve_paths",
]


def get_method(name: str) -> type[Method]:
    """The registered method ``name`` (:func:`edgepfl.methods.get_method`), imported on first
    use: the registry imports every method module, which a head agent reading its own config
    never needs."""
    from .methods import get_method as registered

    return registered(name)


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


#: The round driver of each (asynchrony.mode, secure_aggregation.enabled) pair a run may ask
#: for, as the import path of its class (``module:Class``; the coordinator imports it, the
#: core only names it). A new round mode is its driver module plus its row here. A pair not
#: here is refused with its reason from :data:`NO_ROUND_DRIVER`.
ROUND_DRIVERS: dict[tuple[str, bool], str] = {
    ("sync", False): "edgepfl.coordinator.drivers.sync:SyncRounds",
    ("buffered", False): "edgepfl.coordinator.drivers.buffered:BufferedRounds",
    ("sync", True): "edgepfl.coordinator.drivers.secure:SecureRounds",
}
#: why a pair has no driver
NO_ROUND_DRIVER: dict[tuple[str, bool], str] = {
    ("buffered", True): "under secure_aggregation the coordinator sees only the sum of a round's updates: "
                        "asynchrony.mode must be sync (a buffered state folds updates in one by one)",
}


def round_driver(config: RunConfig) -> str:
    """The import path of the driver that runs ``config``'s training rounds (:data:`ROUND_DRIVERS`)."""
    return ROUND_DRIVERS[(config.asynchrony.mode, config.secure_aggregation.enabled)]


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
    min_task_interval_s: float = Field(
        0.0, ge=0, description="buffered: a device is sent its next training task no sooner than this many seconds "
                               "(the fleet's clock) after it was sent its last: each device's traffic is at most one "
                               "task and one update per interval, a budget for metered links, and a fast device's "
                               "share of the model falls toward a slow one's; 0: at once (FedBuff)")


class SitesSpec(_Strict):
    """Site aggregators between the devices of a site and this coordinator (docs/PROTOCOL.md §20)."""

    enabled: bool = Field(
        False, description="take site aggregators: a status of tier site (signed by its enrolled key on an enrolled "
                           "fleet) makes its site's devices this run's trainers, each round sends every site one task "
                           "for its sampled devices and folds its exact partial sum in, bit for bit the flat "
                           "fleet's. Needs a rule whose state is a sum (mean, clipped_mean; auto is then mean), a "
                           "method that averages each update (not fedpac), synchronous rounds (buffered ones with "
                           "mode summary), and neither secure aggregation nor differential privacy")
    mode: Literal["exact", "summary"] = Field(
        "exact", description="exact: each site lists its devices, this coordinator samples them as its own, keeps "
                             "their records and reads back every device's answer, so a round is the flat fleet's bit "
                             "for bit, at a cost per round that grows with the devices; summary: each site announces how "
                             "many devices it has, samples fraction of them itself, keeps their records and answers "
                             "with its partial sum and totals, so this coordinator's work per round grows with the "
                             "sites, not the devices (every online site is sent a task each round; min_agents, "
                             "quorum and a buffered run's buffer_size count sites, and a site's sum of an earlier "
                             "buffered state is folded in late; a site's devices' records are the site's word: "
                             "docs/SECURITY.md)")
    ids: list[str] = Field(
        default_factory=list, max_length=10_000,
        description="the agent ids that are site aggregators (each enrolled with its own key on an enrolled fleet): "
                    "a status of tier site from any other is refused, so that one device's credentials cannot make "
                    "it a site that speaks for devices it invented")

    @model_validator(mode="after")
    def _named(self) -> SitesSpec:
        if self.enabled and not self.ids:
            raise ValueError("sites.enabled needs sites.ids: the agent ids of the site aggregators")
        for site in self.ids:
            check_segment(site, "site id")
        return self


class CompressionSpec(_Strict):
    """Fewer bytes on the air: each trainer's update change compressed, and each release sent
    to a head agent that has the previous one as the change of its weights (docs/COMPRESSION.md)."""

    uplink: CodecName = Field(
        "none", description="the codec each training update's change is sent with, by every agent that announces it "
                            "(others send theirs uncompressed): q8 / q4 (stochastic 8- or 4-bit levels, one float32 "
                            "step per block), topk+q8 / topk+q4 (only the keep share of largest changes, quantized); "
                            "the device keeps what rounding and top-k leave out for its next update (error "
                            "feedback), and BatchNorm statistics go exact")
    block: int = Field(DEFAULT_BLOCK, ge=1, le=2**20, description="values sharing one float32 step (256: 1.6 % of "
                                                                      "an 8-bit payload)")
    keep: float = Field(0.1, gt=0, lt=1, description="top-k codecs: the share of each tensor's values sent")
    downlink: DeltaChoice = Field(
        "none", description="tasks: each new state's shared tensors are rounded onto the grid of their change since "
                            "the previous round's tasks (stochastic, unbiased: the adopted state itself), and an agent "
                            "that answered the previous round's task and announces the codec gets only that change "
                            "(synchronous rounds only); none: every task carries the state whole")
    release_delta: DeltaChoice = Field(
        "q4", description="releases: each release after the first is the previous one plus its weights' change "
                          "quantized with this codec (the signed artifact is that result, within one step of the "
                          "exported encoder; the error does not add up over releases), and a head agent that has "
                          "the previous release installed downloads only the change (about 13 % of the encoder "
                          "with q4, 25 % with q8); none: every release is the exported encoder, sent whole")

    def uplink_spec(self, exact: tuple[str, ...] = ()) -> UplinkSpec | None:
        """What a task asks a codec-capable agent for, or None when uplink is none."""
        if self.uplink == "none":
            return None
        return UplinkSpec(codec=self.uplink, block=self.block, keep=self.keep if is_sparse(self.uplink) else None,
                          exact=exact)


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
    min_head_agents: int = Field(0, ge=0, description="head agents the run's end (and with rollout.in_runs each "
                                                      "release) waits for, up to wait_for_agents_s, "
                                                      "to collect their reports on the last release; simulate "
                                                      "--head-agents sets it to the head agents it starts")
    quorum: float = Field(0.5, gt=0, le=1, description="share of sampled agents enough to close a round at timeout")
    aggregation: AggregationSpec = Field(
        default_factory=AggregationSpec,
        description="the rule that aggregates every method's shared parameters (default auto: a robust rule for an "
                    "enrolled fleet's small rounds, the weighted mean otherwise), "
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
    input_shape: list[int] | None = Field(
        None, min_length=1, max_length=3, description="image C,H,W; series C,T; vector D; default: from data")
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
                                         description="update compression on the uplink (protocol 1.6) and release "
                                                     "deltas on the downlink (1.7)")
    privacy: PrivacySpec = Field(default_factory=PrivacySpec,
                                 description="client-level differential privacy of the shared parameters (central)")
    secure_aggregation: SecureAggregationSpec = Field(
        default_factory=SecureAggregationSpec, description="secure aggregation of the shared parameters: the "
                                                           "coordinator sees only the sum of a round's updates")
    simulation: SimulationSpec = Field(
        default_factory=SimulationSpec, description="simulate --in-process: how the devices differ (compute, links, "
                                                    "availability); time there is virtual")
    sites: SitesSpec = Field(default_factory=SitesSpec,
                             description="site aggregators between a site's devices and this coordinator")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec,
                                 description="how edgepfl release publish rolls a release out: stages and their gate")
    release_ttl_s: float = Field(
        30 * 86400.0, gt=0, description="a release expires this long after it is published: head agents refuse to "
                                        "install it later (one that installed it keeps it)")

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        check_segment(self.federation, "federation")
        pair = (self.asynchrony.mode, self.secure_aggregation.enabled)
        if pair not in ROUND_DRIVERS:
            raise ValueError(NO_ROUND_DRIVER.get(pair, f"no round driver runs asynchrony.mode {pair[0]} with "
                                                       f"secure_aggregation.enabled {str(pair[1]).lower()}"))
        if self.privacy.mechanism != "none" or self.privacy.sampling != "fixed":
            self._check_privacy()
        if self.secure_aggregation.enabled:
            self._check_secure_aggregation()
        if self.sites.enabled:
            self._check_sites()
        if self.compression.downlink != "none" and self.asynchrony.mode == "buffered":
            raise ValueError("compression.downlink needs synchronous rounds: a buffered state's tasks go to agents "
                             "that last held states of many rounds (asynchrony.mode: synchronous, or downlink: none)")
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

    def _check_privacy(self) -> None:
        """What client-level DP cannot be combined with, refused here rather than weakened quietly."""
        if self.privacy.sampling == "poisson" and self.privacy.mechanism != "central":
            raise ValueError("privacy.sampling poisson draws each round's devices for the central mechanism's "
                             "accounting: it needs privacy.mechanism central (distributed noise is shared among a "
                             "quorum fixed before the round, which a Poisson round's size is not)")
        if self.privacy.mechanism == "distributed" and self.privacy.adaptive_clipping is not None:
            raise ValueError("privacy.adaptive_clipping counts the changes the coordinator's clip left whole: with "
                             "privacy.mechanism distributed the devices clip, and that count is not built; use central "
                             "or a fixed clip_norm")
        if self.privacy.mechanism == "distributed" and not self.secure_aggregation.enabled:
            raise ValueError("privacy.mechanism distributed adds the noise on the devices, which protects only a sum "
                             "the coordinator cannot see apart: it needs secure_aggregation.enabled")
        mechanism = f"privacy.mechanism {self.privacy.mechanism}"
        if self.asynchrony.mode != "sync":
            raise ValueError(f"{mechanism} accounts rounds of sampled devices: asynchrony.mode must be "
                             "sync (a buffered state mixes updates of many rounds)")
        if self.aggregation.rule not in ("mean", AUTO):
            raise ValueError(f"{mechanism} aggregates with its own clipped, noised mean: "
                             f"aggregation.rule must be mean, not {self.aggregation.rule}")
        if not get_method(self.method.name).streaming:
            raise ValueError(f"{mechanism} protects the shared parameters only; {self.method.name} "
                             "shares statistics of every update beside them (its server step needs them all)")

    def _check_sites(self) -> None:
        """What a site's partial sum cannot serve, refused when the run takes sites (docs/PROTOCOL.md §20)."""
        why = "sites.enabled: a site sends the exact sum of its devices' updates, not the updates"
        if self.aggregation.rule not in ("mean", "clipped_mean", AUTO):
            raise ValueError(f"{why}; aggregation.rule {self.aggregation.rule} needs every single update: use mean, "
                             "clipped_mean or auto")
        if not get_method(self.method.name).streaming:
            raise ValueError(f"{why}; {self.method.name}'s server step needs every update (it is not a mean)")
        if self.asynchrony.mode != "sync" and self.sites.mode != "summary":
            raise ValueError(f"{why}; buffered rounds take sites in summary (sites.mode: summary), where a site's "
                             "sum of an earlier state is folded in late, or use asynchrony.mode sync")
        if self.secure_aggregation.enabled or self.privacy.mechanism != "none":
            raise ValueError(f"{why}; neither secure aggregation nor differential privacy composes with it yet")

    def _check_secure_aggregation(self) -> None:
        """What needs the coordinator to see single updates, refused under secure aggregation
        (docs/SECURITY.md, "Secure aggregation": what per-update defences become)."""
        why = "under secure_aggregation the coordinator sees only the sum of a round's updates"
        if self.aggregation.rule not in ("mean", AUTO):
            raise ValueError(f"{why}: aggregation.rule {self.aggregation.rule} needs every update; use mean")
        if not get_method(self.method.name).streaming:
            raise ValueError(f"{why}: {self.method.name}'s server step needs every update (it is not a mean)")
        if self.privacy.mechanism == "central":
            raise ValueError(f"{why}: privacy.mechanism central clips each update at the coordinator; use "
                             "distributed (each device clips and noises its own)")
        if self.compression.uplink != "none":
            raise ValueError(f"{why}: a masked update cannot be compressed (compression.uplink: none)")
        # max_update_ratio judges each unmasked sum's mean change instead (SecureMean.out_of_bounds)
        bounds = [name for name in PER_UPDATE_BOUNDS if name != "max_update_ratio"
                  and name in self.aggregation.model_fields_set and getattr(self.aggregation, name) is not None]
        if bounds:
            raise ValueError(f"{why}: per-update bounds cannot apply ({', '.join(bounds)}); set them to null "
                             "(max_update_ratio judges each unmasked sum, max_change_ratio the round's aggregate)")
        if self.min_agents < 3:
            raise ValueError(f"{why}: min_agents must be at least 3 (the sum of two updates is each one's to the "
                             "other)")

    @property
    def staleness_limit(self) -> int | None:
        """How many rounds (buffered: states) late an update may be (``stragglers.max_staleness``; None: no bound)."""
        if self.privacy.mechanism != "none" or self.secure_aggregation.enabled:
            return 0  # a late update would count in a round it was not sampled for / masked for
        return self.stragglers.staleness_limit(self.asynchrony.mode)

    def method_config(self):
        return get_method(self.method.name).config_class.model_validate(self.method.options())

    def run_spec(self, input_shape: Sequence[int] | None = None, num_classes: int | None = None,
                 class_names: Sequence[str] | None = None,
                 normalization: Normalization | Mapping[str, Sequence[float]] | None = None,
                 channel_names: Sequence[str] | None = None) -> RunSpec:
        """This run as tasks, checkpoints and releases describe it, once its data's shape is known.

        The shape comes from the data (arguments, as :class:`edgepfl.data.ClientData`
        reports them) or, where an argument is absent, from this config's
        ``input_shape`` / ``num_classes`` / ``normalization``. Without class names, class
        ``i`` is named ``"i"``. The input kind follows from the shape's length (image 3,
        series 2, vector 1). ``channel_names`` (a series' or vector's, from its data) travel
        with the run so that devices read named logs by name.
        """
        input_shape = input_shape or self.input_shape
        num_classes = num_classes or self.num_classes
        if input_shape is None or num_classes is None:
            raise ConfigError("input_shape and num_classes are unknown: read them from the data or set them")
        if normalization and not isinstance(normalization, Normalization):
            normalization = Normalization.model_validate(dict(normalization))
        try:
            input_kind = kind_of_shape(input_shape)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        data = DataShape(
            input_kind=input_kind,
            input_shape=tuple(input_shape),
            num_classes=num_classes,
            class_names=list(class_names or [str(i) for i in range(num_classes)]),
            normalization=normalization or self.normalization,
            channel_names=list(channel_names) if channel_names else None,
        )
        return RunSpec(method=MethodChoice(name=self.method.name, options=self.method.options()),
                       model=self.model.model_copy(), train=self.train.model_copy(), seed=self.seed, data=data)


def load_run_config(path: str | Path, sets: Iterable[str] = (), **overrides: Any) -> RunConfig:
    """A :class:`RunConfig` from a YAML file: its paths resolved against the file's folder, then ``--set`` applied."""
    return load_config(RunConfig, path, sets, overrides)
