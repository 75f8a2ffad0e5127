"""A memory cgroup of the test's own, as systemd's ``MemoryMax=`` makes one: a cap the
kernel enforces on a process and every child it starts, together, and the peak they reached.

cgroup v2 (a writable ``memory`` controller under ``/sys/fs/cgroup``: ``memory.max``,
``memory.peak``, ``memory.events``) or v1 (the ``memory`` hierarchy: ``limit_in_bytes``,
``max_usage_in_bytes``, ``oom_control``). :func:`new_memory_cgroup` raises
:class:`CgroupUnavailable` where neither can be created here (not root, no memory
controller): a test that needs one says so instead of passing without it.

A process leaves the group only by ending; :meth:`MemoryCgroup.remove` waits a moment for
the kernel to let the last of them go.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from pathlib import Path


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made here."""


class MemoryCgroup:
    """One cgroup: :meth:`command` wraps a command line so that it starts inside it."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    def _file(self, v2_name: str, v1_name: str) -> Path:
        return self.path / (v2_name if self.v2 else v1_name)

    def set_limit(self, limit_bytes: int) -> None:
        self._file("memory.max", "memory.limit_in_bytes").write_text(str(limit_bytes))
        if self.v2:  # no swap to spill into: the cap is the cap, as on a Pi without swap
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")
        else:
            with contextlib.suppress(OSError):  # memsw exists only with swap accounting on
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this cgroup (the shell joins it, then becomes ``argv``)."""
        procs = self.path / "cgroup.procs"
        return ["/bin/sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "memory-cgroup", *argv]

    @property
    def peak_bytes(self) -> int:
        """The most memory the processes in it held at once (anonymous and page cache)."""
        return int(self._file("memory.peak", "memory.max_usage_in_bytes").read_text())

    @property
    def anon_bytes(self) -> int:
        """Anonymous memory its processes hold now (what no page-cache reclaim can free)."""
        stats = dict(line.split() for line in (self.path / "memory.stat").read_text().splitlines())
        return int(stats["anon" if self.v2 else "rss"])

    @property
    def oom_kills(self) -> int:
        """How many of its processes the kernel killed for memory."""
        text = self._file("memory.events", "memory.oom_control").read_text()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):  # a killed process leaves the cgroup a moment after it exits
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _parent() -> tuple[Path, bool]:
    unified = Path("/sys/fs/cgroup")
    controllers = unified / "cgroup.controllers"
    if controllers.is_file() and "memory" in controllers.read_text().split():
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                here = unified / line[3:].lstrip("/")
                try:  # children of ``here`` get the memory controller only if ``here`` hands it down
                    (here / "cgroup.subtree_control").write_text("+memory")
                except OSError:  # "no internal processes": a cgroup with processes cannot
                    break
                return here, True
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers_, path = line.split(":", 2)
        if "memory" in controllers_.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), False
    raise CgroupUnavailable("no memory cgroup controller on this machine")


def new_memory_cgroup(limit_bytes: int | None = None) -> MemoryCgroup:
    """A new memory cgroup, capped at ``limit_bytes`` (None: no cap, only the peak); the caller
    calls :meth:`MemoryCgroup.remove` once its processes have ended."""
    try:
        parent, v2 = _parent()
        path = parent / f"edgepfl-test-{uuid.uuid4().hex[:8]}"
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot create a memory cgroup here: {exc}") from None
    group = MemoryCgroup(path, v2)
    if limit_bytes is not None:
        try:
            group.set_limit(limit_bytes)
        except OSError as exc:
            group.remove()
            raise CgroupUnavailable(f"cannot cap a memory cgroup here: {exc}") from None
    return group
