"""The codec fields of the wire (since protocol 1.6): what a task asks an agent's update
to be compressed with (:class:`UplinkSpec`), and the header an encoded update carries
(:class:`CodecHeader`). Which codecs exist is the table
:data:`edgepfl.codec_stages.CODECS`; encoding, decoding and error feedback are
:mod:`edgepfl.codecs`; docs/COMPRESSION.md describes the frames byte by byte."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..codec_stages import CODECS, DELTA_CODECS, is_sparse

#: the codecs an agent may announce (``capabilities.codecs``): the names of the table;
#: parameters (block, keep) travel in each task and frame
CODEC_NAMES = tuple(CODECS)
#: values sharing one float32 step, unless a task says otherwise
DEFAULT_BLOCK = 256
if TYPE_CHECKING:  # the names are the table's, which a static checker cannot read
    CodecName = str
    DeltaCodecName = str
else:
    CodecName = Literal[CODEC_NAMES]
    #: the codecs a release delta and a task delta may use (protocol 1.7)
    DeltaCodecName = Literal[DELTA_CODECS]


class UplinkSpec(BaseModel):
    """A task's request: compress this update's change with ``codec`` (blocks of ``block``
    values; with top-k, ``keep`` of each tensor's values) and send the tensors under the
    module prefixes of ``exact`` as they are (``head`` covers ``head.weight``). Sent only to
    an agent whose ``capabilities.codecs`` has ``codec``."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    codec: CodecName
    block: int = Field(DEFAULT_BLOCK, ge=1, le=2**20)
    keep: float | None = Field(None, gt=0, lt=1)
    exact: tuple[Annotated[str, Field(min_length=1, max_length=256)], ...] = Field((), max_length=4096)

    def is_exact(self, name: str) -> bool:
        """Whether tensor ``name`` falls under one of the :attr:`exact` prefixes."""
        return any(name == p or name.startswith(p + ".") for p in self.exact)

    @model_validator(mode="after")
    def _keep_with_top_k(self) -> UplinkSpec:
        if (self.keep is not None) != is_sparse(self.codec):
            raise ValueError("keep goes with a top-k codec, and only with one")
        return self


class CompressedTensor(BaseModel):
    """One compressed tensor in a frame's header."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=256)
    #: the tensor's shape; its values are C-order flat positions 0..prod(shape)-1
    shape: tuple[Annotated[int, Field(ge=0)], ...] = Field(max_length=8)
    #: the decoded tensor's dtype (float32: the only one compressed)
    dtype: Literal["float32"] = "float32"
    #: top-k: how many positions were sent, and how their positions are written
    kept: int | None = Field(None, ge=0)
    index: Literal["bitmap", "gaps"] | None = None


class CodecHeader(BaseModel):
    """Everything besides the arrays a decoder needs (JSON, a few hundred bytes)."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    codec: CodecName
    block: int = Field(ge=1, le=2**20)
    #: compressed tensors, in the order their parts follow each other in the streams
    tensors: tuple[CompressedTensor, ...] = ()
    #: tensors sent as they are, each an array of its own name
    exact: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _consistent(self) -> CodecHeader:
        sparse = is_sparse(self.codec)
        names = [t.name for t in self.tensors] + list(self.exact)
        if len(set(names)) != len(names):
            raise ValueError("a tensor is named twice")
        if any(name.startswith("codec:") for name in names):
            raise ValueError("tensor names starting with 'codec:' are the codec's own")
        if self.codec == "none" and self.tensors:
            raise ValueError("codec none compresses no tensor")
        for t in self.tensors:
            if sparse != (t.kept is not None) or sparse != (t.index is not None):
                raise ValueError(f"{t.name}: kept and index go with a top-k codec, and only with one")
            if t.kept is not None and t.kept > math.prod(t.shape):
                raise ValueError(f"{t.name}: kept {t.kept} of {math.prod(t.shape)} values")
        return self


def tensors_digest(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 of named tensors, independent of their order: for each name in sorted order (by
    its UTF-8 bytes), the name's UTF-8 bytes, a 0 byte, the dtype as numpy spells it
    (``<f4``, ``<i8``, ``|u1``…), a 0 byte, the shape as decimal numbers joined by ``,``, a 0
    byte, and the values' little-endian C-order bytes. A task delta's ``digest``."""
    digest = hashlib.sha256()
    for name in sorted(tensors, key=lambda n: n.encode()):
        value = np.asarray(tensors[name])  # not ascontiguousarray, which makes a scalar of shape (1,)
        little = value.astype(value.dtype.newbyteorder("<"), copy=False)
        digest.update(name.encode() + b"\0" + little.dtype.str.encode() + b"\0"
                      + ",".join(str(d) for d in value.shape).encode() + b"\0")
        digest.update(little.tobytes(order="C"))
    return digest.hexdigest()


__all__ = ["CODEC_NAMES", "DEFAULT_BLOCK", "DELTA_CODECS", "CodecHeader", "CodecName", "CompressedTensor",
           "DeltaCodecName", "UplinkSpec", "tensors_digest"]
