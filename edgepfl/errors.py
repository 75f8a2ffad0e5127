"""What the command line does with an error: one line on stderr and a documented exit code.

Every user error — a bad argument or config, unusable data or input file, an unreachable
broker, a missing optional extra, too little memory — ends as one line

    edgepfl: <what happened, where>; <what to do>

and one of the exit codes of :class:`ExitCode` (docs/OPERATING.md, "Exit codes"). Anything else is a
bug: it gets exit code 1 and the same one line; ``--debug`` or ``EDGEPFL_DEBUG=1`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import enum
import errno
import sys
from typing import NoReturn

from pydantic import ValidationError


class ExitCode(enum.IntEnum):
    """The ``edgepfl`` command's exit codes; systemd units refuse to restart on USAGE and EXTRA
    (and do restart on MEMORY: memory is often free again a little later)."""

    OK = 0
    OTHER = 1  #: a bug or an unexpected failure
    USAGE = 2  #: bad arguments or configuration: retrying cannot help
    DATA = 3  #: a data set, model, release, run directory or other input file cannot be used; a full disk
    BROKER = 4  #: the MQTT broker cannot be reached, or refused us
    EXTRA = 5  #: an optional extra (torch, onnxruntime, ...) is not installed
    MEMORY = 6  #: out of memory (an allocation, or a library that could not be mapped): retrying may help
    HALTED = 7  #: a staged rollout stopped at a failed gate (``edgepfl release publish``): the release was rolled back
    TERMINATED = 143  #: stopped by SIGTERM (128 + 15)
    INTERRUPTED = 130  #: stopped by SIGINT / Ctrl-C (128 + 2)


class UsageError(ValueError):
    """Command-line arguments that cannot be used together or at all."""


class ModelSpecError(ValueError):
    """A model the run's configuration asks for cannot be built for its data (an arch too
    deep for the images' size): a configuration error, found when the model is built."""


class InputError(ValueError):
    """A file or value named on the command line cannot be used (corrupt, wrong shape, ...)."""


class MissingExtra(ImportError):
    """A command needs an optional dependency that this installation lacks."""

    def __init__(self, what: str, module: str, extra: str):
        super().__init__(f"{what} needs {module}, which is not installed; pip install 'edgepfl[{extra}]'")
        self.module = module
        self.extra = extra


class OutOfMemory(MemoryError):
    """Work that failed for lack of memory, named as such: never a missing extra, never a bad
    input or release (retrying with more memory free may succeed)."""

    def __init__(self, what: str, cause: BaseException | str | None = None):
        detail = f" ({_cause_line(cause)})" if cause is not None else ""
        super().__init__(f"out of memory {what}{detail}")


# What the C library, the dynamic loader and the native runtimes say when an allocation or
# a mapping fails. An ImportError under an address-space limit reads "failed to map segment
# from shared object" (glibc's loader), not "No module named …".
_MEMORY_MESSAGES = ("failed to map segment", "cannot allocate memory", "bad_alloc", "unable to allocate",
                    "out of memory", "memoryerror")


def memory_message(text: str) -> bool:
    """Whether ``text`` (an error message, a child process's stderr) says memory ran out."""
    lowered = text.lower()
    return any(m in lowered for m in _MEMORY_MESSAGES)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` — or an exception it was raised from — is a failure for lack of memory:
    a :class:`MemoryError`, an ``OSError`` with ``ENOMEM``, or an ImportError or a native
    runtime's error (onnxruntime's) whose message says so."""
    return _memory_cause(exc) is not None


def _memory_cause(exc: BaseException) -> BaseException | None:
    """The innermost exception of ``exc``'s chain that says memory ran out (numpy's ImportError
    wraps the loader's one-line reason in a page of advice), or None."""
    found = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or (isinstance(current, OSError) and current.errno == errno.ENOMEM) \
                or memory_message(str(current)):
            found = current
        current = current.__cause__ or current.__context__
    return found


def _cause_line(cause: BaseException | str) -> str:
    if isinstance(cause, BaseException):
        cause = _memory_cause(cause) or cause
        text = str(cause) or type(cause).__name__
        cause = text if type(cause).__name__ in text else f"{type(cause).__name__}: {text}"
    return " ".join(cause.split())[:300]


#: third-party import name -> the extra that installs it
EXTRA_OF_MODULE = {
    "torch": "train", "torchvision": "train", "onnxscript": "train", "scipy": "train", "matplotlib": "train",
    "amqtt": "train", "onnxruntime": "agent", "sklearn": "agent", "onnx": "agent",
    "PIL": "agent", "dp_accounting": "train",
}

#: the hint of an unusable input file that is not a data set
_INPUT_HINT = "check the file or folder it names"
_HINTS = {
    ExitCode.USAGE: "see 'edgepfl {command} --help' and docs/CONFIG.md",
    ExitCode.DATA: "check the file or folder it names (docs/CONFIG.md: data.*)",
    ExitCode.BROKER: "check the broker URL, that the broker is running and reachable, and the credentials",
    ExitCode.OTHER: "rerun with --debug for the traceback, and please report it",
    ExitCode.MEMORY: ("free memory (other programs, a lower threads setting or less local data) and run it again; "
                      "the example units restart it"),
}


#: a write that failed because of the disk, not the file: retrying once there is room helps
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
_STORAGE_HINT = ("free space (or remount read-write) and run the same command again: a coordinator resumes from "
                 "its last checkpoint, written whole or not at all")


def _out_of_storage(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS


def require(module: str, what: str) -> None:
    """Import ``module`` or raise :class:`MissingExtra` naming the extra that installs it
    (:class:`OutOfMemory` when it is installed but could not be loaded for lack of memory)."""
    import importlib

    try:
        importlib.import_module(module)
    except (ImportError, MemoryError) as exc:
        if out_of_memory(exc):
            raise OutOfMemory(f"loading {module} for {what}", exc) from exc
        top = module.split(".")[0]
        raise MissingExtra(what, top, EXTRA_OF_MODULE.get(top, "all")) from None


def require_installed(module: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless ``module`` is installed, without importing it: for
    a check before work starts whose module is imported later, only if it is needed (a head
    agent's fitting libraries cost it memory it must not hold while idle)."""
    import importlib.util

    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        raise MissingExtra(what, top, EXTRA_OF_MODULE.get(top, "all"))


def _one_line(text: str) -> str:
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts).replace(":;", ":").rstrip(".")


def _validation(exc: ValidationError) -> str:
    problems = [f"{'.'.join(str(p) for p in e.get('loc', ())) or '<root>'}: {e.get('msg')}" for e in exc.errors()]
    return f"invalid {exc.title}: " + "; ".join(problems)


def classify(exc: BaseException) -> tuple[ExitCode, str]:
    """The exit code of ``exc`` and its message (not yet one line, without the hint)."""
    if isinstance(exc, MissingExtra):
        return ExitCode.EXTRA, str(exc)
    if isinstance(exc, OutOfMemory):
        return ExitCode.MEMORY, str(exc)
    # before the import and model-file rules (a library that could not be mapped), and before
    # the imports below, which would run out of memory themselves
    if out_of_memory(exc):
        return ExitCode.MEMORY, f"out of memory ({_cause_line(exc)})"
    # imported here: the core's error types live in modules that import much more
    from .broker import BrokerError, BrokerURLError
    from .config_loading import ConfigError
    from .data import DataError, PartitionError
    from .metrics import MetricsError
    from .protocol import ManifestError
    from .protocol.signing import KeyFileError
    from .state import CheckpointError

    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top in EXTRA_OF_MODULE:
            return ExitCode.EXTRA, f"this command needs {top}, which is not installed; " \
                                   f"pip install 'edgepfl[{EXTRA_OF_MODULE[top]}]'"
    if type(exc).__name__ == "RolloutHalted":  # the coordinator app's; the core does not import apps
        return ExitCode.HALTED, str(exc)
    # a key file and a broker URL are configuration too
    if isinstance(exc, (ConfigError, UsageError, KeyFileError, ModelSpecError, BrokerURLError)):
        return ExitCode.USAGE, str(exc)
    if isinstance(exc, ValidationError):
        return ExitCode.USAGE, _validation(exc)
    if isinstance(exc, (ConnectionError, BrokerError)):
        return ExitCode.BROKER, str(exc) or type(exc).__name__
    if isinstance(exc, (DataError, PartitionError, CheckpointError, ManifestError, InputError, MetricsError)):
        return ExitCode.DATA, str(exc)
    if type(exc).__name__ == "ExportError":  # the export app's error; the core does not import apps
        return ExitCode.DATA, str(exc)
    if type(exc).__module__.startswith(("onnxruntime", "onnx", "google.protobuf", "safetensors")):
        return ExitCode.DATA, f"cannot read a model file: {exc}"
    if _out_of_storage(exc):
        assert isinstance(exc, OSError)
        name = f" {exc.filename}" if exc.filename else ""
        return ExitCode.DATA, f"cannot write{name}: {exc.strerror or exc}"
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)):
        name = f": {exc.filename}" if exc.filename else ""
        return ExitCode.DATA, f"{exc.strerror or exc}{name}"
    if isinstance(exc, TimeoutError):
        return ExitCode.BROKER, str(exc) or "timed out"
    return ExitCode.OTHER, f"internal error: {type(exc).__name__}: {exc}"


def report(exc: BaseException, command: str | None, debug: bool = False) -> int:
    """Print ``exc`` as the one ``edgepfl: …`` line (after its traceback when ``debug``); its exit code."""
    code, message = classify(exc)
    if debug:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    line = _one_line(message)
    hint: str | None
    if _out_of_storage(exc):
        hint = _STORAGE_HINT
    elif code == ExitCode.DATA and type(exc).__name__ not in ("DataError", "PartitionError"):
        hint = _INPUT_HINT  # a model, release, manifest or run directory: the data settings are not the place
    else:
        hint = _HINTS.get(code)
    if hint is not None:
        line = f"{line}; {hint.format(command=command or '')}".replace("'edgepfl  --help'", "'edgepfl --help'")
    print(f"edgepfl: {line}", file=sys.stderr)
    return int(code)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one ``edgepfl: …`` line and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        print(f"edgepfl: {message}, in '{self.prog}'; see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(int(ExitCode.USAGE))
