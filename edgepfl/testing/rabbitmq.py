"""A real RabbitMQ cluster with the MQTT plugin, on loopback, for tests and benchmarks.

Each node is a ``rabbitmq-server`` process with its own node name, ports, data and log
directories, all sharing one Erlang cookie; nodes 2..n join node 1 with
``rabbitmqctl join_cluster``. Every node has its own MQTT listener, so clients spread
over the nodes as they would behind a load balancer.

What RabbitMQ's MQTT means for edgepfl (docs/BROKERS.md): messages are routed
cluster-wide, client ids are unique cluster-wide (a second connection with the same id on
another node takes over), but retained messages are stored on the node that received them
and are never sent on a wildcard subscription.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from edgepfl.broker import BrokerError, free_port, wait_for_port

log = logging.getLogger(__name__)

_RABBITMQ_BIN_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/local/opt/rabbitmq/sbin", "/opt/homebrew/opt/rabbitmq/sbin")


def find_rabbitmq() -> str | None:
    """Directory holding ``rabbitmq-server`` and ``rabbitmqctl``, or None.

    ``$EDGEPFL_RABBITMQ_BIN`` wins; then the directories Debian and Homebrew install into
    (Debian's ``/usr/sbin`` wrappers switch to the ``rabbitmq`` user and its fixed
    directories, which a private test node must not use); then ``PATH``.
    """
    candidates = [os.environ.get("EDGEPFL_RABBITMQ_BIN", ""), *_RABBITMQ_BIN_DIRS]
    on_path = shutil.which("rabbitmq-server")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for directory in filter(None, candidates):
        if all(os.access(Path(directory) / exe, os.X_OK) for exe in ("rabbitmq-server", "rabbitmqctl")):
            return directory
    return None


class RabbitMQNode:
    """One node of a :class:`RabbitMQCluster` (started and stopped by the cluster)."""

    def __init__(self, name: str, base: Path, host: str = "127.0.0.1"):
        self.name = name  # Erlang node name, e.g. edgepfl-1a2b3c-1@localhost
        self.host = host
        self.base = base
        self.mqtt_port = free_port(host)
        self.amqp_port = free_port(host)
        self.dist_port = free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.mqtt_port}"

    def log_text(self) -> str:
        logs = sorted((self.base / "log").glob("*.log")) + [self.base / "stdout.log"]
        return "".join(p.read_text(errors="replace") for p in logs if p.exists())

    def env(self, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")}
        env.update(
            HOME=str(home),  # the shared .erlang.cookie lives here, for the nodes and rabbitmqctl
            RABBITMQ_NODENAME=self.name,
            RABBITMQ_NODE_IP_ADDRESS=self.host,
            RABBITMQ_NODE_PORT=str(self.amqp_port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_LOGS=str(self.base / "log" / "node.log"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.base / "node.pid"),
        )
        return env

    def write_config(self, extra_config: str) -> None:
        (self.base / "log").mkdir(parents=True, exist_ok=True)
        (self.base / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        (self.base / "rabbitmq.conf").write_text("\n".join([
            f"listeners.tcp.default = {self.host}:{self.amqp_port}",
            f"mqtt.listeners.tcp.default = {self.host}:{self.mqtt_port}",
            "mqtt.allow_anonymous = true",
            "loopback_users = none",
            # A test machine's disk is often nearly full; RabbitMQ would block publishers.
            "disk_free_limit.absolute = 10MB",
            extra_config,
            "",
        ]))


class RabbitMQCluster:
    """``nodes`` RabbitMQ nodes on 127.0.0.1, clustered, each with an MQTT listener.

    ``urls[i]`` is node i's MQTT URL. :meth:`start` boots the nodes in parallel and joins
    them (tens of seconds on a small machine); :meth:`stop` stops every node.
    ``extra_config`` lines go verbatim into every node's ``rabbitmq.conf``.
    """

    def __init__(self, nodes: int = 2, *, extra_config: str = "", bin_dir: str | None = None,
                 start_timeout: float = 120.0):
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.bin_dir = bin_dir or find_rabbitmq()
        self.extra_config = extra_config
        self.start_timeout = start_timeout
        self._dir: tempfile.TemporaryDirectory | None = None
        self._count = nodes
        self.nodes: list[RabbitMQNode] = []

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def home(self) -> Path:
        if self._dir is None:
            raise BrokerError("RabbitMQ cluster not started")
        return Path(self._dir.name)

    def ctl(self, node: RabbitMQNode, *args: str, timeout: float = 60.0) -> str:
        """Run ``rabbitmqctl -n NODE ARGS``; returns its output, raises BrokerError on failure."""
        assert self.bin_dir is not None
        cmd = [str(Path(self.bin_dir) / "rabbitmqctl"), "-n", node.name, *args]
        try:
            done = subprocess.run(cmd, env=node.env(self.home), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"rabbitmqctl {' '.join(args)} on {node.name} timed out") from exc
        if done.returncode != 0:
            raise BrokerError(f"rabbitmqctl {' '.join(args)} on {node.name} failed:\n{done.stdout}{done.stderr}"
                              f"\n{node.log_text()[-2000:]}")
        return done.stdout

    def start(self) -> RabbitMQCluster:
        if not self.bin_dir:
            raise BrokerError("RabbitMQ not found: install it (apt-get install rabbitmq-server) "
                              "or set EDGEPFL_RABBITMQ_BIN to the directory of rabbitmq-server")
        self._dir = tempfile.TemporaryDirectory(prefix="edgepfl-rabbitmq-")
        cookie = self.home / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex)
        cookie.chmod(0o400)
        token = uuid.uuid4().hex[:8]
        self.nodes = [RabbitMQNode(f"edgepfl-{token}-{i}@localhost", self.home / f"node{i}") for i in range(self._count)]
        try:
            for node in self.nodes:
                node.write_config(self.extra_config)
                node.proc = subprocess.Popen(
                    [str(Path(self.bin_dir) / "rabbitmq-server")], env=node.env(self.home), cwd=node.base,
                    stdin=subprocess.DEVNULL, stdout=open(node.base / "stdout.log", "ab"), stderr=subprocess.STDOUT,
                )
            for node in self.nodes:
                self._await_startup(node)
            first = self.nodes[0]
            for node in self.nodes[1:]:
                self.ctl(node, "stop_app")
                self.ctl(node, "join_cluster", first.name)
                self.ctl(node, "start_app")
            for node in self.nodes:
                if not wait_for_port(node.host, node.mqtt_port, self.start_timeout,
                                     alive=lambda n=node: n.proc is not None and n.proc.poll() is None):
                    raise BrokerError(f"RabbitMQ node {node.name} has no MQTT listener:\n{node.log_text()[-2000:]}")
        except BaseException:
            self.stop()
            raise
        return self

    def _await_startup(self, node: RabbitMQNode) -> None:
        # ``await_startup`` fails at once while the node has not yet registered with epmd.
        deadline = time.monotonic() + self.start_timeout
        while True:
            if node.proc is None or node.proc.poll() is not None:
                raise BrokerError(f"RabbitMQ node {node.name} exited while starting:\n{node.log_text()[-2000:]}")
            try:
                self.ctl(node, "await_startup", "--timeout", str(int(max(1, deadline - time.monotonic()))),
                         timeout=self.start_timeout + 10)
                return
            except BrokerError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def stop_node(self, node: RabbitMQNode) -> None:
        """Stop one node: ``rabbitmqctl stop``, then terminate / kill its process."""
        proc, node.proc = node.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                self.ctl(node, "stop", timeout=30)
            except BrokerError as exc:
                log.warning("rabbitmqctl stop failed (%s); terminating %s", exc, node.name)
        for signal_it in (proc.terminate, proc.kill):
            if proc.poll() is not None:
                break
            signal_it()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        """Stop every node and remove the cluster's files (idempotent)."""
        for node in reversed(self.nodes):
            self.stop_node(node)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RabbitMQCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RabbitMQCluster({', '.join(n.name for n in self.nodes)})"
