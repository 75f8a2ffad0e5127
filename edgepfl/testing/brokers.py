"""Brokers for tests and benchmarks: a real Mosquitto and a traffic recorder.

* :class:`MosquittoBroker` — a real ``mosquitto`` process with a generated config on
  a free loopback port: what production runs against, so what tests run against.
* :class:`TrafficCapture` — a plain MQTT client that records every message crossing
  a broker; tests use it to prove that personal parameters never leave an agent.

Kept out of :mod:`edgepfl.broker`, which holds only what a deployment uses.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from edgepfl.broker import MQTT_MAX_PACKET_BYTES, BrokerError, free_port, parse_broker_url, wait_for_port

if TYPE_CHECKING:  # pragma: no cover
    import paho.mqtt.client as mqtt

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- Mosquitto

_MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


def find_mosquitto() -> str | None:
    """Path of the ``mosquitto`` executable, or None.

    ``$EDGEPFL_MOSQUITTO`` wins; then ``PATH``; then the sbin directories that
    Debian and Homebrew install into (often not on a normal user's PATH).
    """
    override = os.environ.get("EDGEPFL_MOSQUITTO")
    if override:
        return override if os.access(override, os.X_OK) else None
    found = shutil.which("mosquitto")
    if found:
        return found
    for cand in _MOSQUITTO_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    return None


class MosquittoBroker:
    """A ``mosquitto`` process on 127.0.0.1 with a generated config.

    Config: ``listener PORT 127.0.0.1``, ``allow_anonymous true``,
    ``persistence false``, ``max_packet_size`` = ``max_packet_bytes`` (default:
    the MQTT maximum), ``max_queued_messages`` (per client; default 10,000, 0 for no
    limit: Mosquitto drops what a client's queue cannot hold). With ``capture=True`` a :class:`TrafficCapture` subscribed
    to ``#`` records every message that crosses the broker (``self.capture``).
    ``extra_config`` lines are appended verbatim (e.g. ``acl_file`` and
    ``password_file``, with ``allow_anonymous=False``).

    ``conf``: run this ``mosquitto.conf`` instead (e.g. the one ``edgepfl provision``
    writes): its ``listener`` line is moved to this broker's port on 127.0.0.1 and
    logging is added; everything else is used as written. :attr:`url` is
    ``mqtts://`` when the conf has a ``certfile``.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        capture: bool = False,
        max_packet_bytes: int = MQTT_MAX_PACKET_BYTES,
        allow_anonymous: bool = True,
        extra_config: str = "",
        max_queued_messages: int = 10_000,
        executable: str | None = None,
        start_timeout: float = 10.0,
        conf: str | Path | None = None,
    ):
        self.host = "127.0.0.1"
        self.port = port
        self.max_packet_bytes = max_packet_bytes
        self.allow_anonymous = allow_anonymous
        self.extra_config = extra_config
        self.max_queued_messages = max_queued_messages
        self.executable = executable or find_mosquitto()
        self.start_timeout = start_timeout
        self.conf = Path(conf).read_text() if conf is not None else None
        self.tls = self.conf is not None and re.search(r"^certfile\s", self.conf, re.M) is not None
        self._want_capture = capture
        self.capture: TrafficCapture | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        if self.port is None or self._proc is None:
            raise BrokerError("mosquitto not started")
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The mosquitto process id (a test that must freeze or kill the broker signals it)."""
        if self._proc is None:
            raise BrokerError("mosquitto not started")
        return self._proc.pid

    @property
    def log_path(self) -> Path | None:
        return Path(self._dir.name) / "mosquitto.log" if self._dir else None

    def log_text(self) -> str:
        """Mosquitto's own log (connections, errors) and its stderr (config errors) — for failing tests."""
        if not self._dir:
            return ""
        d = Path(self._dir.name)
        return "".join(p.read_text(errors="replace") for p in (d / "stderr.log", d / "mosquitto.log") if p.exists())

    def start(self) -> str:
        """Start mosquitto and wait until it accepts connections; returns the URL."""
        if self.running:
            return self.url
        executable = self.executable
        if not executable:
            raise BrokerError("mosquitto not found: install it (apt-get install mosquitto) or set EDGEPFL_MOSQUITTO")
        self._dir = tempfile.TemporaryDirectory(prefix="edgepfl-mosquitto-")
        requested = self.port  # _start_on sets self.port to each port it tries
        last = ""
        for _ in range(1 if requested is not None else 5):
            port = requested if requested is not None else free_port(self.host, restartable=True)
            if self._start_on(executable, port):
                break
            last = self.log_text()[-2000:]
        else:
            self._cleanup_dir()
            raise BrokerError(f"mosquitto failed to start:\n{last}")
        if self._want_capture:
            self.capture = TrafficCapture(self.url)
            self.capture.start()
        return self.url

    def _start_on(self, executable: str, port: int) -> bool:
        assert self._dir is not None
        d = Path(self._dir.name)
        conf = d / "mosquitto.conf"
        if self.conf is not None:
            settings = [re.sub(r"^listener\s+\d+.*$", f"listener {port} {self.host}", self.conf, count=1, flags=re.M)]
        else:
            settings = [
                f"listener {port} {self.host}",
                f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
                "persistence false",
                f"max_packet_size {int(self.max_packet_bytes)}",
                # Many agents may publish bursts of QoS 1 updates; don't drop them.
                f"max_queued_messages {int(self.max_queued_messages)}",
            ]
        conf.write_text(
            "\n".join(
                [
                    *settings,
                    f"log_dest file {d / 'mosquitto.log'}",
                    "log_type error",
                    "log_type warning",
                    "log_type notice",
                    "log_type information",
                    "connection_messages true",
                    # Started as root, mosquitto switches to user 'mosquitto', which cannot
                    # read our private temp dir (config, log, password and ACL files).
                    "user root" if hasattr(os, "geteuid") and os.geteuid() == 0 else "",
                    self.extra_config,
                    "",
                ]
            )
        )
        self._proc = subprocess.Popen(
            [executable, "-c", str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(d / "stderr.log", "ab"),
        )
        self.port = port
        if wait_for_port(self.host, port, self.start_timeout, alive=lambda: self._proc.poll() is None):
            return True
        self._kill()
        return False

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def _cleanup_dir(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def stop(self) -> None:
        """Stop the capture client (if any) and terminate mosquitto (idempotent)."""
        if self.capture is not None:
            self.capture.stop()
            self.capture = None
        self._kill()
        self._cleanup_dir()

    def __enter__(self) -> MosquittoBroker:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MosquittoBroker({self.host}:{self.port}, running={self.running})"


# --------------------------------------------------------------------------- bridges

#: What a site broker forwards to the central one (agents' channels) and back (the
#: coordinator's), for every federation of protocol v1. Disjoint directions: nothing a
#: site sends out can come back in, so the topology cannot loop (docs/BROKERS.md).
BRIDGE_OUT_TOPICS = ("agents/+/status", "agents/+/update", "agents/+/metrics")
BRIDGE_IN_TOPICS = ("agents/+/task", "coordinator", "release", "release/+")


def bridge_config(name: str, central_port: int, *, federation: str = "+", host: str = "127.0.0.1") -> str:
    """The ``mosquitto.conf`` lines that bridge a site broker to a central one.

    QoS 1 both ways; ``try_private`` marks the link as a bridge, so the central broker
    keeps the retain flag of what it forwards (``retain as published``) and does not
    echo back; ``cleansession false`` makes the central broker queue QoS 1 messages
    for the site while the link is down, and the site broker queue its outbound ones.
    """
    root = f"edgepfl/v1/{federation}"
    return "\n".join([
        f"connection {name}",
        f"address {host}:{central_port}",
        f"remote_clientid edgepfl-bridge-{name}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession false",
        "notifications false",
        "keepalive_interval 5",
        "restart_timeout 1 5",
        *(f"topic {root}/{t} out 1" for t in BRIDGE_OUT_TOPICS),
        *(f"topic {root}/{t} in 1" for t in BRIDGE_IN_TOPICS),
    ])


class MosquittoBridge:
    """A central Mosquitto and ``sites`` site Mosquittos bridged to it, on loopback.

    The common IoT topology: devices connect to their site's broker, the coordinator to
    the central one. ``central`` and ``sites[i]`` are :class:`MosquittoBroker` s;
    :meth:`start` returns once every bridge link is up (a probe message crossed it
    both ways). ``capture=True`` records the central broker's traffic.
    """

    def __init__(self, sites: int = 2, *, capture: bool = False, start_timeout: float = 20.0):
        self.central = MosquittoBroker(capture=capture)
        self.sites = [MosquittoBroker() for _ in range(sites)]
        self.start_timeout = start_timeout

    @property
    def site_urls(self) -> list[str]:
        return [site.url for site in self.sites]

    def start(self) -> MosquittoBridge:
        self.central.start()
        assert self.central.port is not None
        try:
            for i, site in enumerate(self.sites):
                site.extra_config = "\n".join(x for x in (site.extra_config, bridge_config(f"site{i}", self.central.port)) if x)
                site.start()
            for site in self.sites:
                self._wait_for_link(site)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_link(self, site: MosquittoBroker) -> None:
        """Publish probes on a bridged topic from the site until the central broker sees one."""
        topic = f"edgepfl/v1/bridge-probe-{uuid.uuid4().hex[:8]}/agents/probe/metrics"
        with TrafficCapture(self.central.url, topic, include_retained=True) as cap:
            import paho.mqtt.client as mqtt

            client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-probe-{uuid.uuid4().hex[:8]}")
            client.connect(site.host, site.port or 0, keepalive=30)
            client.loop_start()
            try:
                deadline = time.monotonic() + self.start_timeout
                while not cap.snapshot():
                    if time.monotonic() > deadline:
                        raise BrokerError(f"bridge {site} -> central did not come up:\n{site.log_text()[-2000:]}")
                    client.publish(topic, b"probe", qos=1)
                    time.sleep(0.2)
            finally:
                client.disconnect()
                client.loop_stop()

    def stop(self) -> None:
        """Stop every broker (idempotent)."""
        for broker in (*self.sites, self.central):
            broker.stop()

    def __enter__(self) -> MosquittoBridge:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------- capture


class TrafficCapture:
    """A paho client subscribed to ``topic`` (default ``#``) that records every message.

    ``messages`` is a list of ``(topic, payload_bytes)`` in arrival order. Retained
    messages replayed at subscribe time are skipped unless ``include_retained``:
    they crossed the broker before the capture began (MQTT 3.1.1 clears the retain
    flag on live forwards, so the flag identifies exactly the replays).
    """

    def __init__(
        self,
        url: str,
        topic: str = "#",
        *,
        include_retained: bool = False,
        timeout: float = 10.0,
        username: str | None = None,
        password: str | None = None,
    ):
        self.url = url
        self.username, self.password = username, password
        self.topic = topic
        self.include_retained = include_retained
        self.timeout = timeout
        self.messages: list[tuple[str, bytes]] = []
        self._cond = threading.Condition()
        self._client: mqtt.Client | None = None

    def start(self) -> TrafficCapture:
        """Connect and subscribe; returns once the broker acknowledged the subscription."""
        import paho.mqtt.client as mqtt

        host, port, tls = parse_broker_url(self.url)
        subscribed = threading.Event()
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"edgepfl-capture-{uuid.uuid4().hex[:12]}")
        if tls:
            client.tls_set()
        if self.username:
            client.username_pw_set(self.username, self.password)

        def on_connect(c, userdata, flags, reason_code, properties):
            if not reason_code.is_failure:
                c.subscribe(self.topic, qos=1)

        def on_subscribe(c, userdata, mid, reason_codes, properties):
            subscribed.set()

        def on_message(c, userdata, msg):
            if msg.retain and not self.include_retained:
                return
            with self._cond:
                self.messages.append((msg.topic, bytes(msg.payload)))
                self._cond.notify_all()

        client.on_connect = on_connect
        client.on_subscribe = on_subscribe
        client.on_message = on_message
        client.connect(host, port, keepalive=30)
        client.loop_start()
        self._client = client
        if not subscribed.wait(self.timeout):
            self.stop()
            raise BrokerError(f"capture client could not subscribe to {self.topic!r} on {self.url}")
        return self

    def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.disconnect()
            client.loop_stop()

    def clear(self) -> None:
        with self._cond:
            self.messages.clear()

    def snapshot(self) -> list[tuple[str, bytes]]:
        with self._cond:
            return list(self.messages)

    def wait_for(self, predicate, timeout: float = 10.0) -> list[tuple[str, bytes]]:
        """Block until ``predicate(messages)`` is true; returns the messages or raises TimeoutError."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.messages):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"capture: condition not met within {timeout}s ({len(self.messages)} messages)")
                self._cond.wait(left)
            return list(self.messages)

    def payloads(self, topic_contains: str = "") -> list[bytes]:
        return [p for t, p in self.snapshot() if topic_contains in t]

    def total_bytes(self) -> int:
        return sum(len(p) for _, p in self.snapshot())

    def __enter__(self) -> TrafficCapture:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
