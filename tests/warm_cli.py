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
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

SERVER = r"""
import io, json, os, runpy, select, signal, sys, threading

for name in json.loads(sys.argv[1]):
    __import__(name)
requests, replies = sys.stdin, sys.stdout
SERVER_PYTHONPATH = os.environ.get("PYTHONPATH", "")
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
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if request["append"] else os.O_TRUNC)
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], mode, 0o600)
        err = os.dup(out) if request["stderr"] is None else os.open(request["stderr"], mode, 0o600)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # the streams a fresh interpreter opens on them (PYTHONUNBUFFERED: written through)
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        def stream(fd, **how):
            raw = io.FileIO(fd, "w", closefd=False)
            return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), write_through=unbuffered, **how)
        sys.stdout = sys.__stdout__ = stream(1)
        sys.stderr = sys.__stderr__ = stream(2, line_buffering=True, errors="backslashreplace")
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.argv = [request["module"], *request["argv"]]
        # `python -m` puts the working folder first, then PYTHONPATH's folders, then the rest
        ours = {os.path.abspath(p) for p in SERVER_PYTHONPATH.split(os.pathsep) if p}
        theirs = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.getcwd(), *theirs, *(p for p in sys.path[1:] if os.path.abspath(p) not in ours)]
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


class WarmProcess:
    """A child of :class:`WarmCli`, handled as a :class:`subprocess.Popen` is (``pid``,
    ``returncode``, :meth:`poll`, :meth:`wait`, :meth:`send_signal`, :meth:`terminate`, :meth:`kill`)."""

    def __init__(self, args: list[str], pid: int, exited: queue.Queue[dict], release: Callable[[], None]):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._exited = exited
        self._release = release

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._done(self._exited.get_nowait())
            except queue.Empty:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._done(self._exited.get(timeout=timeout))
            except queue.Empty:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        assert self.returncode is not None
        return self.returncode

    def _done(self, message: dict) -> None:
        self.returncode = message["returncode"]
        self._release()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmCli:
    """A server that has imported ``preload`` and forks a child per :meth:`start` or
    :meth:`run` (thread-safe)."""

    def __init__(self, preload: list[str]):
        self.env = os.environ.copy()
        self._dir = tempfile.TemporaryDirectory(prefix="warm-cli-")
        self._server = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(preload)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=self.env)
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

    def start(self, module: str, argv: list[str], *, stdout: str | Path, stderr: str | Path | None = None,
              append: bool = False, env: dict[str, str] | None = None, cwd: str | Path | None = None,
              sigint: bool = True) -> WarmProcess:
        """``python -m module *argv`` in a forked child writing to ``stdout`` (appended to with
        ``append``) and ``stderr`` (None: to ``stdout`` too). ``sigint``: whether SIGINT raises
        KeyboardInterrupt in the child, as in a process started in the foreground."""
        with self._lock:
            rid = self._next
            self._next += 1
            box: queue.Queue[dict] = queue.Queue()
            self._waiting[rid] = box
        request = {"id": rid, "module": module, "argv": [str(a) for a in argv], "sigint": sigint, "append": append,
                   "env": dict(os.environ if env is None else env), "cwd": str(cwd or os.getcwd()),
                   "stdout": str(stdout), "stderr": None if stderr is None else str(stderr)}

        def release() -> None:
            with self._lock:
                self._waiting.pop(rid, None)

        with self._lock:
            assert self._server.stdin is not None
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
        message = box.get(timeout=60)
        if "error" in message:
            release()
            raise RuntimeError(message["error"])
        return WarmProcess([sys.executable, "-m", module, *request["argv"]], message["pid"], box, release)

    def run(self, module: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
            timeout: float = 600, sigint: bool = True) -> subprocess.CompletedProcess:
        """``python -m module *argv`` in a forked child: its exit status and output, as
        ``subprocess.run(..., capture_output=True, text=True)`` gives them; TimeoutExpired
        (the child killed) past ``timeout``."""
        out, err = (Path(tempfile.mkstemp(dir=self._dir.name, suffix=suffix)[1]) for suffix in (".out", ".err"))
        try:
            proc = self.start(module, argv, stdout=out, stderr=err, env=env, cwd=cwd, sigint=sigint)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            return subprocess.CompletedProcess(proc.args, code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))
        finally:
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


#: what a trainer agent imports before it announces itself (its warm-up imports torch._dynamo)
TRAINER_PRELOAD = ["torch", "torch._dynamo", "edgepfl.cli", "edgepfl.edge_agent.agent", "edgepfl.edge_agent.trainer",
                   "edgepfl.methods", "edgepfl.data"]
#: environment read once, when an interpreter starts (or its OpenMP does): a child of the
#: server would not honour a value other than the server's (PYTHONUNBUFFERED and PYTHONPATH it does)
STARTUP_ENV = ("PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_")


class WarmTrainerAgents:
    """Stands in for the ``subprocess`` module of :mod:`edgepfl.coordinator.simulate`: the
    trainer agents ``spawn_agent`` starts (``python -m edgepfl.cli agent --config FILE``) are
    forked from a warm server instead, started at the first of them; everything else, head
    agents included (they must never have imported torch), goes to :class:`subprocess.Popen`."""

    def __init__(self) -> None:
        self._server: WarmCli | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def Popen(self, args, **kwargs):  # noqa: N802 - the name it stands in for
        if self._warm(args, kwargs):
            with self._lock:
                if self._server is None:
                    self._server = WarmCli(TRAINER_PRELOAD)
            log = os.readlink(f"/proc/self/fd/{kwargs['stdout'].fileno()}")  # opened by descriptor: no name
            return self._server.start("edgepfl.cli", list(args[3:]), stdout=log, append=True, env=kwargs.get("env"))
        return subprocess.Popen(args, **kwargs)

    @staticmethod
    def _warm(args, kwargs) -> bool:
        import yaml

        if not (isinstance(args, list) and args[:4] == [sys.executable, "-m", "edgepfl.cli", "agent"]
                and len(args) == 6 and args[4] == "--config"):
            return False
        if set(kwargs) != {"stdout", "stderr", "env"} or kwargs["stderr"] != subprocess.STDOUT \
                or "a" not in getattr(kwargs["stdout"], "mode", ""):
            return False
        env = kwargs["env"] or os.environ
        if any(env.get(k) != os.environ.get(k) for k in {*env, *os.environ}
               if k.startswith(STARTUP_ENV) and k not in ("PYTHONUNBUFFERED", "PYTHONPATH")):
            return False
        config = yaml.safe_load(Path(args[5]).read_text())
        return isinstance(config, dict) and config.get("tier", "trainer") == "trainer"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
