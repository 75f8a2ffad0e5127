"""Crash-safe file writes: write a temp file in the same directory, fsync, rename.

A written file gets the mode a plain ``open(path, "w")`` would give it (0666 less the
process's umask), so releases, manifests and reports are readable where the umask says;
``private=True`` (private keys) gives 0600 whatever the umask.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .failpoints import failpoint


def current_umask() -> int:
    """The process's umask, read without changing it where Linux allows (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (briefly process-wide)
    os.umask(mask)
    return mask


def write_bytes(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Atomically replace ``path`` with ``data`` (readers see the old or the new file, never half).

    The file's mode is 0666 less the umask, or 0600 when ``private`` (secrets).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp creates 0600, which is right for the temp file and for secrets only
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600 if private else 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        failpoint("atomic.written")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    failpoint("atomic.renamed")
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_json(path: str | Path, obj: Any, *, private: bool = False) -> None:
    """Atomically write ``obj`` as indented JSON (mode as :func:`write_bytes`)."""
    write_bytes(path, json.dumps(obj, indent=2, sort_keys=True).encode(), private=private)


def tensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Numpy tensors as a safetensors file's bytes (an empty dict as one empty placeholder)."""
    from safetensors.numpy import save

    payload = {k: np.require(v, requirements="C") for k, v in tensors.items()}  # 0-d stays 0-d
    return save(payload or {"__empty__": np.zeros(0, np.uint8)}, metadata=metadata)


def tensors_from_bytes(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file's bytes (:func:`tensors_bytes`)."""
    from safetensors.numpy import load

    out = load(data)
    out.pop("__empty__", None)
    return out


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Atomically write numpy tensors as safetensors."""
    write_bytes(path, tensors_bytes(tensors, metadata))


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    return tensors_from_bytes(Path(path).read_bytes())
