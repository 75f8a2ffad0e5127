"""The leaf types of a configuration: model, training, data and broker specs.

They depend on nothing else in edgepfl, so every layer (data, models, methods, the
protocol's run spec, the apps) can use them without importing the method registry
that validates whole run configurations (:mod:`edgepfl.config`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelSpec(_Strict):
    """Which network to build. Weights are only ever read from a local file."""

    arch: Literal["cnn", "mlp", "resnet18", "mobilenet_v3_small", "identity"] = Field(
        "cnn", description="'identity': inputs already are feature vectors, the encoder only flattens them "
                           "(how a method's head is fitted on an exported encoder's features)"
    )
    feature_dim: int = Field(128, ge=2, description="encoder output size (cnn / mlp)")
    norm: Literal["batch", "none"] = "batch"
    weights: str | None = Field(None, description="local state_dict file for resnet18 / mobilenet_v3_small")


class TrainConfig(_Strict):
    """Local optimisation defaults; methods may override per phase."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(50, ge=1)
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.5, ge=0)
    weight_decay: float = Field(5e-4, ge=0)
    optimizer: Literal["sgd", "adam"] = "sgd"


class PartitionSpec(_Strict):
    """How a pooled dataset is split over clients (simulation and benchmarks)."""

    kind: Literal["iid", "dirichlet", "pathological", "dominant", "domain"] = "dirichlet"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")
    uniform_fraction: float = Field(0.2, ge=0, le=1, description="dominant: share drawn uniformly over classes")
    domains: list[str] = Field(
        default_factory=lambda: ["identity", "rot90", "invert", "noise"],
        description="domain: transforms, client i gets domains[i % len]",
    )


class DataSpec(_Strict):
    """Where a client's data comes from."""

    dataset: Literal["fmnist", "digits", "torchvision", "imagefolder", "npz", "auto"] = "auto"
    root: str | None = None
    name: str | None = Field(None, description="torchvision dataset class name, e.g. CIFAR10")
    num_clients: int = Field(8, ge=1)
    samples_per_client: int | None = Field(None, ge=1)
    partition: PartitionSpec = Field(default_factory=PartitionSpec)
    test_fraction: float = Field(0.25, gt=0, lt=1)
    seed: int = 0


class BrokerConfig(_Strict):
    url: str = Field("embedded", description="mqtt://host:port, mqtts://…, or 'embedded' (in-process amqtt)")
    username: str | None = None
    password: str | None = None
    max_message_bytes: int = Field(1_000_000, ge=16_384, description="larger payloads travel in chunks")
    max_payload_bytes: int = Field(256 * 2**20, ge=16_384, description="largest whole message accepted")
    keepalive_s: int = Field(30, ge=5)
    inbox_max_bytes: int | None = Field(
        None, ge=16_384,
        description="inbound frames queued before paho's thread stops acknowledging and the broker holds the "
                    "rest (default: max_payload_bytes / 16, at least four max_message_bytes); also the bytes the coordinator "
                    "sends before it waits for the broker's acknowledgements")
    inbox_max_messages: int = Field(10_000, ge=1, description="the same bound in messages")


class SecuritySpec(_Strict):
    """End-to-end message signatures (Ed25519), independent of the broker.

    Keys are files: a private key is PEM PKCS#8 (unencrypted, mode 0600), a public key
    PEM SubjectPublicKeyInfo; ``edgepfl provision`` writes both. The coordinator sets
    ``signing_key`` and ``enrolled_dir``; an agent sets ``signing_key`` and
    ``coordinator_key``. With none set, messages travel unsigned (demo, simulate).
    """

    signing_key: str | None = Field(None, description="this process's Ed25519 private key (PEM PKCS#8)")
    coordinator_key: str | None = Field(None, description="agents: the coordinator's public key (PEM) they pin")
    enrolled_dir: str | None = Field(
        None, description="coordinator: directory of <agent_id>.pub public keys; only these agents are accepted")
