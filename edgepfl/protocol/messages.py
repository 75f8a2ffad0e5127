"""Typed message metadata, one pydantic model per message type.

The envelope (:mod:`.envelope`) carries one of these as ``header.meta`` and the
tensors in its body. ``docs/PROTOCOL.md`` documents every field.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from .codec import CodecHeader, CodecName, DeltaCodecName, UplinkSpec
from .evolution import PROTOCOL_VERSION, VERSION_PATTERN, since
from .manifest import ReleaseManifest
from .run import RunSpec
from .secagg import MAX_NEIGHBOURS, SecAggMeta, SecAggTask
from .site import SiteAnswer, SiteOrders, SiteStatus
from .topics import NAME_PATTERN

_ID = r"^[0-9a-f]{32}$"
#: a reason tag: the §7 rejection reasons, the refusal reasons; new ones may come with a minor version
_REASON = r"^[a-z][a-z0-9_]{0,31}$"

#: why an agent refuses a task (docs/PROTOCOL.md §5, ``refusal``); a receiver treats a
#: reason it does not know like ``error``
REFUSAL_REASONS: dict[str, str] = {
    "unsupported_method": "the agent cannot train run.method (not in its capabilities)",
    "unsupported_arch": "the agent cannot build run.model",
    "unsupported_version": "the coordinator speaks another major protocol version",
    "bad_options": "run.method.options do not validate against the method's options",
    "data_mismatch": "run.data's input shape or number of classes is not that of the agent's data",
    "normalization": "the agent cannot preprocess its data as run.data says",
    "busy": "the agent cannot take a task now (it stays eligible for later rounds)",
    "error": "the local update failed on the device (out of memory, a crash in training, ...)",
    "expired": "the task is past its deadline by the agent's clock (since 1.3; the detail says by how much)",
    "too_large": "the task frame is larger than the agent's max_payload_bytes (since 1.4)",
    "no_base": "the task's tensors are a delta against a task the agent does not hold (since 1.7)",
    "bad_shares": "a secure round's task carries shares that do not open, sealed by the neighbours the refusal's "
                  "peers name; the agent sends no masked update (since 1.12)",
}


class MessageType(str, Enum):
    STATUS = "status"
    TASK = "task"
    UPDATE = "update"
    METRICS = "metrics"
    COORDINATOR = "coordinator"
    RELEASE = "release"
    CHUNK = "chunk"
    NACK = "nack"  # since 1.2
    REFUSAL = "refusal"  # since 1.2
    SECAGG = "secagg"  # since 1.9


class _Meta(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())


class Capabilities(_Meta):
    """What an agent can run (since 1.2). ``None`` in a list's place: not declared, which
    the coordinator reads as "anything" (what it must assume of a 1.1 agent)."""

    #: method names it can train (trainer) or build heads for (head tier)
    methods: list[str] | None = None
    #: ``run.model.arch`` values it can build
    archs: list[str] | None = None
    #: head kinds it can fit (head tier)
    head_kinds: list[str] | None = None
    #: the largest MQTT message it accepts: the coordinator chunks what it sends this
    #: agent to at most min(this, its own M)
    max_message_bytes: int | None = Field(None, ge=16_384)
    #: the largest whole frame (after reassembly) it accepts: the coordinator sends it no
    #: larger frame, and no task of a run whose tasks are larger (PROTOCOL.md §15)
    max_payload_bytes: int | None = Field(None, ge=16_384, json_schema_extra=since("1.4"))
    #: the update codecs it can encode (docs/COMPRESSION.md): a task asks it for one of these
    #: only; None or absent: none, every update is sent uncompressed
    codecs: list[CodecName] | None = Field(None, max_length=16, json_schema_extra=since("1.6"))
    #: a head agent: the codecs it decodes a release delta in (docs/COMPRESSION.md, "Release
    #: deltas"); None or absent: it is sent whole releases only
    release_codecs: list[DeltaCodecName] | None = Field(None, max_length=16, json_schema_extra=since("1.7"))


#: the protocol version of capabilities (``status.capabilities``), refusals and nacks: an agent of it
#: announces itself once without capabilities, before it read the coordinator's presence, and
#: again with them once it has (PROTOCOL.md §10)
CAPABILITIES = (1, 2)
#: the protocol version that names releases in presences and statuses (a head agent that
#: has the current release downloads nothing) and lets an agent announce its largest frame
RELEASE_REFS = (1, 4)
#: the protocol version whose head agents report a release they refused (``MetricsMeta.refused``)
RELEASE_REFUSALS = (1, 5)
#: the protocol version of compressed updates (``capabilities.codecs``, ``task.uplink``, ``update.codec``)
CODECS = (1, 6)
#: the protocol version of release deltas (``capabilities.release_codecs``, ``release.delta``) and task
#: deltas (``task.downlink``)
RELEASE_DELTAS = TASK_DELTAS = (1, 7)
#: the protocol version whose head agents keep the release before the installed one and go back to
#: a release they hold without its bytes (``release.restore``): a rollback downloads nothing
RELEASE_RESTORE = (1, 8)
#: the protocol version of secure aggregation (``secagg`` messages, ``task.secagg``; PROTOCOL.md §19)
SECURE_AGGREGATION = (1, 9)
#: the protocol version of series and vector inputs (``run.data.input_kind``, an ``input_shape`` of 2 or 1
#: entries): a run of them goes only to agents that announced it
INPUT_KINDS = (1, 10)
#: the protocol version of ``run.train.max_grad_norm``: a run that sets it goes only to agents
#: that announced it (an older one would ignore the field and train unclipped)
GRADIENT_CLIP = (1, 11)
#: the protocol version of the ``bad_shares`` refusal and its ``peers``: an agent names the
#: neighbours whose sealed shares did not open, so the coordinator can leave them out
BAD_SHARES = (1, 12)
#: the protocol version whose secure rounds seal each direction of an edge under its own key
#: (PROTOCOL.md §19): a coordinator runs secure rounds only with trainers of it, and a trainer of it
#: takes secure steps only from a coordinator of it (1.9-1.13 sealed both directions under one key
#: and the zero nonce)
DIRECTED_SHARE_KEYS = (1, 14)
#: the protocol version from which a ``metrics`` report's ``values`` are at most
#: :data:`MAX_METRIC_VALUES` figures named in at most :data:`MAX_METRIC_NAME` characters: what a
#: device measured, never what it fitted (PROTOCOL.md §5)
BOUNDED_VALUES = (1, 15)
#: the protocol version whose exact grid gives a BatchNorm running variance 2**15 times its
#: tensor's largest magnitude of range instead of 64 (PROTOCOL.md §19.3): the parties that compute
#: the grid — a secure round's trainers and the sites — must agree on it with the coordinator, so
#: each side takes part in such rounds only with a peer of it
VARIANCE_GRID = (1, 17)
#: the most entries a ``metrics`` report's ``values`` may have (since 1.15; a coordinator keeps
#: none of a report with more, from any agent)
MAX_METRIC_VALUES = 32
#: the longest name of a ``values`` entry
MAX_METRIC_NAME = 64


class ReleaseRef(_Meta):
    """Names a release without carrying it (since 1.4): in the coordinator's presence, the
    current release; in a head agent's status, the release it has installed. Two refs are
    the same release when both fields are equal."""

    release_id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    sequence: int | None = Field(None, ge=0)


class StatusMeta(_Meta):
    """Agent presence (retained). The broker publishes the ``offline`` form as last will."""

    state: Literal["online", "offline", "busy"]
    #: ``site``: a site aggregator (since 1.13), which trains nothing itself; ``site`` lists its devices
    tier: Literal["trainer", "head", "site"] = "trainer"
    device: str = "cpu"
    num_train: int = Field(0, ge=0)
    num_test: int = Field(0, ge=0)
    version: str = Field(PROTOCOL_VERSION, pattern=VERSION_PATTERN)
    software: str = ""
    platform: str = ""
    #: random per agent process (the will and every birth of one process share it): the
    #: coordinator takes an ``offline`` only for the agent's current session or a newer one
    session: str | None = Field(None, pattern=_ID)
    #: what the agent can run; the coordinator sends it no task outside them
    capabilities: Capabilities | None = Field(None, json_schema_extra=since("1.2"))
    #: the how-manieth broker connection of this session the status was made on (from 1):
    #: a birth with a higher number than when a task was sent tells the coordinator that the
    #: task may have been lost with the old connection (PROTOCOL.md §10)
    connection: int | None = Field(None, ge=1, le=2**31, json_schema_extra=since("1.3"))
    #: a head agent's installed release: a coordinator that has the same current release
    #: does not send it again (PROTOCOL.md §12, releases by reference)
    release: ReleaseRef | None = Field(None, json_schema_extra=since("1.4"))
    #: a site aggregator's online devices (since 1.13; tier ``site`` only; PROTOCOL.md §20)
    site: SiteStatus | None = Field(None, json_schema_extra=since("1.13"))


class TaskDelta(_Meta):
    """A task whose tensors travel as the change from the tensors of the agent's task of an
    earlier round (since 1.7; docs/COMPRESSION.md, "Task deltas"). The body holds the
    ``codec``'s streams and its exact tensors; the agent decodes the compressed ones onto the
    same-named tensors of its task of round ``base_round`` (same ``epoch``), takes the exact
    ones as they are, and checks ``digest`` (:func:`edgepfl.protocol.codec.tensors_digest`)
    on the result before it uses it. Sent only to an agent of 1.7 whose ``capabilities.codecs``
    has the codec and that answered its task of ``base_round`` in this session."""

    base_round: int = Field(ge=0)
    codec: CodecHeader
    #: sha256 of the task's tensors once decoded
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")


class TaskMeta(_Meta):
    """Coordinator -> agent: what to do this round.

    ``kind`` is ``train`` (evaluate the model made from this payload, then train and
    upload) or ``evaluate`` (evaluate only, upload metrics only). ``run`` is the
    run spec (method and options, model, train config, seed, data shape); the agent
    validates the method options and refuses a data shape its data does not have.
    """

    task_id: str = Field(pattern=_ID)
    kind: Literal["train", "evaluate"]
    run: RunSpec
    seed: int
    deadline_s: float = Field(gt=0)
    #: when the coordinator's run began (Unix ms; kept across a resume): agents order
    #: tasks by (epoch, round) and refuse older ones, so a fresh run is newer than any old one
    epoch: int = Field(0, ge=0)
    #: compress this training update's change so (since 1.6; docs/COMPRESSION.md); None: send
    #: it uncompressed. Only for an agent that announced the codec in its capabilities
    uplink: UplinkSpec | None = Field(None, json_schema_extra=since("1.6"))
    #: the tensors travel as a delta against the agent's task of an earlier round (None: whole)
    downlink: TaskDelta | None = Field(None, json_schema_extra=since("1.7"))
    #: mask this training update for secure aggregation (since 1.9; PROTOCOL.md §19); None: send it as it is
    secagg: SecAggTask | None = Field(None, json_schema_extra=since("1.9"))
    #: a site aggregator's task: the round for its devices (since 1.13; PROTOCOL.md §20)
    site: SiteOrders | None = Field(None, json_schema_extra=since("1.13"))


class UpdateMeta(_Meta):
    """Agent -> coordinator: the answer to one task (shared tensors + statistics in the body)."""

    task_id: str = Field(pattern=_ID)
    kind: Literal["train", "evaluate"]
    num_train: int = Field(ge=0)
    num_test: int = Field(ge=0)
    eval_correct: int = Field(ge=0)
    eval_loss: float | None = None
    train_loss: float | None = None
    train_seconds: float = Field(0.0, ge=0)
    extra: dict[str, float] = Field(default_factory=dict)
    #: the body is the update encoded so (since 1.6): its change from the task's tensors,
    #: with the codec the task's ``uplink`` asked for; None: the tensors as they are
    codec: CodecHeader | None = Field(None, json_schema_extra=since("1.6"))
    #: a site aggregator's answer: its devices' answers and its partial sum's counts (since 1.13;
    #: PROTOCOL.md §20); the body is then the partial sum
    site: SiteAnswer | None = Field(None, json_schema_extra=since("1.13"))


class MetricsMeta(_Meta):
    """Agent -> coordinator: out-of-band report (head tier evaluations, serving stats).

    ``refused`` (since 1.5): the head agent did not install release ``release_id``, and
    why, in one line; its counts are then zero and it keeps the release it had. Sent only
    to a coordinator whose presence announced 1.5 or later (PROTOCOL.md §12)."""

    tier: Literal["trainer", "head"]
    release_id: str | None = None
    head: str | None = None
    num_train: int = Field(0, ge=0)
    num_test: int = Field(0, ge=0)
    eval_correct: int = Field(0, ge=0)
    #: what the agent measured besides the counts (fit seconds, train accuracy, ...); since 1.15
    #: at most MAX_METRIC_VALUES entries, never the device's fitted parameters or data (not a
    #: schema limit: an older agent's report with more is kept, its values are not)
    values: dict[str, float] = Field(default_factory=dict, description=(
        "what the agent measured besides the counts; since 1.15 at most 32 entries named in at most 64 characters, "
        "never the device's fitted parameters, features or samples"))
    refused: str | None = Field(None, min_length=1, max_length=300, json_schema_extra=since("1.5"))


def unbounded_values(values: dict[str, float]) -> str | None:
    """Why a ``metrics`` report's ``values`` break the 1.15 rule (PROTOCOL.md §5), or None: more
    than :data:`MAX_METRIC_VALUES` entries, or a name longer than :data:`MAX_METRIC_NAME` characters."""
    if len(values) > MAX_METRIC_VALUES:
        return f"{len(values)} values, more than {MAX_METRIC_VALUES}"
    long = next((name for name in values if len(name) > MAX_METRIC_NAME), None)
    return None if long is None else f"a value named in {len(long)} characters, more than {MAX_METRIC_NAME}"


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
    version: str = Field(PROTOCOL_VERSION, pattern=VERSION_PATTERN)
    max_message_bytes: int | None = Field(None, ge=16_384)
    max_payload_bytes: int | None = Field(None, ge=16_384)
    session: str = Field("", pattern=r"^([0-9a-f]{32})?$")
    #: the current release (since 1.4; never in the last will): a head agent that has it
    #: installed downloads nothing (PROTOCOL.md §12, releases by reference)
    release: ReleaseRef | None = Field(None, json_schema_extra=since("1.4"))


class ReleaseDelta(_Meta):
    """A release sent as the change of the release the agent has installed (since 1.7;
    docs/COMPRESSION.md, "Release deltas"). The frame's body carries ``codec:payload`` and
    ``codec:scales`` instead of ``artifact``: the changes of the base artifact's float32
    ``runs``, compressed tensor ``run-<i>`` for run ``i``. The artifact is the base with
    ``float32(value + change)`` written over each run; it must hash to the release's
    ``sha256``. Sent only to an agent whose status names ``base`` and whose capabilities
    list the codec in ``release_codecs``."""

    base: ReleaseRef
    #: sha256 of the base artifact, which the agent must hold
    base_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    #: (byte offset in the base artifact, float32 value count) of each run, in order
    runs: list[tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)]]] = Field(max_length=65_536)
    codec: CodecHeader


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
    #: the artifact travels as a change of the release the agent has installed
    delta: ReleaseDelta | None = Field(None, json_schema_extra=since("1.7"))
    #: no artifact travels: the agent holds this release (installed, or the one before it) and
    #: installs it again under this ``sequence`` (a rollback, PROTOCOL.md §12); one that does not
    #: hold it refuses it and is sent the whole release
    restore: bool = Field(False, json_schema_extra=since("1.8"))

    def ref(self) -> ReleaseRef:
        """This release by reference."""
        return ReleaseRef(release_id=self.release_id, sequence=self.sequence)


class ChunkMeta(_Meta):
    """One slice of a frame larger than the broker's maximum message size."""

    parent_id: str = Field(pattern=_ID)
    index: int = Field(ge=0)
    count: int = Field(ge=1, le=1_000_000)
    total_bytes: int = Field(ge=0)
    total_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class NackMeta(_Meta):
    """Coordinator -> agent, on the agent's task topic (since 1.2): a frame this agent
    published was rejected. Sent only to agents whose status announced 1.2 or later.

    When ``task_id`` names the agent's open task, that task is closed for the agent: the
    round does not wait for another answer from it, and a later one is a ``duplicate``."""

    #: ``header.message_id`` of the rejected frame
    message_id: str = Field(pattern=_ID)
    #: the type of the rejected frame (``update``, ``status``, ``refusal``, ``metrics``)
    rejected_type: str = Field(pattern=_REASON)
    #: the rejection reason (docs/PROTOCOL.md §7)
    reason: str = Field(pattern=_REASON)
    #: one line for a human, never needed to act on the reason
    detail: str = Field("", max_length=300)
    #: the task the rejected frame answered, when it named one the coordinator sent
    task_id: str | None = Field(None, pattern=_ID)


class RefusalMeta(_Meta):
    """Agent -> coordinator, on the agent's update topic (since 1.2): the agent will not
    run this task. It answers the task (the round does not wait for the agent) and
    contributes nothing. Sent only to a coordinator whose presence announced 1.2 or later."""

    task_id: str = Field(pattern=_ID)
    #: one of :data:`REFUSAL_REASONS`
    reason: str = Field(pattern=_REASON)
    detail: str = Field("", max_length=300)
    #: ``bad_shares`` (since 1.12): the neighbours whose shares did not open; absent otherwise
    peers: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(
        None, min_length=1, max_length=MAX_NEIGHBOURS, json_schema_extra=since("1.12"))


META_TYPES: dict[MessageType, type[BaseModel]] = {
    MessageType.STATUS: StatusMeta,
    MessageType.TASK: TaskMeta,
    MessageType.UPDATE: UpdateMeta,
    MessageType.METRICS: MetricsMeta,
    MessageType.COORDINATOR: CoordinatorMeta,
    MessageType.RELEASE: ReleaseMeta,
    MessageType.CHUNK: ChunkMeta,
    MessageType.NACK: NackMeta,
    MessageType.REFUSAL: RefusalMeta,
    MessageType.SECAGG: SecAggMeta,
}
