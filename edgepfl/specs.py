"""The leaf types of a configuration: model, training, data and broker specs.

They depend on nothing else in edgepfl, so every layer (data, models, methods, the
protocol's run spec, the apps) can use them without importing the method registry
that validates whole run configurations (:mod:`edgepfl.config`).
"""

from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from .atomic import read_private


class PathField:
    """Marks a ``str`` field as a file or folder path (see :data:`ConfigPath`)."""

    def __repr__(self) -> str:
        return "PathField()"


#: A path in a configuration. The config loaders (:func:`edgepfl.config.load_run_config`,
#: :func:`~edgepfl.config.load_agent_config`) resolve a relative one against the folder of
#: the YAML file that sets it and expand ``~``; given in Python or by ``--set``, it is
#: taken as it is (relative to the working directory).
ConfigPath = Annotated[str, PathField()]


class _Strict(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())


#: the encoders edgepfl builds itself (docs/MODELS.md); any other ``model.arch`` names a plugin
BuiltinArch = Literal["cnn", "cnn1d", "fedpac_cnn", "mlp", "resnet18", "mobilenet_v3_small", "identity"]
#: how a plugin encoder is named: ``module:callable`` (an import path) or an ``edgepfl.models`` entry point's name
PLUGIN_ARCH_PATTERN = r"^[A-Za-z_][\w.-]*(:[A-Za-z_][\w.]*)?$"
PluginArch = Annotated[str, StringConstraints(pattern=PLUGIN_ARCH_PATTERN, max_length=200)]



def is_import_path(arch: str) -> bool:
    """Whether ``arch`` is a plugin's import path ``module:callable`` (not a built-in or an entry point's name)."""
    return ":" in arch


class ModelSpec(_Strict):
    """Which network to build. Weights are only ever read from a local file."""

    arch: BuiltinArch | PluginArch = Field(
        "cnn", description="'identity': inputs already are feature vectors, the encoder only flattens them "
                           "(how a method's head is fitted on an exported encoder's features); 'fedpac_cnn': the "
                           "CNN of FedPAC's published code (16 / 32 channels, LeakyReLU; with norm: none as there); "
                           "'cnn1d': series C x T; 'mlp': any input, flattened. Any other value is your own encoder "
                           "(docs/MODELS.md, \"Your own encoder\"): 'module:callable', an import path, or the name "
                           "of an installed edgepfl.models entry point; every trainer must be able to import it, "
                           "a head agent needs only the exported ONNX encoder"
    )
    feature_dim: int = Field(128, ge=2, description="encoder output size (cnn / fedpac_cnn / cnn1d / mlp / your own)")
    norm: Literal["batch", "none"] = Field(
        "batch", description="BatchNorm in the encoder, or none (your own encoder: none forbids BatchNorm layers)")
    weights: ConfigPath | None = Field(None, description="local state_dict file for resnet18 / mobilenet_v3_small")

    @field_validator("arch", mode="before")
    @classmethod
    def _one_line_for_a_bad_arch(cls, value: object) -> object:
        """One message for an arch that is neither a built-in nor a plugin's name (not one per union member)."""
        if isinstance(value, str) and value not in typing.get_args(BuiltinArch) and (
                len(value) > 200 or not re.match(PLUGIN_ARCH_PATTERN, value)):
            raise ValueError(f"{value!r} is neither a built-in encoder ({', '.join(typing.get_args(BuiltinArch))}) nor "
                             "a plugin encoder's 'module:callable' or entry-point name")
        return value


class TrainConfig(_Strict):
    """Local optimisation defaults; methods may override per phase."""

    epochs: int = Field(1, ge=1, description="local epochs per round")
    batch_size: int = Field(50, ge=1, description="local mini-batch size")
    lr: float = Field(0.01, gt=0, description="local learning rate")
    momentum: float = Field(0.5, ge=0, description="SGD momentum")
    weight_decay: float = Field(5e-4, ge=0, description="L2 weight decay")
    optimizer: Literal["sgd", "adam"] = Field("sgd", description="local optimizer")
    # added in protocol 1.11, and left out of frames, manifests and checkpoints while null so
    # that a run without it is byte for byte what it was (older readers and signed files see no
    # change); the mark is protocol.evolution.since's, written out here because the protocol
    # package imports this module
    max_grad_norm: float | None = Field(
        None, gt=0, json_schema_extra={"x-since": "1.11"}, exclude_if=lambda norm: norm is None,
        description="clip each local step's gradient to this L2 norm over the parameters the phase trains (null: "
                    "no clip; trainers of protocol 1.11 only). A stabiliser for local training at the edge of "
                    "stability, such as a personal head that sharpens over many tasks (docs/SECURITY.md, 'Honest "
                    "devices the bound still clips')")


class PartitionSpec(_Strict):
    """How a pooled dataset is split over clients (simulation and benchmarks)."""

    kind: Literal["iid", "dirichlet", "pathological", "dominant", "domain"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")
    uniform_fraction: float = Field(0.2, ge=0, le=1, description="dominant: share drawn uniformly over classes")
    dominant_sets: list[list[int]] | None = Field(
        None, description="dominant: client i draws the rest evenly from the classes dominant_sets[i % len]; null: "
                          "one class, i mod the number of classes. FedPAC's code for Fashion-MNIST: [[0,1,2],[2,3,4],"
                          "[4,5,6],[6,7,8],[8,9,0]]")
    domains: list[str] = Field(
        default_factory=lambda: ["identity", "rot90", "invert", "noise"],
        description="domain: transforms, client i gets domains[i % len]",
    )
    shift: list[str] | None = Field(
        None, min_length=1,
        description="any kind but domain: a transform on top of the label split, client i gets shift[i % len]; [gain] "
                    "gives every device its own sensor gain and offset per channel (docs/DATA.md)")

    @model_validator(mode="after")
    def _check_dominant_sets(self) -> PartitionSpec:
        if self.shift is not None and self.kind == "domain":
            raise ValueError("shift is for the label partitions; kind domain gives each client its transform in "
                             "domains")
        if self.dominant_sets == []:
            raise ValueError("dominant_sets: give at least one set, or null for one class per client")
        for group in self.dominant_sets or []:
            if not group or len(set(group)) != len(group) or min(group) < 0:
                raise ValueError(f"dominant_sets: each set must name distinct classes >= 0, got {group}")
        return self


class InputSpec(_Strict):
    """What one sample of the data is, and how its channels are normalized (docs/DATA.md)."""

    kind: Literal["auto", "image", "series", "vector"] = Field(
        "auto", description="image (C, H, W), series (C channels x T steps) or vector (D features); auto: from the "
                            "npz array x: (N, D) a vector, (N, C, H, W) an image, (N, H, W) an image when it is "
                            "uint8 or its values lie in 0..255 (integers) or [0, 1] (floats), else a series (N, C, T); "
                            "csv: a series")
    mean: list[float] | None = Field(
        None, min_length=1, description="per-channel mean of the raw values (images: in [0, 1] units); with std, "
                                        "used in place of the statistics the loader computes")
    std: list[float] | None = Field(None, min_length=1, description="per-channel standard deviation, each > 0")

    @model_validator(mode="after")
    def _both_or_neither(self) -> InputSpec:
        if (self.mean is None) != (self.std is None):
            raise ValueError("give both mean and std, or neither")
        if self.mean is not None and self.std is not None:
            if len(self.mean) != len(self.std):
                raise ValueError(f"mean has {len(self.mean)} channels, std {len(self.std)}")
            if min(self.std) <= 0:
                raise ValueError("every std must be positive")
        return self


class CsvSpec(_Strict):
    """A sensor log as CSV: one row per time step, cut into windows of ``window`` rows (docs/DATA.md)."""

    label: str = Field("label", description="the column holding each row's class")
    channels: list[str] | None = Field(
        None, min_length=1, description="the columns that are the series' channels, in order; null: every other "
                                        "column, all of which must be numeric")
    segment: str | None = Field(
        None, description="a column whose value changes where a recording starts (another wearer, a gap): no window "
                          "spans two segments")
    window: int = Field(100, ge=1, description="rows (time steps) per window")
    stride: int = Field(50, ge=1, description="rows from one window's start to the next's")
    classes: list[str] | None = Field(
        None, min_length=2, description="the class names in label order, so devices lacking a class agree on "
                                        "indices; null: the labels found, sorted (numerically when all are numbers)")


class DataSpec(_Strict):
    """Where a client's data comes from."""

    dataset: Literal["fmnist", "digits", "torchvision", "imagefolder", "npz", "csv", "ts", "auto"] = Field(
        "auto", description="auto: Fashion-MNIST where it is installed (or $EDGEPFL_FMNIST_ROOT), else scikit-learn's "
                            "digits; ts: labelled series in the time-series archive's .ts format (docs/DATA.md)")
    root: ConfigPath | None = Field(
        None, description="fmnist: folder of the four IDX files (default: Debian's); imagefolder: folder of "
                          "<class>/<image>; npz: the .npz file; csv: the .csv file; torchvision: the dataset's local "
                          "root; ts: a .ts file, or a folder of <name>_TRAIN.ts / <name>_TEST.ts (null: set name as "
                          "the sensors extra ships it)")
    input: InputSpec = Field(default_factory=InputSpec, description="what a sample is and how it is normalized")
    csv: CsvSpec = Field(default_factory=CsvSpec, description="dataset csv: the columns and the windows")
    name: str | None = Field(None, description="torchvision: the dataset class name, e.g. CIFAR10; ts: the set's "
                                               "name, e.g. BasicMotions (BasicMotions_TRAIN: that split alone)")
    num_clients: int = Field(8, ge=1, description="partitions of a pooled dataset (one per agent); a device with "
                                                   "its own data: 1")
    samples_per_client: int | None = Field(None, ge=1, description="cap on each client's samples; null: its whole "
                                                                   "partition")
    partition: PartitionSpec = Field(default_factory=PartitionSpec)
    test_fraction: float = Field(0.25, gt=0, lt=1, description="held-out share of each client's data "
                                                                "(personalized evaluation)")
    seed: int = Field(0, description="seeds the partition and the train / test split")


#: ``broker.url`` of a broker the command starts in its own process (amqtt): ``edgepfl demo``
#: and ``edgepfl simulate``; a coordinator service and an agent need a real broker's URL
EMBEDDED_BROKER = "embedded"


class BrokerConfig(_Strict):
    """How to reach and log in to the MQTT broker.

    The password comes from at most one source: ``password`` (plain, demo only),
    ``password_file`` (first line of a file, mode 0600) or ``password_env`` (an
    environment variable's name). With ``mqtts://``, ``ca_file`` is the CA that signed
    the broker's certificate (default: the system trust store); ``cert_file`` and
    ``key_file`` are this client's certificate and key, for brokers that require them.
    """

    url: str = Field(EMBEDDED_BROKER, description="mqtt://host:port, mqtts://…, or 'embedded' (in-process amqtt)")
    username: str | None = Field(None, description="MQTT username")
    password: str | None = Field(None, description="plain password; prefer password_file or password_env")
    password_file: ConfigPath | None = Field(None, description="file whose first line is the password (mode 0600)")
    password_env: str | None = Field(None, description="name of the environment variable holding the password")
    ca_file: ConfigPath | None = Field(None, description="mqtts: PEM CA certificate(s) the broker's certificate must chain to")
    cert_file: ConfigPath | None = Field(None, description="mqtts: this client's PEM certificate (client certificate auth)")
    key_file: ConfigPath | None = Field(None, description="mqtts: the private key of cert_file (PEM, mode 0600)")
    max_message_bytes: int = Field(1_000_000, ge=16_384, description="larger payloads travel in chunks")
    max_payload_bytes: int = Field(256 * 2**20, ge=16_384, description="largest whole message accepted")
    max_buffered_bytes: int = Field(
        2 * 2**30, ge=16_384, description="all partially received chunked messages together (each topic: at most "
                                          "max_payload_bytes and 4 messages); a chunk past it is refused, over_budget")
    keepalive_s: int = Field(30, ge=5, description="MQTT keepalive; a silent client is declared gone after 1.5x")
    inbox_max_bytes: int | None = Field(
        None, ge=16_384,
        description="inbound frames queued before paho's thread stops acknowledging and the broker holds the "
                    "rest (default: max_payload_bytes / 16, at least four max_message_bytes); also the bytes the coordinator "
                    "sends before it waits for the broker's acknowledgements")
    inbox_max_messages: int = Field(10_000, ge=1, description="the same bound in messages")
    inbox_max_held_acks: int = Field(
        100, ge=1,
        description="messages past the inbox bound whose PUBACK is held while paho's thread keeps reading; past "
                    "it the thread waits up to keepalive_s / 3 for the consumer. Keep above the broker's in-flight "
                    "window for this client (Mosquitto max_inflight_messages, which it was measured to overshoot)")

    @field_validator("url")
    @classmethod
    def _valid_url(cls, url: str) -> str:
        """An invalid URL is a config error at load time, not a failure to connect later."""
        if url != EMBEDDED_BROKER:
            from .broker import BrokerError, parse_broker_url

            try:
                parse_broker_url(url)
            except BrokerError as exc:
                raise ValueError(str(exc)) from None
        return url

    @property
    def embedded(self) -> bool:
        """Whether the command starts the broker itself (``url: embedded``)."""
        return self.url == EMBEDDED_BROKER

    @model_validator(mode="after")
    def _one_password_source(self) -> BrokerConfig:
        sources = [name for name in ("password", "password_file", "password_env") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ValueError(f"give the broker password one way, not {' and '.join(sources)}")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a client certificate needs its key)")
        return self

    def read_password(self) -> str | None:
        """The password from whichever source is set (None without one).

        Raises ``ValueError`` naming the field when the file or variable is missing or empty.
        """
        if self.password_file is not None:
            try:
                lines = read_private(self.password_file, "broker.password_file").decode().splitlines()
            except UnicodeDecodeError:
                raise ValueError(f"broker.password_file {self.password_file}: not UTF-8 text") from None
            if not lines or not lines[0].strip():
                raise ValueError(f"broker.password_file {self.password_file} is empty")
            return lines[0].strip()
        if self.password_env is not None:
            value = os.environ.get(self.password_env)
            if not value:
                raise ValueError(f"broker.password_env: environment variable {self.password_env} is not set")
            return value
        return self.password


class SecuritySpec(_Strict):
    """End-to-end message signatures (Ed25519), independent of the broker.

    Keys are files: a private key is PEM PKCS#8 (unencrypted, mode 0600), a public key
    PEM SubjectPublicKeyInfo; ``edgepfl provision`` writes both. The coordinator sets
    ``signing_key`` and ``enrolled_dir``; an agent sets ``signing_key`` and
    ``coordinator_key``. With none set, messages travel unsigned (demo, simulate).
    """

    signing_key: ConfigPath | None = Field(None, description="this process's Ed25519 private key (PEM PKCS#8)")
    coordinator_key: ConfigPath | None = Field(None, description="agents: the coordinator's public key (PEM) they pin")
    enrolled_dir: ConfigPath | None = Field(
        None, description="coordinator: directory of <agent_id>.pub public keys; only these agents are accepted")
    certificate: ConfigPath | None = Field(
        None, description="agents: this device's signing key certified by the federation's CA (PEM X.509, "
                          "edgepfl provision's signing.crt); sent with its keys of each secure round (protocol 1.14)")
    peer_ca: ConfigPath | None = Field(
        None, description="the federation CA's certificate (PEM): with it an agent masks only with neighbours "
                          "whose secure-round keys a device key this CA certified signed, and a coordinator leaves "
                          "out devices whose keys are not so signed")
