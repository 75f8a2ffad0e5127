"""Wire protocol: topics (:mod:`.topics`), typed messages (:mod:`.messages`), the run
spec every task carries (:mod:`.run`), the release manifest (:mod:`.manifest`), the
binary envelope (:mod:`.envelope`), chunk reassembly (:mod:`.reassembly`) and the MQTT
transport (:mod:`.transport`).
See ``docs/PROTOCOL.md``."""

from .codec import UplinkSpec
from .envelope import (
    Body,
    Message,
    ProtocolError,
    decode,
    encode,
    encode_body,
    encode_refusal,
    new_message_id,
    split_frame,
)
from .evolution import parse_version, supports
from .manifest import (
    MANIFEST_FORMAT,
    BatchNormOrigin,
    FileEntry,
    GlobalHeadsEntry,
    ManifestError,
    ReleaseManifest,
    parse_manifest,
    read_manifest,
)
from .messages import (
    BAD_SHARES,
    BOUNDED_VALUES,
    CAPABILITIES,
    CODECS,
    DIRECTED_SHARE_KEYS,
    GRADIENT_CLIP,
    INPUT_KINDS,
    MAX_METRIC_VALUES,
    PROTOCOL_VERSION,
    REFUSAL_REASONS,
    RELEASE_DELTAS,
    RELEASE_REFS,
    RELEASE_REFUSALS,
    RELEASE_RESTORE,
    SECURE_AGGREGATION,
    TASK_DELTAS,
    VARIANCE_GRID,
    Capabilities,
    ChunkMeta,
    CoordinatorMeta,
    MessageType,
    MetricsMeta,
    NackMeta,
    RefusalMeta,
    ReleaseDelta,
    ReleaseMeta,
    ReleaseRef,
    StatusMeta,
    TaskDelta,
    TaskMeta,
    UpdateMeta,
    unbounded_values,
)
from .presence import RollCall
from .reassembly import Reassembler
from .run import PIXEL_SCALE, DataShape, InputKind, MethodChoice, Normalization, RunSpec, kind_of_shape, seed_for
from .topics import (
    AgentChannel,
    FederationChannel,
    TopicError,
    agent_topic,
    agent_wildcard,
    federation_topic,
    parse_topic,
    release_part_topic,
)

__all__ = [
    "seed_for", "CAPABILITIES", "CODECS", "UplinkSpec",
    "Body", "encode_body",
    "MANIFEST_FORMAT", "PIXEL_SCALE", "PROTOCOL_VERSION", "AgentChannel", "BatchNormOrigin", "ChunkMeta",
    "CoordinatorMeta", "DataShape", "FederationChannel", "FileEntry", "GlobalHeadsEntry", "ManifestError", "Message",
    "MessageType", "MethodChoice", "MetricsMeta", "Normalization", "ProtocolError", "Reassembler", "ReleaseManifest",
    "ReleaseDelta", "ReleaseMeta", "RELEASE_DELTAS", "RELEASE_REFS", "RELEASE_RESTORE", "RELEASE_REFUSALS", "ReleaseRef",
    "RollCall", "SECURE_AGGREGATION", "INPUT_KINDS", "GRADIENT_CLIP", "BAD_SHARES", "DIRECTED_SHARE_KEYS", "VARIANCE_GRID",
    "BOUNDED_VALUES", "MAX_METRIC_VALUES", "unbounded_values",
    "InputKind", "kind_of_shape",
    "RunSpec", "StatusMeta", "TASK_DELTAS", "TaskDelta", "TaskMeta", "TopicError",
    "UpdateMeta", "agent_topic", "agent_wildcard",
    "decode", "encode", "federation_topic", "new_message_id", "parse_manifest", "parse_topic", "read_manifest",
    "split_frame", "encode_refusal", "Capabilities", "NackMeta", "REFUSAL_REASONS", "RefusalMeta", "parse_version", "supports",
    "release_part_topic",
]
