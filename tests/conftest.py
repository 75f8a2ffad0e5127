"""Shared fixtures: a real Mosquitto broker for the whole session, traffic capture.

Tests start many agent processes on small machines; one BLAS thread per process
keeps them from oversubscribing the cores. It must be set before torch (or
numpy's BLAS) is first imported, hence at conftest import time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Agent / coordinator subprocesses started by tests must import this checkout
# even when the package is not pip-installed.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
_pp = os.environ.get("PYTHONPATH", "")
if str(REPO_ROOT) not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), _pp) if p)

import pytest  # noqa: E402

from edgepfl.testing import MosquittoBroker, TrafficCapture, find_mosquitto, find_rabbitmq  # noqa: E402

#: a plugin package's own tests run where the package is installed (tests/integration/methods/test_plugin_package.py)
collect_ignore = ["plugins/edgepfl_toy_plugin"]


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_addoption(parser):
    parser.addoption(
        "--run-benchmarks",
        action="store_true",
        default=False,
        help="also run tests marked 'benchmark' (long accuracy runs; off by default and in CI)",
    )


def pytest_configure(config):
    # Registered here as well as in pyproject.toml so the marker exists however pytest is invoked.
    config.addinivalue_line("markers", "benchmark: long accuracy benchmarks (run only with --run-benchmarks)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-benchmarks") or os.environ.get("EDGEPFL_BENCHMARKS") == "1":
        return
    skip = pytest.mark.skip(reason="benchmark: pass --run-benchmarks (or EDGEPFL_BENCHMARKS=1) to run")
    for item in items:
        if "benchmark" in item.keywords:
            item.add_marker(skip)


def _require(path: str | None, msg: str) -> str:
    """``path`` when the tool was found; else under CI the test fails, elsewhere it skips."""
    if path:
        return path
    if _under_ci():
        pytest.fail(msg + " — required under CI", pytrace=False)
    pytest.skip(msg)


def require_mosquitto() -> str:
    """Path of mosquitto; under CI its absence fails the test, elsewhere it skips."""
    return _require(find_mosquitto(), "mosquitto is not installed: apt-get install mosquitto (or set EDGEPFL_MOSQUITTO)")


def require_fmnist() -> None:
    """Fashion-MNIST's files (``dataset-fashion-mnist``); under CI, where setup installs them, their
    absence fails the test, elsewhere it skips."""
    from edgepfl.data import FMNIST_PACKAGE, fmnist_available

    _require("yes" if fmnist_available() else None, f"Fashion-MNIST is not installed: apt-get install {FMNIST_PACKAGE}")


def require_rabbitmq() -> str:
    """Directory of rabbitmq-server; under CI its absence fails the test, elsewhere it skips."""
    return _require(find_rabbitmq(), "RabbitMQ is not installed: apt-get install rabbitmq-server "
                                     "(or set EDGEPFL_RABBITMQ_BIN)")


def require_nspawn() -> str:
    """Path of systemd-nspawn, for a test run as root that boots a container under a real
    systemd; under CI their absence fails the test, elsewhere it skips."""
    import shutil

    nspawn = shutil.which("systemd-nspawn") if os.geteuid() == 0 else None
    return _require(nspawn, "needs root and systemd-nspawn (apt-get install systemd-container)")


#: the most workers ``-n auto`` (pyproject's addopts) starts: each runs its own broker, warm
#: trainer-agent server and up to a handful of agent processes (~300 MB of torch each), and the
#: federations' rounds wait on each other's CPU; past four, more workers buy little time for
#: their memory. PYTEST_XDIST_AUTO_NUM_WORKERS still overrides.
MAX_AUTO_WORKERS = 4


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """pytest-xdist's ``-n auto``: one worker per core the process may use, at most MAX_AUTO_WORKERS."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS))


@pytest.fixture(scope="session")
def mosquitto():
    """A running :class:`MosquittoBroker` on a free loopback port, shared by the session.

    Tests that share it must use distinct federation names (or topics) so that
    retained messages from one test don't leak into another.
    """
    require_mosquitto()
    broker = MosquittoBroker()
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def broker_capture(mosquitto):
    """A :class:`TrafficCapture` on the session broker, subscribed to ``#``, empty at test start.

    It records only traffic published during the test (retained replays are skipped).
    """
    cap = TrafficCapture(mosquitto.url)
    cap.start()
    cap.clear()
    try:
        yield cap
    finally:
        cap.stop()


def _pristine_logging() -> tuple[list, int, bool]:
    import logging

    logger = logging.getLogger("edgepfl")
    return list(logger.handlers), logger.level, logger.propagate


#: the ``edgepfl`` logger as the test session found it, before any CLI call configured it
_PRISTINE_LOGGING = _pristine_logging()


def _reset_edgepfl_logging() -> None:
    import logging

    logger, root = logging.getLogger("edgepfl"), logging.getLogger()
    handlers, level, propagate = _PRISTINE_LOGGING
    logger.handlers[:] = handlers
    logger.setLevel(level)  # not `.level =`: setLevel also clears the loggers' cached levels
    logger.propagate = propagate
    for name, child in logging.Logger.manager.loggerDict.items():  # a dictConfig may disable them
        if name.startswith("edgepfl.") and isinstance(child, logging.Logger):
            child.disabled = False
    # --log-format json also puts a handler on the root logger and captures warnings there
    for handler in [h for h in root.handlers if getattr(h, "_edgepfl", False)]:
        root.removeHandler(handler)
    logging.captureWarnings(False)


@pytest.fixture(autouse=True)
def _edgepfl_logging_restored():
    """An in-process CLI call points the ``edgepfl`` logger at the sys.stderr of that moment —
    pytest's capture file for that test, closed after it — and stops its propagation. Later
    tests then log into a closed file ("--- Logging error ---") and caplog misses their
    records. Reset to the session's pristine logger before and after every test: restoring a
    snapshot taken at the test's start is not enough, since a module-scoped fixture may have
    called the CLI before that snapshot."""
    _reset_edgepfl_logging()
    yield
    _reset_edgepfl_logging()


#: the trainer agents tests start through edgepfl.coordinator.simulate (spawn_agent, simulate
#: over a broker) fork from a warm interpreter (tests/warm_cli.py); set to 1 for fresh ones
COLD_AGENTS_ENV = "EDGEPFL_TEST_COLD_AGENTS"
_WARM_AGENTS: list = []


def _warm_trainer_agents() -> None:
    """Point edgepfl.coordinator.simulate's ``subprocess`` at the warm trainer agents once it is imported."""
    module = sys.modules.get("edgepfl.coordinator.simulate")
    if not _WARM_AGENTS or module is None or module.subprocess is _WARM_AGENTS[0]:
        return
    module.subprocess = _WARM_AGENTS[0]


@pytest.fixture(scope="session", autouse=True)
def _warm_trainer_agents_server():
    """Every trainer agent process imports torch, edgepfl and (its warm-up) torch._dynamo before
    it announces itself: seconds of CPU each, hundreds of times a suite. The server that forks
    them instead starts with the first one and stops (killing any left) with the session."""
    if os.environ.get(COLD_AGENTS_ENV) == "1":
        yield
        return
    from tests.warm_cli import WarmTrainerAgents

    _WARM_AGENTS.append(WarmTrainerAgents())
    _warm_trainer_agents()
    try:
        yield
    finally:
        module = sys.modules.get("edgepfl.coordinator.simulate")
        if module is not None and module.subprocess is _WARM_AGENTS[0]:
            import subprocess

            module.subprocess = subprocess
        _WARM_AGENTS.pop().close()


@pytest.fixture(autouse=True)
def _trainer_agents_warm():
    _warm_trainer_agents()  # a test module may import the simulate module late


@pytest.fixture(scope="module")
def ref():
    """PROTOCOL.md §14's reference codec: all an attacker (or a foreign agent) knows of edgepfl."""
    from tests.unit.protocol.test_protocol import DOC, doc_block

    namespace: dict = {}
    exec(compile(doc_block("reference-codec"), str(DOC), "exec"), namespace)
    return namespace
