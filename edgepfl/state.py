"""Server state and its checkpoint format: what the coordinator keeps between rounds.

:class:`ServerState` is what a method's server step maps to the next round's state.
A checkpoint of it, in ``<run>/checkpoint/``, is ``state.safetensors`` (the flattened
state) and ``state.json`` (round completed, the run it belongs to, counters). The JSON
is written last and names the tensor file's sha256, so a crash between the two writes
leaves a checkpoint that is detected as inconsistent rather than silently mixed.

The coordinator writes checkpoints; export reads them. Both import this core module.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import read_tensors, write_json, write_tensors

TensorDict = dict[str, np.ndarray]


@dataclass
class ServerState:
    """What the coordinator keeps between rounds (and checkpoints).

    ``global_tensors``: shared parameters (``state_dict`` keys) and ``server/`` extras
    sent to every agent. ``client_tensors``: per-agent tensors a method computes on
    the server (FedPAC's combined heads). ``extra``: JSON-able scalars.
    """

    global_tensors: TensorDict
    client_tensors: dict[str, TensorDict] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def shared_params(self) -> TensorDict:
        return {k: v for k, v in self.global_tensors.items() if "/" not in k}

    def to_flat(self) -> TensorDict:
        flat = {f"global::{k}": v for k, v in self.global_tensors.items()}
        for agent, tensors in self.client_tensors.items():
            flat.update({f"client::{agent}::{k}": v for k, v in tensors.items()})
        return flat

    @classmethod
    def from_flat(cls, flat: TensorDict, extra: dict[str, Any] | None = None) -> ServerState:
        state = cls(global_tensors={}, extra=dict(extra or {}))
        for key, value in flat.items():
            parts = key.split("::")
            if parts[0] == "global":
                state.global_tensors[parts[1]] = value
            elif parts[0] == "client":
                state.client_tensors.setdefault(parts[1], {})[parts[2]] = value
        return state


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
