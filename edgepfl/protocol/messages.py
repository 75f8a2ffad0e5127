"""Typed message metadata, one pydantic model per message type.

The envelope (:mod:`.envelope`) carries one of these as ``header.meta`` and the
tensors in its body. ``docs/PROTOCOL.md`` documents every field.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .manifest import ReleaseManifest
from .run import RunSpec

PROTOCOL_VERSION = "1.1"


class MessageType(str, Enum):
    STATUS = "status"
    TASK = "task"
    UPDATE = "update"
    METRICS = "metrics"
    COORDINATOR = "coordinator"
    RELEASE = "release"
    CHUNK = "chunk"


class _Meta(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StatusMeta(_Meta):
    """Agent presence (retained). The broker publishes the ``offline`` form as last will."""

    state: Literal["online", "offline", "busy"]
    tier: Literal["trainer", "head"] = "trainer"
    device: str = "cpu"
    num_train: int = Field(0, ge=0)
    num_test: int = Field(0, ge=0)
    version: str = PROTOCOL_VERSION
    software: str = ""
    platform: str = ""
    #: random per agent process (the will and every birth of one process share it): the
    #: coordinator takes an ``offline`` only for the agent's current session or a newer one
    session: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")


class TaskMeta(_Meta):
    """Coordinator -> agent: what to do this round.

    ``kind`` is ``train`` (evaluate the model made from this payload, then train and
    upload) or ``evaluate`` (evaluate only, upload metrics only). ``run`` is the
    run spec (method and options, model, train config, seed, data shape); the agent
    validates the method options and refuses a data shape its data does not have.
    """

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    kind: Literal["train", "evaluate"]
    run: RunSpec
    seed: int
    deadline_s: float = Field(gt=0)
    #: when the coordinator's run began (Unix ms; kept across a resume): agents order
    #: tasks by (epoch, round) and refuse older ones, so a fresh run is newer than any old one
    epoch: int = Field(0, ge=0)


class UpdateMeta(_Meta):
    """Agent -> coordinator: the answer to one task (shared tensors + statistics in the body)."""

    task_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    kind: Literal["train", "evaluate"]
    num_train: int = Field(ge=0)
    num_test: int = Field(ge=0)
    eval_correct: int = Field(ge=0)
    eval_loss: float | None = None
    train_loss: float | None = None
    train_seconds: float = Field(0.0, ge=0)
    extra: dict[str, float] = Field(default_factory=dict)


class MetricsMeta(_Meta):
    """Agent -> coordinator: out-of-band report (head tier evaluations, serving stats)."""

    tier: Literal["trainer", "head"]
    release_id: str | None = None
    head: str | None = None
    num_train: int = Field(0, ge=0)
    num_test: int = Field(0, ge=0)
    eval_correct: int = Field(0, ge=0)
    values: dict[str, float] = Field(default_factory=dict)


class CoordinatorMeta(_Meta):
    """Coordinator presence (retained), with the round it is in and its message limits.

    ``max_message_bytes`` is the coordinator's M: the largest MQTT message it sends, and
    the size an agent's frames must be chunked to (the broker in front of the coordinator
    is configured for it). ``max_payload_bytes`` is the largest whole frame it accepts.
    ``None``: not announced (a coordinator of an earlier revision).

    ``session`` is a fresh random id on each connection of the coordinator: an agent
    that sees an ``online`` presence with a session it has not answered re-publishes its
    status (the roll call, ``docs/PROTOCOL.md`` §11), for brokers whose retained messages
    do not reach the coordinator (RabbitMQ: node-local, never on wildcard subscriptions).
    """

    state: Literal["online", "offline", "done"]
    method: str = ""
    round: int = -1
    version: str = PROTOCOL_VERSION
    max_message_bytes: int | None = Field(None, ge=16_384)
    max_payload_bytes: int | None = Field(None, ge=16_384)
    session: str = Field("", pattern=r"^([0-9a-f]{32})?$")


class ReleaseMeta(_Meta):
    """Pointer to the current frozen encoder (retained). The artifact travels as
    ``artifact`` (uint8 tensor) in the body, or is referenced by ``uri``; either way
    ``sha256`` must match the artifact bytes and the manifest's own hash."""

    release_id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    manifest: ReleaseManifest
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    uri: str | None = None
    #: strictly increasing across releases of a federation (coordinator wall clock in ms,
    #: at least the last + 1): a head agent refuses one not above what it installed
    sequence: int | None = Field(None, ge=0)
    #: Unix time after which a head agent refuses to install this release
    expires: float | None = None


class ChunkMeta(_Meta):
    """One slice of a frame larger than the broker's maximum message size."""

    parent_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    index: int = Field(ge=0)
    count: int = Field(ge=1, le=1_000_000)
    total_bytes: int = Field(ge=0)
    total_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


META_TYPES: dict[MessageType, type[_Meta]] = {
    MessageType.STATUS: StatusMeta,
    MessageType.TASK: TaskMeta,
    MessageType.UPDATE: UpdateMeta,
    MessageType.METRICS: MetricsMeta,
    MessageType.COORDINATOR: CoordinatorMeta,
    MessageType.RELEASE: ReleaseMeta,
    MessageType.CHUNK: ChunkMeta,
}
