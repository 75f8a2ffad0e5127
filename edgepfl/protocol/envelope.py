"""The binary envelope every edgepfl message travels in.

Frame layout (all integers big-endian)::

    b"EPF1" | uint32 header_length | header (UTF-8 JSON) | body [| signature]

A frame whose header names a ``signer`` (a key id, :mod:`.signing`) ends with a
64-byte Ed25519 signature over a fixed context string, the prefix and the header bytes
as transmitted; an unsigned frame has no trailer and no ``signer`` / ``recipient`` keys,
byte for byte as in protocol 1.0. Decoding checks the signature's length; checking it
against a key is the receiver's (:func:`.signing.verify`).

The header is validated with pydantic (:class:`Header`); the body is a
safetensors blob whose tensors must match the header's manifest exactly
(names, dtypes, shapes) and whose sha256 must match ``body_sha256``. Nothing is
ever unpickled: safetensors and JSON are the only decoders that see network
bytes, and the header's JSON only once its nesting is known to be bounded
(:mod:`.bounded_json`). Floating tensors must be finite.

Frames larger than the broker's maximum message size are split into ``chunk``
frames (:func:`split_frame`) and put back together by
:class:`~edgepfl.protocol.reassembly.Reassembler`, which verifies the whole frame's
sha256 before handing it on and bounds what partial frames may hold.
"""

from __future__ import annotations

import builtins
import hashlib
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import bounded_json
from .clock import wall_time
from .evolution import PROTOCOL_VERSION, omitted_defaults, strip_unknown
from .messages import META_TYPES, ChunkMeta, MessageType
from .topics import NAME_PATTERN
from .validation import first_validation_error


class Signer(Protocol):
    """What signs a frame (:class:`edgepfl.protocol.signing.Signer` is one): the signature
    covers the frame's prefix and header, whose header names ``key_id``."""

    @property
    def key_id(self) -> str: ...

    def sign(self, signed_part: bytes) -> bytes: ...


#: an Ed25519 signature's length: the trailer of every signed frame
SIGNATURE_BYTES = 64

MAGIC = b"EPF1"
SCHEMA_VERSION: Final = 1
MAX_HEADER_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
_PREFIX = struct.Struct(">4sI")

DType = Literal["float32", "float16", "float64", "int64", "int32", "uint8", "bool"]
_ALLOWED_DTYPES = {np.dtype(d) for d in ("float32", "float16", "float64", "int64", "int32", "uint8", "bool")}


class ProtocolError(ValueError):
    """A frame that is not a valid edgepfl message; ``reason`` is a short tag for counters."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class TensorInfo(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    dtype: DType
    shape: list[int] = Field(max_length=8)


class Header(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")
    schema_version: Literal[1] = SCHEMA_VERSION
    type: MessageType
    federation: str = Field(pattern=NAME_PATTERN)
    sender: str = Field(pattern=NAME_PATTERN)
    round: int = Field(ge=-1)
    message_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    created: float
    body_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    body_bytes: int = Field(ge=0)
    tensors: list[TensorInfo] = Field(default_factory=list)
    meta: dict[str, Any] = Field(default_factory=dict)
    #: key id of the signer; when present a 64-byte signature follows the body
    signer: str | None = Field(None, pattern=r"^[0-9a-f]{16}$")
    #: the one agent a signed task is for (so it cannot be replayed to another)
    recipient: str | None = Field(None, pattern=NAME_PATTERN)


_TYPE_NAMES = frozenset(t.value for t in MessageType)

# Absent, not null, when unset: an unsigned frame stays byte for byte a protocol 1.0 frame.
_OPTIONAL_HEADER_KEYS = ("signer", "recipient")

MetaT = TypeVar("MetaT", bound=BaseModel)


@dataclass
class Message:
    """A decoded message: validated header, typed meta and numpy tensors.

    ``meta`` is an instance of ``META_TYPES[type]``; its static type is the common base
    because the class depends on the bytes. A receiver narrows with :meth:`meta_as`.
    """

    header: Header
    meta: BaseModel
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    #: the trailing Ed25519 signature of a signed frame (None: unsigned)
    signature: bytes | None = None
    #: the bytes the signature covers, after the context string: prefix + header as transmitted
    signed_part: bytes = b""
    #: dotted paths of header and meta keys this version does not define, ignored
    #: (a newer minor version's optional fields, docs/PROTOCOL.md §16)
    unknown_fields: tuple[str, ...] = ()

    @property
    def type(self) -> MessageType:
        return self.header.type

    def meta_as(self, cls: builtins.type[MetaT]) -> MetaT:  # (``type`` is the property above)
        """``meta`` as ``cls`` (``UpdateMeta``, ``ChunkMeta``, ...); a message of another
        type is a :class:`ProtocolError` with reason ``wrong_type``."""
        if not isinstance(self.meta, cls):
            raise ProtocolError("wrong_type", f"{self.type.value} message, not one carrying {cls.__name__}")
        return self.meta


def new_message_id() -> str:
    return uuid.uuid4().hex


def encode(
    type: MessageType | str,
    *,
    federation: str,
    sender: str,
    round: int,
    meta: BaseModel,
    tensors: dict[str, np.ndarray] | None = None,
    message_id: str | None = None,
    body: Body | None = None,
    signer: Signer | None = None,
    recipient: str | None = None,
    created: float | None = None,
) -> bytes:
    """Build one frame. ``meta`` must be the meta model registered for ``type``.

    The tensors come as ``tensors``, or already encoded as ``body`` (:func:`encode_body`)
    when many frames carry the same ones: a round's tasks share the global parameters,
    which are then serialized and hashed once per round instead of once per agent.
    With ``signer`` the frame is signed (the signature covers prefix and header, and
    through ``body_sha256`` the body, which is not hashed again); ``recipient`` names
    the one agent the message is for; ``created`` (Unix s) backdates the frame (the
    conformance kit's expired tasks; default: now).
    """
    mtype = MessageType(type)
    if not isinstance(meta, META_TYPES[mtype]):
        # (the parameter ``type`` shadows the builtin here)
        raise TypeError(f"{mtype.value} messages carry {META_TYPES[mtype].__name__}, got {meta.__class__.__name__}")
    if body is None:
        body = encode_body(tensors or {})
    elif tensors:
        raise ValueError("pass tensors or an encoded body, not both")
    header = Header(
        type=mtype,
        federation=federation,
        sender=sender,
        round=round,
        message_id=message_id or new_message_id(),
        created=wall_time() if created is None else created,
        body_sha256=body.sha256,
        body_bytes=len(body.data),
        tensors=list(body.tensors),
        meta=meta.model_dump(mode="json", exclude=omitted_defaults(meta)),
        signer=signer.key_id if signer is not None else None,
        recipient=recipient,
    )
    if signer is not None and mtype == MessageType.CHUNK:
        raise ValueError("chunk frames are not signed: the reassembled whole frame is")
    unset = {k for k in _OPTIONAL_HEADER_KEYS if getattr(header, k) is None}
    head = header.model_dump_json(exclude=unset).encode()
    prefix_and_head = _PREFIX.pack(MAGIC, len(head)) + head
    if signer is None:
        return prefix_and_head + body.data
    return prefix_and_head + body.data + signer.sign(prefix_and_head)


def encode_refusal(task: Message, *, sender: str, reason: str, detail: str, signer: Signer | None = None,
                   peers: list[str] | None = None) -> bytes:
    """The ``refusal`` frame answering ``task`` (docs/PROTOCOL.md §5): the agent will not
    run it, for ``reason`` (one of :data:`~edgepfl.protocol.messages.REFUSAL_REASONS`);
    ``peers``: the neighbours a ``bad_shares`` refusal names."""
    from .messages import TaskMeta

    return refusal_frame(task.header.federation, task.header.round, task.meta_as(TaskMeta).task_id, sender=sender,
                         reason=reason, detail=detail, signer=signer, peers=peers)


def refusal_frame(federation: str, round: int, task_id: str, *, sender: str, reason: str, detail: str,
                  signer: Signer | None = None, peers: list[str] | None = None) -> bytes:
    """The ``refusal`` frame of task ``task_id`` of ``round``, where only the task's header
    could be read (a task too large to decode); raises ValueError for a malformed task id."""
    from .messages import RefusalMeta

    meta = RefusalMeta(task_id=task_id, reason=reason, detail=detail[:300], peers=peers)
    return encode(MessageType.REFUSAL, federation=federation, sender=sender, round=round, meta=meta, signer=signer)


@dataclass(frozen=True)
class Body:
    """A frame's tensors, encoded: the safetensors bytes, their sha256 and their manifest."""

    data: bytes
    sha256: str
    tensors: tuple[TensorInfo, ...]


def encode_body(tensors: dict[str, np.ndarray]) -> Body:
    """Encode tensors once for any number of frames (see :func:`encode`'s ``body``)."""
    data = _encode_tensors(tensors)
    infos = tuple(TensorInfo(name=k, dtype=str(v.dtype), shape=list(v.shape)) for k, v in tensors.items())
    return Body(data, hashlib.sha256(data).hexdigest(), infos)


def decode(frame: bytes, *, max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES, check_finite: bool = True) -> Message:
    """Validate and decode one frame; raises :class:`ProtocolError` with a reason tag."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("malformed", "frame is not bytes")
    frame = bytes(frame)
    if len(frame) > max_bytes:
        raise ProtocolError("oversized", f"{len(frame)} bytes > limit {max_bytes}")
    if len(frame) < _PREFIX.size:
        raise ProtocolError("malformed", "frame shorter than its prefix")
    magic, head_len = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError("malformed", "bad magic (not an edgepfl frame)")
    if head_len > MAX_HEADER_BYTES or _PREFIX.size + head_len > len(frame):
        raise ProtocolError("malformed", "header length out of range (truncated frame?)")
    head_end = _PREFIX.size + head_len
    raw_head = frame[_PREFIX.size : head_end]
    try:
        raw = bounded_json.loads(raw_head, what="header")
    except bounded_json.BoundedJSONError as exc:
        raise ProtocolError("malformed", f"invalid header: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get("type"), str) and raw["type"] not in _TYPE_NAMES:
        # a message type of a newer minor version, sent to us by mistake: not ours to read
        raise ProtocolError("unknown_type", f"message type {raw['type']!r} is not one of protocol {PROTOCOL_VERSION}")
    try:
        header, unknown = _validated(Header, raw)
    except ValidationError as exc:
        raise ProtocolError("malformed", f"invalid header: {first_validation_error(exc)}") from None
    signature = None
    if header.signer is not None:
        trailer = len(frame) - head_end - header.body_bytes
        if trailer != SIGNATURE_BYTES:
            raise ProtocolError("malformed", f"signed frame ends with {trailer} signature bytes, not "
                                             f"{SIGNATURE_BYTES} (truncated or extra bytes)")
        signature = frame[len(frame) - SIGNATURE_BYTES :]
        body = frame[head_end : len(frame) - SIGNATURE_BYTES]
    else:
        body = frame[head_end:]
    if header.body_bytes != len(body):
        raise ProtocolError("malformed", f"body is {len(body)} bytes, header says {header.body_bytes} (truncated?)")
    if hashlib.sha256(body).hexdigest() != header.body_sha256:
        raise ProtocolError("corrupt", "body sha256 mismatch")
    meta_type = META_TYPES[header.type]
    try:
        meta, unknown_meta = _validated(meta_type, header.meta)
    except ValidationError as exc:
        raise ProtocolError("malformed", f"invalid {header.type.value} meta: {first_validation_error(exc)}") from None
    tensors = _decode_tensors(body, header.tensors, check_finite and header.type != MessageType.CHUNK)
    return Message(header=header, meta=meta, tensors=tensors, signature=signature,
                   signed_part=frame[:head_end] if signature is not None else b"",
                   unknown_fields=(*unknown, *(f"meta.{p}" for p in unknown_meta)))


def _validated(model: type[MetaT], raw: Any) -> tuple[MetaT, list[str]]:
    """``raw`` as ``model`` and the dotted paths of the keys it ignored (a newer minor version's,
    :func:`strip_unknown`). A frame of this version has none, and validates as it is: only one
    that does not is pruned first, so that a large header (a site's thousands of device answers)
    is walked once, by the validator, not twice. Raises ``ValidationError``."""
    try:
        return model.model_validate(raw), []
    except ValidationError:
        pruned, unknown = strip_unknown(raw, model)
        if not unknown:
            raise
        return model.model_validate(pruned), unknown


def _encode_tensors(tensors: dict[str, np.ndarray]) -> bytes:
    if not tensors:
        return b""
    from safetensors.numpy import save

    clean = {}
    for name, value in tensors.items():
        arr = np.require(value, requirements="C")  # keeps 0-d arrays 0-d, unlike ascontiguousarray
        if arr.dtype not in _ALLOWED_DTYPES:
            raise TypeError(f"tensor {name!r} has unsupported dtype {arr.dtype}")
        clean[name] = arr
    return save(clean)


def _decode_tensors(body: bytes, manifest: list[TensorInfo], check_finite: bool) -> dict[str, np.ndarray]:
    if not manifest:
        if body:
            raise ProtocolError("malformed", "body present but tensor manifest empty")
        return {}
    from safetensors.numpy import load

    try:
        tensors = load(body)
    except Exception as exc:  # safetensors raises its own error types
        raise ProtocolError("malformed", f"body is not safetensors: {exc}") from None
    expected = {t.name: t for t in manifest}
    if set(tensors) != set(expected) or len(expected) != len(manifest):
        raise ProtocolError("malformed", "tensor names differ from the header manifest")
    for name, arr in tensors.items():
        info = expected[name]
        if str(arr.dtype) != info.dtype or list(arr.shape) != info.shape:
            raise ProtocolError(
                "malformed", f"tensor {name!r} is {arr.dtype}{list(arr.shape)}, manifest says {info.dtype}{info.shape}"
            )
        if check_finite and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise ProtocolError("non_finite", f"tensor {name!r} contains NaN or Inf")
    return tensors


def peek_header(frame: bytes) -> dict | None:
    """Best-effort header read for logging a frame that failed to decode."""
    try:
        magic, head_len = _PREFIX.unpack_from(frame)
        if magic != MAGIC or head_len > MAX_HEADER_BYTES:
            return None
        header = bounded_json.loads(frame[_PREFIX.size : _PREFIX.size + head_len])
        return header if isinstance(header, dict) else None
    except (struct.error, TypeError, bounded_json.BoundedJSONError):
        return None


def peek_signed_part(frame: bytes) -> tuple[bytes, bytes] | None:
    """``(prefix + header, last 64 bytes)`` of a frame that may not decode: what a signature
    covers and where it sits, for checking who sent a frame whose meta or body is invalid.
    None when the frame is too short to hold both."""
    try:
        magic, head_len = _PREFIX.unpack_from(frame)
    except struct.error:
        return None
    head_end = _PREFIX.size + head_len
    if magic != MAGIC or len(frame) < head_end + SIGNATURE_BYTES:
        return None
    return bytes(frame[:head_end]), bytes(frame[len(frame) - SIGNATURE_BYTES :])


# --------------------------------------------------------------------------- chunking

CHUNK_OVERHEAD = 2048


def split_frame(frame: bytes, max_message_bytes: int, *, federation: str, sender: str, round: int) -> list[bytes]:
    """Split ``frame`` into chunk frames of at most ``max_message_bytes`` each (or return it whole)."""
    if len(frame) <= max_message_bytes:
        return [frame]
    step = max_message_bytes - CHUNK_OVERHEAD
    if step <= 0:
        raise ValueError(f"max_message_bytes {max_message_bytes} too small (need > {CHUNK_OVERHEAD})")
    parent = new_message_id()
    total_sha = hashlib.sha256(frame).hexdigest()
    count = (len(frame) + step - 1) // step
    out = []
    for i in range(count):
        piece = np.frombuffer(frame[i * step : (i + 1) * step], dtype=np.uint8)
        meta = ChunkMeta(parent_id=parent, index=i, count=count, total_bytes=len(frame), total_sha256=total_sha)
        out.append(
            encode(MessageType.CHUNK, federation=federation, sender=sender, round=round, meta=meta, tensors={"data": piece})
        )
    return out
