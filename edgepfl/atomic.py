"""Crash-safe file writes: write a temp file in the same directory, fsync, rename."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def write_bytes(path: str | Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (readers see the old or the new file, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_json(path: str | Path, obj: Any) -> None:
    write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode())


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Atomically write numpy tensors as safetensors."""
    from safetensors.numpy import save

    payload = {k: np.require(v, requirements="C") for k, v in tensors.items()}  # 0-d stays 0-d
    write_bytes(path, save(payload, metadata=metadata) if payload else save({"__empty__": np.zeros(0, np.uint8)}, metadata=metadata))


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = load_file(str(path))
    out.pop("__empty__", None)
    return out
