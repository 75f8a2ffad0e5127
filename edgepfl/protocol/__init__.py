"""Wire protocol: topics (:mod:`.topics`), typed messages (:mod:`.messages`),
the binary envelope (:mod:`.envelope`) and the MQTT transport (:mod:`.transport`).
See ``docs/PROTOCOL.md``."""

from .envelope import Message, ProtocolError, Reassembler, decode, encode, new_message_id, split_frame
from .messages import (
    PROTOCOL_VERSION,
    ChunkMeta,
    CoordinatorMeta,
    MessageType,
    MetricsMeta,
    ReleaseMeta,
    StatusMeta,
    TaskMeta,
    UpdateMeta,
)
from .topics import (
    AgentChannel,
    FederationChannel,
    TopicError,
    agent_topic,
    agent_wildcard,
    federation_topic,
    parse_topic,
)

__all__ = [
    "AgentChannel", "ChunkMeta", "CoordinatorMeta", "FederationChannel", "Message", "MessageType", "MetricsMeta",
    "PROTOCOL_VERSION", "ProtocolError", "Reassembler", "ReleaseMeta", "StatusMeta", "TaskMeta", "TopicError",
    "UpdateMeta", "agent_topic", "agent_wildcard", "decode", "encode", "federation_topic", "new_message_id",
    "parse_topic", "split_frame",
]
