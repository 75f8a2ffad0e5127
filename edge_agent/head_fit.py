"""A head agent fits its personal head in a short child process: ``python -m edgepfl.edge_agent.head_fit DIR``.

Fitting needs scikit-learn and scipy (torch for a method's own head): 64 MiB and most of a
second of imports on a Pi before the first row is fitted, and a long-running process never
gives memory it has touched back. So the agent computes the features itself (onnxruntime,
which it holds anyway), hands them to a child that imports the fitting libraries, fits the
release's method's head, exports it to ONNX and exits; the agent evaluates and serves the
exported head with onnxruntime alone (docs/BENCHMARKS.md, "A head tier that fits"). The
child runs exactly the code an in-process fit ran (:func:`fit_head`: the method's
``make_head``, ``fit``, :func:`edgepfl.export.heads.head_to_onnx`) on the same float32
features, so the head chosen and its predictions do not change.

The child runs beside the agent, so both are kept small for the device's cap (BENCHMARKS, "A
whole head device in 150 MB"): the child imports neither skl2onnx (the generic heads' graphs
are written with ``onnx.helper``) nor the agent loop, and the agent closes its sessions and
hands freed heap back (:func:`return_freed_memory`) before it starts the child.

The exchange is a private directory the agent creates and removes: it writes
``request.json`` (:class:`FitRequest`), ``features.npy`` and ``labels.npy``; the child
writes ``head.onnx`` and exits 0, or writes ``refused.txt`` (why there is no head, as the
agent reports it) and exits :attr:`~edgepfl.errors.ExitCode.DATA`, or exits
:attr:`~edgepfl.errors.ExitCode.MEMORY` when memory ran out. A child the kernel killed
(SIGKILL: the OOM killer) or whose stderr says memory ran out is out of memory too: the
agent raises :class:`~edgepfl.errors.OutOfMemory`, never a refusal of a good release.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from edgepfl.errors import ExitCode, OutOfMemory, memory_message, out_of_memory
from edgepfl.heads import HeadRelease
from edgepfl.heads.labels import LabelSpace

if TYPE_CHECKING:  # pragma: no cover
    from edgepfl.heads.estimators import HeadEstimator

CHILD_MODULE = "edgepfl.edge_agent.head_fit"
REQUEST, FEATURES, LABELS, HEAD, REFUSED = "request.json", "features.npy", "labels.npy", "head.onnx", "refused.txt"
#: the child's own measure of its fit, in seconds: the agent reports it, not the child's start-up
FIT_SECONDS = "fit_seconds.txt"
#: the child's stderr, kept in the exchange directory (a pipe could fill while the agent waits)
STDERR = "stderr.txt"
#: how often the agent looks at the child while it waits (well inside any WatchdogSec=)
WATCH_S = 1.0


class FitRefused(ValueError):
    """No head of the asked kind can be fitted on this release and these features; the
    message says why, in the words the agent's refusal of the release uses."""


class FitRequest(BaseModel):
    """What fitting a device's head needs besides the features: the release's method, the
    device's head kind and parameters, what its labels mean, and the encoder it is for."""

    model_config = ConfigDict(defer_build=True, extra="forbid")

    method: str
    method_options: dict[str, Any]
    head_kind: str
    head_params: dict[str, Any]
    label_names: list[str]
    label_kind: Literal["federation", "local"]
    encoder_sha256: str
    #: the release's global heads file, for a method's own head (None: the release carried none)
    global_heads: str | None = None

    def release(self) -> HeadRelease:
        return HeadRelease(self.method, self.method_options, Path(self.global_heads) if self.global_heads else None)


def new_head(release: HeadRelease, head_kind: str, head_params: dict[str, Any]) -> HeadEstimator:
    """The unfitted head of ``head_kind`` that ``release``'s method builds (with ``head_params``
    overriding its parameters). Raises ``KeyError`` for a method this installation does not
    know, ``ValueError`` or ``ImportError`` when the method offers no such head here."""
    from edgepfl.methods import create_method

    return create_method(release.method, release.method_options).make_head(head_kind, release, **head_params)


def fit_head(request: FitRequest, features: np.ndarray, labels: np.ndarray) -> tuple[bytes, float]:
    """Fit the head ``request`` names on feature rows and labels; its ONNX bytes (the
    encoder's sha256 and the labels' names in its metadata) and the seconds ``fit`` took
    (as ``edgepfl fit-head`` reports them). Raises :class:`FitRefused`."""
    from edgepfl.export.heads import META_ENCODER_SHA, head_to_onnx

    release = request.release()
    kind = request.head_kind
    try:
        head = new_head(release, kind, request.head_params)
    except KeyError as exc:  # a method this installation does not know
        raise FitRefused(f"no {kind} head for this release: {exc.args[0]}") from None
    except (ValueError, ImportError) as exc:  # not offered, bad options, or it needs torch
        if out_of_memory(exc):
            raise
        raise FitRefused(f"no {kind} head for this {release.method} release: {exc}") from None
    space = LabelSpace(tuple(request.label_names), request.label_kind)
    try:
        start = time.perf_counter()
        head.fit(features, labels)
        seconds = time.perf_counter() - start
        return head_to_onnx(head, features.shape[1], labels=space,
                            metadata={META_ENCODER_SHA: request.encoder_sha256}), seconds
    except (ValueError, ImportError) as exc:  # ImportError: a method's own head needs torch
        if out_of_memory(exc):
            raise
        raise FitRefused(f"cannot fit a {kind} head on local data: {exc}") from None


def fit_in_child(request: FitRequest, features: np.ndarray, labels: np.ndarray,
                 scratch: str | Path) -> tuple[bytes, float]:
    """:func:`fit_head` in a child process (the module's protocol), its exchange directory
    created in ``scratch`` and removed again. Raises :class:`FitRefused`,
    :class:`~edgepfl.errors.OutOfMemory`, or ``RuntimeError`` for anything else the child
    died of (its last stderr line). An exception while waiting (a stop) kills the child."""
    Path(scratch).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".head-fit-", dir=scratch) as tmp:
        work = Path(tmp)
        (work / REQUEST).write_text(request.model_dump_json())
        np.save(work / FEATURES, np.ascontiguousarray(features, dtype=np.float32), allow_pickle=False)
        np.save(work / LABELS, np.asarray(labels), allow_pickle=False)
        with open(work / STDERR, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", CHILD_MODULE, str(work)], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
            try:
                _wait_feeding_watchdog(proc)
            except BaseException:  # a stop (service.Stopped) or anything else: the child goes too
                proc.kill()
                proc.wait()
                raise
        if proc.returncode == 0:
            return (work / HEAD).read_bytes(), float((work / FIT_SECONDS).read_text())
        stderr = (work / STDERR).read_text(errors="replace").strip()
        last = stderr.splitlines()[-1] if stderr else f"exit status {proc.returncode}"
        if proc.returncode == ExitCode.DATA and (work / REFUSED).is_file():
            raise FitRefused((work / REFUSED).read_text())
        if proc.returncode in (ExitCode.MEMORY, -signal.SIGKILL) or memory_message(stderr):
            why = "killed (SIGKILL, the kernel's OOM killer)" if proc.returncode == -signal.SIGKILL else last
            raise OutOfMemory(f"fitting a {request.head_kind} head", why)
        raise RuntimeError(f"the head-fitting process failed: {last}")


def return_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's
    ``malloc_trim``; elsewhere only the collection): what a closed onnxruntime session and
    an install's temporaries freed then no longer counts beside the fitting child."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        pass


def _wait_feeding_watchdog(proc: subprocess.Popen) -> None:
    """Wait for the child, feeding systemd's watchdog while it computes (its CPU time, from
    /proc, advances) and not while it does not (hung): the agent's main thread is blocked
    here, so :meth:`~edgepfl.service.ServiceNotifier.fed_while_computing` would see no work
    of its own. A long fit on a slow board is progress; a child stuck forever is not."""
    from edgepfl.service import notifier

    last = _cpu_ticks(proc.pid)
    while True:
        try:
            proc.wait(timeout=WATCH_S)
            return
        except subprocess.TimeoutExpired:
            now = _cpu_ticks(proc.pid)
            if now is None or last is None or now > last:
                notifier().watchdog()
            last = now


def _cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of ``pid`` in clock ticks (None: not readable here)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)


def main(argv: list[str]) -> int:
    """The child: fit what ``DIR/request.json`` asks on ``DIR``'s features; the module's exit codes."""
    work = Path(argv[0])
    try:
        request = FitRequest.model_validate_json((work / REQUEST).read_text())
        features = np.load(work / FEATURES, allow_pickle=False)
        labels = np.load(work / LABELS, allow_pickle=False)
        head, seconds = fit_head(request, features, labels)
        (work / HEAD).write_bytes(head)
        (work / FIT_SECONDS).write_text(repr(seconds))
    except FitRefused as exc:
        (work / REFUSED).write_text(str(exc))
        return int(ExitCode.DATA)
    except Exception as exc:  # MemoryError too: it is an Exception
        if not out_of_memory(exc):
            raise
        print(f"out of memory: {type(exc).__name__}: {exc}", file=sys.stderr)
        return int(ExitCode.MEMORY)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
