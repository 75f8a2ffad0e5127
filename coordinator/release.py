"""Encoder releases: export the frozen encoder of the current server state and wrap
it in a ``release`` message (manifest + sha256 + the ONNX bytes) for head-tier agents."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from edgepfl.config import RunConfig
from edgepfl.methods import ServerState
from edgepfl.protocol import MessageType, ReleaseMeta, encode
from edgepfl.state import CheckpointMeta

from .fleet import SENDER


def build_release(state: ServerState, meta: CheckpointMeta, releases_dir: Path, config: RunConfig) -> tuple[str, bytes]:
    """Export to ``releases_dir/<round>/`` and return (release id, release frame)."""
    from edgepfl.export.onnx_export import export_state, read_release

    out = Path(releases_dir) / f"round-{meta.round:04d}"
    export_state(state, meta, out)
    manifest, artifact = read_release(out)
    meta_msg = ReleaseMeta(release_id=manifest.release_id, manifest=manifest,
                           sha256=hashlib.sha256(artifact).hexdigest(), size_bytes=len(artifact))
    frame = encode(MessageType.RELEASE, federation=config.federation, sender=SENDER, round=meta.round,
                   meta=meta_msg, tensors={"artifact": np.frombuffer(artifact, dtype=np.uint8)})
    return manifest.release_id, frame
