"""Server state and its checkpoint format: what the coordinator keeps between rounds.

:class:`ServerState` is what a method's server step maps to the next round's state.
A checkpoint of it, in ``<run>/checkpoint/``, is one unit of two files: a tensor file
``state-<sha256 prefix>.safetensors`` (the flattened state) and ``state.json``: the
:class:`CheckpointMeta` (round completed, the run's :class:`~edgepfl.protocol.run.RunSpec`,
counters) plus the state's JSON extras and the tensor file's name and sha256. The new
tensor file is written beside the old one, then ``state.json`` is replaced (the commit),
then the old tensor file is removed: a crash at any point leaves ``state.json`` naming a
complete tensor file, the old checkpoint or the new one (``tests/integration/rounds/
test_crash_consistency.py`` kills a run at each point). A checkpoint of an earlier version
(``state.safetensors``, no file name in the JSON) still loads.

The coordinator writes checkpoints; export reads them. Both import this core module.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .atomic import tensors_bytes, tensors_from_bytes, write_bytes, write_json
from .failpoints import failpoint
from .protocol.run import RunSpec
from .specs import DataSpec

#: named arrays: a model's tensors, an update, a checkpoint's state (this is the type's one home)
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
    """A checkpoint that cannot be used: inconsistent files, or a ``state.json`` of another shape."""


class CheckpointMeta(BaseModel):
    """What a checkpoint records about its run besides the tensors."""

    model_config = ConfigDict(defer_build=True, extra="forbid", protected_namespaces=())

    round: int = Field(ge=-1, description="last completed round; -1: an untrained model")
    run: RunSpec
    data_spec: DataSpec | None = Field(
        None, description="the run's client data config; export calibrates BatchNorm statistics from it")
    rejected_total: dict[str, int] = Field(default_factory=dict, description="rejected messages per reason, all rounds")
    refused_total: dict[str, int] = Field(default_factory=dict, description="refused tasks per reason, all rounds")
    aborted_streak: int = Field(0, ge=0, description="training rounds aborted in a row up to this one")
    good_round: int | None = Field(
        None, ge=-1, description="the last good state: the global state after this round (-1: the initial one), "
                                 "from which a later round was adopted; kept in good-<round>/ beside this checkpoint")
    epoch: int | None = Field(
        None, ge=0, description="when the run began (Unix ms), kept across resumes: tasks carry it so that agents "
                                "order a fresh run's tasks after an old run's")


#: the tensor file of a checkpoint written before the name was part of ``state.json``
LEGACY_TENSORS_FILE = "state.safetensors"


class _StateJson(CheckpointMeta):
    """``state.json``: the meta plus what :class:`ServerState` and the tensor file need."""

    server_extra: dict[str, Any] = Field(default_factory=dict)
    tensors_file: str = Field(LEGACY_TENSORS_FILE, pattern=r"^state(-[0-9a-f]{16})?\.safetensors$",
                              description="the tensor file beside this one (older checkpoints: state.safetensors)")
    tensors_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    def meta(self) -> CheckpointMeta:
        return CheckpointMeta(**{k: getattr(self, k) for k in CheckpointMeta.model_fields})


def save_checkpoint(directory: str | Path, state: ServerState, meta: CheckpointMeta) -> None:
    """Persist ``state`` and ``meta`` (``meta.round``: the last completed round) as one unit:
    the new tensor file, then ``state.json`` naming it, then the old tensor file removed."""
    directory = Path(directory)
    data = tensors_bytes(state.to_flat())
    digest = hashlib.sha256(data).hexdigest()
    name = f"state-{digest[:16]}.safetensors"
    write_bytes(directory / name, data)
    failpoint("checkpoint.tensors_written")
    record = _StateJson(**dict(meta), server_extra=state.extra, tensors_file=name, tensors_sha256=digest)
    write_json(directory / "state.json", record.model_dump(mode="json"))
    failpoint("checkpoint.committed")
    for old in directory.glob("state*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    for torn in directory.glob(".state*.tmp"):  # a write a crash cut short
        torn.unlink(missing_ok=True)


def _read_state_json(meta_path: Path) -> _StateJson:
    try:
        return _StateJson.model_validate_json(meta_path.read_bytes())
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        raise CheckpointError(f"{meta_path}: {loc}: {err.get('msg')} (not a checkpoint of this edgepfl version?)") from None


def read_checkpoint_meta(directory: str | Path) -> CheckpointMeta | None:
    """The meta of the checkpoint in ``directory`` without reading its tensors; None when there is none."""
    meta_path = Path(directory) / "state.json"
    if not meta_path.exists():
        return None
    return _read_state_json(meta_path).meta()


def load_checkpoint(directory: str | Path) -> tuple[ServerState, CheckpointMeta] | None:
    """Return (state, meta) or None when there is no checkpoint yet."""
    directory = Path(directory)
    meta_path = directory / "state.json"
    if not meta_path.exists():
        return None
    record = _read_state_json(meta_path)
    tensors_path = directory / record.tensors_file
    if not tensors_path.exists():
        raise CheckpointError(f"{tensors_path} missing")
    data = tensors_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.tensors_sha256:
        raise CheckpointError(f"{tensors_path} does not match {meta_path} (changed on disk since it was written)")
    state = ServerState.from_flat(tensors_from_bytes(data), record.server_extra)
    return state, record.meta()
