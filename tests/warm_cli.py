"""Run ``python -m <module> ...`` commands in processes forked from one warm interpreter.

A test that runs the same command many times (a coordinator killed at each write point and
resumed, the conformance kit against each mutant) pays the interpreter's start-up every
time: importing torch, edgepfl and the rest is most of what a small run costs on a 2-core
box (its first optimizer alone imports ``torch._dynamo``, seconds more). :class:`WarmCli`
starts one server process that imports those once and forks a child per command. The child
is a real process of its own, run as ``python -m`` runs a module (:func:`runpy.run_module`),
with the command's environment, working folder, stdin from /dev/null and its output in
files; it can be killed, and kill itself (``EDGEPFL_FAILPOINT``), like any other, and its
exit status comes back as :class:`subprocess.CompletedProcess` does (``-9``: SIGKILL).

What a fresh interpreter would differ in: the children share the server's string hash seed
and the global random states it left (a test that compares runs for equal bits should keep
one side a fresh process), and what the preloaded modules did at import time happened once,
in the server. The server forks only while it has a single thread, so no lock is held across
the fork; it kills its children when the test side goes away.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SERVER = r"""
import json, os, runpy, select, signal, sys, threading

for name in json.loads(sys.argv[1]):
    __import__(name)
requests, replies = sys.stdin, sys.stdout
children = {}  # pid -> (request id, pidfd)


def single_threaded():
    return threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1


def child(request):
    # as `python -m module argv...` would start: its own folder, environment, argv and files
    code = 1
    try:
        for _, fd in children.values():  # the siblings' handles are the server's
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler if request["sigint"] else signal.SIG_IGN)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = [request["module"], *request["argv"]]
        # a fresh `python -m` runs the module as __main__ without having imported it first
        sys.modules.pop(request["module"], None)
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int) and exc.code is not None:
                print(exc.code, file=sys.stderr)
        # what the interpreter does on its way out: wait for its threads, run atexit, flush
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def reply(**fields):
    replies.write(json.dumps(fields) + "\n")
    replies.flush()


reply(ready=single_threaded())
stdin, pending = requests.fileno(), b""  # read unbuffered: select sees only what no buffer holds
try:
    while True:
        ready, _, _ = select.select([stdin, *(fd for _, fd in children.values())], [], [])
        for pid, (rid, fd) in list(children.items()):
            if fd in ready:
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                del children[pid]
                reply(id=rid, returncode=os.waitstatus_to_exitcode(status))
        if stdin not in ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if not single_threaded():
                reply(id=request["id"], error="the server has more than one thread: it will not fork")
                continue
            pid = os.fork()
            if pid == 0:
                child(request)
            children[pid] = (request["id"], os.pidfd_open(pid))
            reply(id=request["id"], pid=pid)
finally:
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)  # nothing of its own to flush; finalizing torch would only take seconds
"""


class WarmCli:
    """A server that has imported ``preload`` and forks a child per :meth:`run` (thread-safe)."""

    def __init__(self, preload: list[str]):
        self._dir = tempfile.TemporaryDirectory(prefix="warm-cli-")
        self._server = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(preload)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        assert self._server.stdin is not None and self._server.stdout is not None
        first = self._server.stdout.readline()
        if not first or not json.loads(first).get("ready"):
            self.close()
            raise RuntimeError(f"the warm CLI server did not start single-threaded (OMP_NUM_THREADS=1?): {first!r}")
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, queue.Queue[dict]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._server.stdout is not None
        for line in self._server.stdout:
            message = json.loads(line)
            with self._lock:
                box = self._waiting.get(message["id"])
            if box is not None:
                box.put(message)

    def run(self, module: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float = 600, sigint: bool = True) -> subprocess.CompletedProcess:
        """``python -m module *argv`` in a forked child: its exit status and output, as
        ``subprocess.run(..., capture_output=True, text=True)`` gives them; TimeoutExpired
        (the child killed) past ``timeout``. ``sigint``: whether SIGINT raises KeyboardInterrupt
        in the child, as in a process started in the foreground."""
        with self._lock:
            rid = self._next
            self._next += 1
            box: queue.Queue[dict] = queue.Queue()
            self._waiting[rid] = box
        out, err = Path(self._dir.name) / f"{rid}.out", Path(self._dir.name) / f"{rid}.err"
        request = {"id": rid, "module": module, "argv": [str(a) for a in argv], "sigint": sigint,
                   "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
                   "stdout": str(out), "stderr": str(err)}
        args = [sys.executable, "-m", module, *request["argv"]]
        deadline = time.monotonic() + timeout
        try:
            with self._lock:
                assert self._server.stdin is not None
                self._server.stdin.write(json.dumps(request) + "\n")
                self._server.stdin.flush()
            pid = None
            while True:
                try:
                    message = box.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    if pid is not None:
                        os.kill(pid, 9)
                    raise subprocess.TimeoutExpired(args, timeout) from None
                if "error" in message:
                    raise RuntimeError(message["error"])
                if "pid" in message:
                    pid = message["pid"]
                    continue
                return subprocess.CompletedProcess(args, message["returncode"], out.read_text(errors="replace"),
                                                   err.read_text(errors="replace"))
        finally:
            with self._lock:
                del self._waiting[rid]
            out.unlink(missing_ok=True)
            err.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the server; it kills the children still running."""
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()
        try:
            self._server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._dir.cleanup()

    def __enter__(self) -> WarmCli:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
