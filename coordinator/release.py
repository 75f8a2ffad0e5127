"""Encoder releases: export the frozen encoder of the current server state and wrap
it in a ``release`` message (manifest + sha256 + the ONNX bytes and, when the method
shares parameters outside the encoder, the global heads file's bytes; a sequence number
and an expiry; signed with the coordinator's key when it has one) for head-tier agents,
and publish it so that agents joining later, after this coordinator exited too, get it."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from edgepfl.atomic import write_bytes, write_json
from edgepfl.config import RunConfig
from edgepfl.methods import ServerState
from edgepfl.protocol import MessageType, ReleaseMeta, ReleaseRef, bounded_json, decode, encode
from edgepfl.protocol.manifest import release_tensors
from edgepfl.protocol.signing import Signer
from edgepfl.state import CheckpointMeta

from .fleet import SENDER, Fleet

log = logging.getLogger("edgepfl.coordinator")

SEQUENCE_FILE = "sequence.json"
#: the frame of the last release published (what a resumed coordinator names and sends again)
CURRENT_FILE = "current.frame"
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
    """Publish a release frame through ``fleet``, named by reference in the coordinator's
    presence; returns the retained part topics it occupies.

    The frame and the count are recorded in ``releases_dir`` (atomically, after
    publishing): the next release, of this session or of a restarted coordinator of the
    run, clears the parts it does not overwrite, and a resumed coordinator names the
    release again (:func:`resume_release`).
    """
    path = Path(releases_dir) / PUBLISHED_FILE
    earlier = int(bounded_json.loads(path.read_text())["parts"]) if path.is_file() else 0
    ref = decode(frame).meta_as(ReleaseMeta).ref()  # named in the presence (PROTOCOL.md §12)
    parts = fleet.publish_release(frame, round, earlier_parts=earlier, ref=ref)
    write_bytes(Path(releases_dir) / CURRENT_FILE, frame)
    write_json(path, {"parts": parts, "round": round})
    return parts


def resume_release(fleet: Fleet, releases_dir: Path) -> ReleaseRef | None:
    """Give a resumed coordinator's ``fleet`` the run's current release, as published
    before the restart (still retained at the broker): its presence names it again, and it
    goes to the head agents that lack it. None when the run has published none."""
    path, frame_path = Path(releases_dir) / PUBLISHED_FILE, Path(releases_dir) / CURRENT_FILE
    if not (path.is_file() and frame_path.is_file()):
        return None
    frame = frame_path.read_bytes()
    ref = decode(frame).meta_as(ReleaseMeta).ref()
    fleet.resume_release(frame, int(bounded_json.loads(path.read_text()).get("round", -1)), ref)
    log.info("the run's current release is %s (published before the restart)", ref.release_id)
    return ref
