"""MQTT brokers for running a federation without outside infrastructure.

* :class:`EmbeddedBroker` — an `amqtt <https://pypi.org/project/amqtt/>`_ broker
  served from a background thread with its own asyncio loop. It is the default
  when no broker is configured, so ``edgepfl demo`` needs nothing installed.
* :class:`MosquittoBroker` — a real ``mosquitto`` process with a generated
  config on a free loopback port. Tests use it (it is what production runs
  against) and it can record every message that crosses it
  (:class:`TrafficCapture`), which is how tests prove that personal parameters
  never leave an agent.

Both speak MQTT 3.1.1 to paho-mqtt 2.x clients, accept anonymous connections
and messages of at least 16 MB.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: Largest MQTT packet the protocol can express (remaining length is at most 268,435,455).
MQTT_MAX_PACKET_BYTES = 268_435_455
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


class BrokerError(RuntimeError):
    """A broker could not be started, or a broker URL is invalid."""


# --------------------------------------------------------------------------- URLs


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    """Split ``mqtt://host[:port]`` or ``mqtts://host[:port]`` into ``(host, port, tls)``.

    Default ports are 1883 (mqtt) and 8883 (mqtts). Credentials do not belong in
    the URL (they would end up in logs and run directories) and are refused, as
    are paths, queries and any other scheme.
    """
    if not isinstance(url, str) or not url.strip():
        raise BrokerError("broker URL is empty; expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise BrokerError(
            f"unsupported broker URL {url!r}: scheme must be mqtt:// or mqtts:// (got {parts.scheme or 'none'!r})"
        )
    if parts.username is not None or parts.password is not None:
        raise BrokerError(f"broker URL {url!r} carries credentials; set username/password in the config instead")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BrokerError(f"broker URL {url!r} must not have a path, query or fragment")
    host = parts.hostname
    if not host:
        raise BrokerError(f"broker URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise BrokerError(f"broker URL {url!r} has an invalid port") from None
    if port is None:
        port = DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise BrokerError(f"broker URL {url!r} has an invalid port {port}")
    return host, port, scheme == "mqtts"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (callers retry if someone takes it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = 10.0, alive=lambda: True) -> bool:
    """Poll until ``host:port`` accepts a TCP connection, ``alive()`` turns false, or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- amqtt

try:  # amqtt is optional (the head tier does not install it); the plugin is only needed with it.
    from amqtt.plugins.base import BaseAuthPlugin as _BaseAuthPlugin
except ImportError:  # pragma: no cover - exercised only where amqtt is absent
    _BaseAuthPlugin = object  # type: ignore[assignment,misc]


class OpenAuthPlugin(_BaseAuthPlugin):  # type: ignore[misc,valid-type]
    """amqtt auth plugin: accept every client (with or without a username).

    amqtt's own ``AnonymousAuthPlugin`` marks every session anonymous, and amqtt
    then neither queues QoS 1 messages for a disconnected persistent session nor
    keeps its subscriptions — unlike Mosquitto. Accepting clients without that
    flag keeps the embedded broker's session semantics the same as Mosquitto's.
    """

    @dataclass
    class Config:
        pass

    async def authenticate(self, *, session) -> bool:  # noqa: D102 - amqtt hook
        session.is_anonymous = False
        return True


_FIXED_BROKER_CLASS = None


def _amqtt_broker_class():
    """amqtt's Broker with its retained-message replay confined to the client's own subscriptions.

    amqtt 0.12 replays, to every client that connects, the retained messages matching
    *any* client's subscription filters (``for topic in self._subscriptions`` in
    ``_handle_client_session``), so a fresh agent would receive other agents' retained
    status on topics it never subscribed to. Mosquitto does not; neither do we.
    """
    global _FIXED_BROKER_CLASS
    if _FIXED_BROKER_CLASS is None:
        from amqtt.broker import Broker

        class _Broker(Broker):
            async def _publish_retained_messages_for_subscription(self, subscription, session) -> None:
                subscribers = self._subscriptions.get(subscription[0], ())
                if any(s.client_id == session.client_id for s, _ in subscribers):
                    await super()._publish_retained_messages_for_subscription(subscription, session)

        _FIXED_BROKER_CLASS = _Broker
    return _FIXED_BROKER_CLASS


class EmbeddedBroker:
    """An amqtt MQTT broker running in a background thread with its own event loop.

    Usage::

        with EmbeddedBroker() as url:        # "mqtt://127.0.0.1:PORT"
            ...

    amqtt has no maximum packet size setting: it accepts anything MQTT can
    express (256 MB), so 16 MB messages pass. Anonymous clients are accepted.
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 15.0):
        self.host = host
        self.port = port
        self.start_timeout = start_timeout
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        if self.port is None or self._thread is None:
            raise BrokerError("embedded broker not started")
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> str:
        """Start serving; returns the broker URL. Retries on a port taken in between (free port only)."""
        if self.running:
            return self.url
        try:
            import amqtt  # noqa: F401
        except ImportError:
            raise BrokerError("the embedded broker needs amqtt: pip install 'edgepfl[train]' (or amqtt)") from None
        fixed = self.port is not None
        last: BaseException | None = None
        for _ in range(1 if fixed else 5):
            port = self.port if fixed else free_port(self.host)
            try:
                self._start_on(port)
                return self.url
            except BrokerError as exc:
                last = exc
        raise BrokerError(f"embedded broker failed to start: {last}")

    def _start_on(self, port: int) -> None:
        self._ready.clear()
        self._error = None
        self.port = port
        self._thread = threading.Thread(target=self._serve, name=f"amqtt-{port}", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            raise BrokerError(f"embedded broker did not start within {self.start_timeout}s")
        if self._error is not None:
            self._thread.join(timeout=5)
            self._thread = None
            raise BrokerError(str(self._error))

    def _config(self) -> dict:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}", "max_connections": 0}},
            # Only authentication: amqtt's packet/event loggers format every packet,
            # which costs real time on multi-megabyte payloads, and $SYS is noise here.
            "plugins": {f"{__name__}.OpenAuthPlugin": {}},
        }

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            broker_class = _amqtt_broker_class()

            async def boot():
                self._broker = broker_class(self._config(), loop=loop)
                await self._broker.start()

            loop.run_until_complete(boot())
        except BaseException as exc:  # report any start failure to the caller's thread
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            # Cancel whatever amqtt left behind so closing the loop is quiet.
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down and join its thread (idempotent)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if thread.is_alive() and self._broker is not None and not loop.is_closed():
            fut = asyncio.run_coroutine_threadsafe(self._broker.shutdown(), loop)
            try:
                fut.result(timeout)
            except Exception as exc:  # a failed shutdown must not prevent stopping the loop
                log.warning("embedded broker shutdown: %s", exc)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._thread = None
        self._broker = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedBroker({self.host}:{self.port}, running={self.running})"


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
    the MQTT maximum). With ``capture=True`` a :class:`TrafficCapture` subscribed
    to ``#`` records every message that crosses the broker (``self.capture``).
    ``extra_config`` lines are appended verbatim (e.g. ``acl_file`` and
    ``password_file``, with ``allow_anonymous=False``).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        capture: bool = False,
        max_packet_bytes: int = MQTT_MAX_PACKET_BYTES,
        allow_anonymous: bool = True,
        extra_config: str = "",
        executable: str | None = None,
        start_timeout: float = 10.0,
    ):
        self.host = "127.0.0.1"
        self.port = port
        self.max_packet_bytes = max_packet_bytes
        self.allow_anonymous = allow_anonymous
        self.extra_config = extra_config
        self.executable = executable or find_mosquitto()
        self.start_timeout = start_timeout
        self._want_capture = capture
        self.capture: TrafficCapture | None = None
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        if self.port is None or self._proc is None:
            raise BrokerError("mosquitto not started")
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

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
        if not self.executable:
            raise BrokerError("mosquitto not found: install it (apt-get install mosquitto) or set EDGEPFL_MOSQUITTO")
        self._dir = tempfile.TemporaryDirectory(prefix="edgepfl-mosquitto-")
        fixed = self.port is not None
        last = ""
        for _ in range(1 if fixed else 5):
            port = self.port if fixed else free_port(self.host)
            if self._start_on(port):
                break
            last = self.log_text()[-2000:]
        else:
            self._cleanup_dir()
            raise BrokerError(f"mosquitto failed to start:\n{last}")
        if self._want_capture:
            self.capture = TrafficCapture(self.url)
            self.capture.start()
        return self.url

    def _start_on(self, port: int) -> bool:
        assert self._dir is not None
        d = Path(self._dir.name)
        conf = d / "mosquitto.conf"
        conf.write_text(
            "\n".join(
                [
                    f"listener {port} {self.host}",
                    f"allow_anonymous {'true' if self.allow_anonymous else 'false'}",
                    "persistence false",
                    f"max_packet_size {int(self.max_packet_bytes)}",
                    # Many agents may publish bursts of QoS 1 updates; don't drop them.
                    "max_queued_messages 10000",
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
            [self.executable, "-c", str(conf)],
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
        self._client = None

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
