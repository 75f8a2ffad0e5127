"""Encoder releases: export the frozen encoder of the current server state and wrap
it in a ``release`` message (manifest + sha256 + the ONNX bytes and, when the method
shares parameters outside the encoder, the global heads file's bytes; a sequence number
and an expiry; signed with the coordinator's key when it has one) for head-tier agents,
and publish it so that agents joining later, after this coordinator exited too, get it."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from edgepfl.atomic import write_json
from edgepfl.config import RunConfig
from edgepfl.methods import ServerState
from edgepfl.protocol import MessageType, ReleaseMeta, bounded_json, encode
from edgepfl.protocol.manifest import release_tensors
from edgepfl.protocol.signing import Signer
from edgepfl.state import CheckpointMeta

from .fleet import SENDER, Fleet

SEQUENCE_FILE = "sequence.json"
#: how many retained part topics the last published release occupies (0: retained whole)
PUBLISHED_FILE = "published.json"


def next_sequence(releases_dir: Path, now: float | None = None) -> int:
    """The next release's sequence number, recorded in ``releases_dir`` before it is used.

    The wall clock in ms, and at least one more than the last number this run directory
    used: monotonic across restarts of a run (the record) and across fresh run
    directories of the federation (the clock), as long as the clock is not set back
    past the last release; agents refuse a release that is not above the one they have.
    """
    path = Path(releases_dir) / SEQUENCE_FILE
    last = bounded_json.loads(path.read_text())["last"] if path.is_file() else -1
    sequence = max(int((time.time() if now is None else now) * 1000), int(last) + 1)
    write_json(path, {"last": sequence})
    return sequence


def build_release(state: ServerState, meta: CheckpointMeta, releases_dir: Path, config: RunConfig,
                  signer: Signer | None = None) -> tuple[str, bytes]:
    """Export to ``releases_dir/<round>/`` and return (release id, release frame)."""
    from edgepfl.export.onnx_export import export_state, read_global_heads, read_release

    out = Path(releases_dir) / f"round-{meta.round:04d}"
    export_state(state, meta, out)
    manifest, artifact = read_release(out)
    # the global heads: what a DualFed / FedPick head is fitted around (PROTOCOL.md §12)
    tensors = release_tensors(artifact, read_global_heads(out, manifest))
    now = time.time()
    meta_msg = ReleaseMeta(release_id=manifest.release_id, manifest=manifest,
                           sha256=hashlib.sha256(artifact).hexdigest(), size_bytes=len(artifact),
                           sequence=next_sequence(Path(releases_dir), now), expires=now + config.release_ttl_s)
    frame = encode(MessageType.RELEASE, federation=config.federation, sender=SENDER, round=meta.round,
                   meta=meta_msg, tensors=tensors, signer=signer)
    return manifest.release_id, frame


def publish_release(fleet: Fleet, frame: bytes, round: int, releases_dir: Path) -> int:
    """Publish a release frame through ``fleet``; returns the retained part topics it occupies.

    The count is recorded in ``releases_dir`` (atomically, after publishing), so the next
    release, of this session or of a restarted coordinator of the run, clears the parts
    it does not overwrite.
    """
    path = Path(releases_dir) / PUBLISHED_FILE
    earlier = int(bounded_json.loads(path.read_text())["parts"]) if path.is_file() else 0
    parts = fleet.publish_release(frame, round, earlier_parts=earlier)
    write_json(path, {"parts": parts})
    return parts
