"""Broker URLs, and an embedded broker for running a federation without infrastructure.

* :func:`parse_broker_url` — the one parser of ``mqtt://`` / ``mqtts://`` URLs.
* :class:`EmbeddedBroker` — an `amqtt <https://pypi.org/project/amqtt/>`_ broker
  served from a background thread with its own asyncio loop. It is the default
  when no broker is configured, so ``edgepfl demo`` needs nothing installed. It
  speaks MQTT 3.1.1, accepts anonymous connections and messages of at least 16 MB.

Test brokers (a real Mosquitto, traffic capture) live in :mod:`edgepfl.testing`.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:  # pragma: no cover
    import asyncio

log = logging.getLogger(__name__)

#: Largest MQTT packet the protocol can express (remaining length is at most 268,435,455).
MQTT_MAX_PACKET_BYTES = 268_435_455
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}
#: Bytes of a PUBLISH packet besides its payload, with room to spare: fixed header (≤ 5),
#: topic length (2) and the longest edgepfl topic (155), packet id (2), MQTT 5 properties.
PUBLISH_OVERHEAD_BYTES = 512


def max_message_bytes_for(packet_limit: int) -> int:
    """The ``broker.max_message_bytes`` that keeps every edgepfl PUBLISH within a broker's
    packet limit (Mosquitto ``max_packet_size``, EMQX ``mqtt.max_packet_size``), which
    counts the whole packet; a limit on the payload alone (AWS IoT) can be used as is."""
    return packet_limit - PUBLISH_OVERHEAD_BYTES


class BrokerError(RuntimeError):
    """A broker could not be started, or a broker URL is invalid."""


class BrokerURLError(BrokerError):
    """A broker URL that cannot name a broker (scheme, host, port, credentials in it): a
    configuration error, which no retry mends (exit code 2, where an unreachable broker is 4)."""


# --------------------------------------------------------------------------- URLs


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    """Split ``mqtt://host[:port]`` or ``mqtts://host[:port]`` into ``(host, port, tls)``.

    Default ports are 1883 (mqtt) and 8883 (mqtts). Credentials do not belong in
    the URL (they would end up in logs and run directories) and are refused, as
    are paths, queries and any other scheme.
    """
    if not isinstance(url, str) or not url.strip():
        raise BrokerURLError("broker URL is empty; expected mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise BrokerURLError(
            f"unsupported broker URL {url!r}: scheme must be mqtt:// or mqtts:// (got {parts.scheme or 'none'!r})"
        )
    if parts.username is not None or parts.password is not None:
        raise BrokerURLError(f"broker URL {url!r} carries credentials; set username/password in the config instead")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BrokerURLError(f"broker URL {url!r} must not have a path, query or fragment")
    host = parts.hostname
    if not host:
        raise BrokerURLError(f"broker URL {url!r} has no host")
    try:
        port = parts.port
    except ValueError:
        raise BrokerURLError(f"broker URL {url!r} has an invalid port") from None
    if port is None:
        port = DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise BrokerURLError(f"broker URL {url!r} has an invalid port {port}")
    return host, port, scheme == "mqtts"


#: where a broker that may restart on its port listens: below the ephemeral ports that
#: outgoing connections take (Linux 32768-60999, Windows and macOS 49152-65535), so that no
#: client's connection holds its port while it is down
LISTEN_PORTS = range(20_000, 32_768)


def free_port(host: str = "127.0.0.1", *, restartable: bool = False) -> int:
    """A TCP port that was free a moment ago (callers retry if someone takes it first);
    ``restartable``: one of :data:`LISTEN_PORTS`, for a listener that stops and starts again
    on the same port (an ephemeral one can be taken meanwhile by any outgoing connection)."""
    if restartable:
        for port in random.sample(LISTEN_PORTS, 200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
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

_OPEN_AUTH_PLUGIN = None


def _open_auth_plugin_class() -> type:
    """amqtt auth plugin: accept every client (with or without a username).

    amqtt's own ``AnonymousAuthPlugin`` marks every session anonymous, and amqtt
    then neither queues QoS 1 messages for a disconnected persistent session nor
    keeps its subscriptions — unlike Mosquitto. Accepting clients without that
    flag keeps the embedded broker's session semantics the same as Mosquitto's.
    Built on first use: amqtt is imported only by a process that embeds a broker.
    """
    global _OPEN_AUTH_PLUGIN
    if _OPEN_AUTH_PLUGIN is None:
        from amqtt.plugins.base import BaseAuthPlugin

        class OpenAuthPlugin(BaseAuthPlugin):
            @dataclass
            class Config:
                pass

            async def authenticate(self, *, session) -> bool:  # noqa: D102 - amqtt hook
                session.is_anonymous = False
                return True

        _OPEN_AUTH_PLUGIN = OpenAuthPlugin
    return _OPEN_AUTH_PLUGIN


def __getattr__(name: str) -> Any:
    # amqtt loads its plugins by dotted name ("edgepfl.broker.OpenAuthPlugin")
    if name == "OpenAuthPlugin":
        return _open_auth_plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        self._broker: Any = None  # amqtt's Broker (amqtt has no type information) while serving
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
        requested = self.port  # _start_on sets self.port to each port it tries
        last: BaseException | None = None
        for _ in range(1 if requested is not None else 5):
            port = requested if requested is not None else free_port(self.host)
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
        import asyncio  # here, not at the top: a device that never embeds a broker never pays for asyncio

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
            import asyncio

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


def exposure_warning(url: str, role: str, signed: bool) -> str | None:
    """The one warning a service (``role``: coordinator or agent) gives at start when it talks
    to a broker off this machine without TLS or without signatures; None when it does not."""
    import ipaddress

    try:
        host, _, tls = parse_broker_url(url)
    except BrokerError:
        return None  # the transport reports a bad URL itself
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    missing = [what for what, ok in (("TLS (mqtts://)", tls), ("message signatures (security: in the config)", signed))
               if not ok]
    if local or not missing:
        return None
    return (f"the {role} talks to the non-local broker {host} without {' and without '.join(missing)}: anyone who "
            "can reach the broker can read or forge this federation's messages (docs/SECURITY.md)")
