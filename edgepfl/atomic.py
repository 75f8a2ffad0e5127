"""Crash-safe file writes (a temp file in the same directory, fsync, rename) and the modes
files get.

A written file gets the mode a plain ``open(path, "w")`` would give it (0666 less the
process's umask), never writable by group or others whatever the umask (state that another
local user could rewrite is not state): releases, manifests and reports are readable where
the umask says. ``private=True`` (private keys) gives 0600 whatever the umask. Directories
made here get 0755 less the umask, on the same rule. :func:`read_private` reads a secret
(a password, a key) only from a file no one else may read.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
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


#: never granted to group or others, whatever the umask
NOT_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


def make_dirs(path: str | Path) -> Path:
    """``mkdir -p`` whose new directories get 0755 less the umask (never group/other-writable)."""
    target = path = Path(path)
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o777 & ~NOT_SHARED_WRITE)
        except FileExistsError:  # made meanwhile by another writer
            pass
    return target


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path``. A write, flush or fsync raises an OSError that names no file: a
    full disk said only "cannot write: No space left on device", which names nothing; the error the
    operator sees names the file it concerns."""
    return OSError(exc.errno, exc.strerror, str(path))


@contextmanager
def naming_errors(path: str | Path) -> Iterator[None]:
    """Re-raise an OSError of the block that names no file as one naming ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise _naming(exc, Path(path)) from exc
        raise


def open_for_append(path: str | Path):
    """``path`` opened to append bytes, created (with its directories) on the same mode rule
    as :func:`write_bytes`: for logs and row files, which grow instead of being replaced."""
    path = Path(path)
    make_dirs(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666 & ~NOT_SHARED_WRITE)
    return os.fdopen(fd, "ab")


def read_private(path: str | Path, what: str) -> bytes:
    """The bytes of a secret file; ``ValueError`` (one line, naming ``what``) when it cannot
    be read or group or others may read or write it (as ssh does with a private key)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path} is accessible by others (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    return data


def write_bytes(path: str | Path, data: bytes, *, private: bool = False) -> None:
    """Atomically replace ``path`` with ``data`` (readers see the old or the new file, never half).

    The file's mode is 0666 less the umask and less group/other write, or 0600 when
    ``private`` (secrets).
    """
    path = Path(path)
    make_dirs(path.parent)
    # mkstemp creates 0600, which is right for the temp file and for secrets only
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600 if private else 0o666 & ~(current_umask() | NOT_SHARED_WRITE))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        failpoint("atomic.written")
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.filename is None:
            raise _naming(exc, path) from exc
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
