"""Coordinator checkpoints: server state after every round, written atomically.

Layout of ``<run>/checkpoint/``: ``state.safetensors`` (the flattened
:class:`~edgepfl.methods.ServerState`) and ``state.json`` (round completed, method,
model spec, data shape, the run config, RNG and counters). The JSON is written
last and names the tensor file's sha256, so a crash between the two writes leaves
a checkpoint that is detected as inconsistent rather than silently mixed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from edgepfl.atomic import read_tensors, write_json, write_tensors
from edgepfl.methods import ServerState


class CheckpointError(RuntimeError):
    pass


def save_checkpoint(directory: str | Path, state: ServerState, meta: dict[str, Any]) -> None:
    """Persist ``state`` and ``meta`` (must include ``round``, the last completed round)."""
    directory = Path(directory)
    tensors_path = directory / "state.safetensors"
    write_tensors(tensors_path, state.to_flat())
    record = dict(meta)
    record["server_extra"] = state.extra
    record["tensors_sha256"] = hashlib.sha256(tensors_path.read_bytes()).hexdigest()
    write_json(directory / "state.json", record)


def load_checkpoint(directory: str | Path) -> tuple[ServerState, dict[str, Any]] | None:
    """Return (state, meta) or None when there is no checkpoint yet."""
    directory = Path(directory)
    meta_path = directory / "state.json"
    if not meta_path.exists():
        return None
    meta = json.loads(meta_path.read_text())
    tensors_path = directory / "state.safetensors"
    if not tensors_path.exists():
        raise CheckpointError(f"{tensors_path} missing")
    digest = hashlib.sha256(tensors_path.read_bytes()).hexdigest()
    if digest != meta.get("tensors_sha256"):
        raise CheckpointError(f"{tensors_path} does not match {meta_path} (interrupted write?)")
    state = ServerState.from_flat(read_tensors(tensors_path), meta.get("server_extra"))
    return state, meta
