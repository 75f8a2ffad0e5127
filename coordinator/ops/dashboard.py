"""``edgepfl dashboard``: the fleet in a browser, live.

::

    edgepfl dashboard --config operator/operator.yaml [--listen 127.0.0.1:8080]
    edgepfl dashboard --broker mqtt://broker:1883 --federation demo

A small web server for the operator's machine. It reads the coordinator's retained fleet
view (``docs/PROTOCOL.md`` §18) over one plain MQTT subscription — the read-only operator
login that ``edgepfl provision`` writes is enough, TLS included — keeps the latest view
and the accuracy of every round it has seen, and serves

* ``/`` — the page (:mod:`.dashboard_page`: plain HTML and JavaScript, nothing loaded
  from elsewhere): agents online by tier, the phase and round, the accuracy curve, the
  release each head agent runs, rejections and refusals by reason, the agents (a page of
  them at a time, filtered by id: a view of 10,000 agents renders in well under 2 s);
* ``/view.json`` — ``{"view": <the view>, "history": [[round, accuracy, final], …],
  "received": <Unix time>}``; 503 until a view came.

It publishes nothing, and serves on the loopback interface unless told otherwise: the view
names every device, so expose it only behind your own authentication. A request whose
``Host`` is not a name the dashboard is reached by is refused (421): a web page that
re-points its own domain name at this address (DNS rebinding) cannot read the view
(:class:`RequestGuard`). ``--token-file`` makes every request show a token too.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from edgepfl.errors import InputError, OneLineParser, UsageError
from edgepfl.protocol.connection import BrokerLogin
from edgepfl.protocol.view import FleetView

from .dashboard_page import PAGE
from .status import STALE_HEARTBEATS, follow_views, read_access

log = logging.getLogger("edgepfl.dashboard")

#: rounds of accuracy kept for the curve (a run of more rounds shows its last ones)
HISTORY_ROUNDS = 10_000
#: the cookie that carries the token from the page's address (``/?token=…``) to its requests for the view
TOKEN_COOKIE = "edgepfl_dashboard_token"
_WILDCARDS = ("", "0.0.0.0", "::")
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _split_host(value: str) -> tuple[str, int | None]:
    """A ``Host`` header's (name, port): lower case, an IPv6 address without its brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name, int(port) if port.isdigit() else None


@dataclass
class RequestGuard:
    """Who the dashboard answers: a request whose ``Host`` names it, and with a ``token``, shows it.

    The names are the address it listens on and, on a loopback address, ``localhost``,
    ``127.0.0.1`` and ``::1``; on every interface (``0.0.0.0``) any IP address and this
    machine's host names. ``allowed`` adds names (a reverse proxy's, the machine's DNS name),
    each with any port. A browser sends the name in the page's address, so a page of
    another site that re-points its own name at this address (DNS rebinding) sends that name
    and is refused; an IP address cannot be re-pointed. The listening names must come with
    the listening port (a browser sends it). The token, when set, is sent as
    ``Authorization: Bearer <token>``, in the page's address (``/?token=<token>``, which sets
    a cookie for the page's own requests) or in that cookie.
    """

    host: str
    port: int
    allowed: tuple[str, ...] = ()
    token: str | None = None
    _names: frozenset[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        listening = {self.host.lower().strip("[]")}
        if self.host in _WILDCARDS:
            listening = {*_LOOPBACK_NAMES, socket.gethostname().lower(), socket.getfqdn().lower()}
        elif self.host.lower() in _LOOPBACK_NAMES or (_is_ip(self.host) and ipaddress.ip_address(self.host).is_loopback):
            listening |= set(_LOOPBACK_NAMES)
        self._names = frozenset(listening)

    def host_refusal(self, header: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused; None when it is served."""
        if not header:
            return "a request without a Host header"
        name, port = _split_host(header)
        if name in (a.lower() for a in self.allowed):
            return None
        if (port == self.port or (port is None and self.port == 80)) and (
                name in self._names or (self.host in _WILDCARDS and _is_ip(name))):
            return None
        return f"Host {header[:80]!r} is not a name this dashboard is reached by"

    def token_shown(self, headers: Any, query: str) -> tuple[bool, bool]:
        """(the request shows the token, it came in the address: set the cookie)."""
        if self.token is None:
            return True, False
        expected = self.token.encode()
        authorization = headers.get("Authorization", "")
        if authorization.startswith("Bearer ") and hmac.compare_digest(authorization[7:].strip().encode(), expected):
            return True, False
        if any(hmac.compare_digest(t.encode(), expected) for t in parse_qs(query).get("token", [])[:4]):
            return True, True
        try:
            cookie = SimpleCookie(headers.get("Cookie", ""))
        except Exception:  # a malformed cookie header: no token in it  # noqa: BLE001
            return False, False
        morsel = cookie.get(TOKEN_COOKIE)
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), expected), False


class LatestView:
    """The latest view and the accuracy curve so far, shared by the MQTT and HTTP threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view: FleetView | None = None
        self._received = 0.0
        self._history: dict[int, tuple[float, bool]] = {}
        #: (federation, started) of the last run whose views fed the curve
        self._run: tuple[str, float] | None = None
        self._body: bytes | None = None
        self.problem: str | None = None  # the last thing that went wrong reading views, for the page

    def update(self, view: FleetView) -> None:
        with self._lock:
            # another run: its own curve. An `edgepfl release` command between runs publishes a view
            # of its own (phase releasing, no rounds): the run's curve stays until another run starts
            run = (view.federation, view.started)
            if view.phase != "releasing" and self._run is not None and run != self._run:
                self._history.clear()
            if view.phase != "releasing":
                self._run = run
            self._view, self._received, self.problem = view, time.time(), None
            if view.last_accuracy is not None and view.last_accuracy_round is not None:
                self._history[view.last_accuracy_round] = (view.last_accuracy, view.last_accuracy_final)
                while len(self._history) > HISTORY_ROUNDS:
                    del self._history[min(self._history)]
            self._body = None

    def body(self) -> bytes | None:
        """``/view.json``'s body (built once per view, not once per request)."""
        with self._lock:
            if self._view is None:
                return None
            if self._body is None:
                history = [[r, a, f] for r, (a, f) in sorted(self._history.items())]
                self._body = json.dumps({"view": self._view.model_dump(mode="json"), "history": history,
                                         "received": self._received}).encode()
            return self._body


def _handler(latest: LatestView, guard: RequestGuard) -> type[BaseHTTPRequestHandler]:
    page = PAGE.replace("__STALE_HEARTBEATS__", str(STALE_HEARTBEATS)).encode()
    told: set[str] = set()  # refused Host names logged (a few, once each)

    class Handler(BaseHTTPRequestHandler):
        server_version = "edgepfl-dashboard"
        _cookie: str | None = None

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path, _, query = self.path.partition("?")
            refusal = guard.host_refusal(self.headers.get("Host"))
            if refusal is not None:
                if len(told) < 16 and refusal not in told:
                    told.add(refusal)
                    log.warning("refused %s (--allow-host NAME serves the dashboard under another name)", refusal)
                return self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain; charset=utf-8",
                                  f"refused: {refusal}\n".encode())
            shown, in_address = guard.token_shown(self.headers, query)
            if not shown:
                return self._send(HTTPStatus.UNAUTHORIZED, "text/plain; charset=utf-8",
                                  b"this dashboard needs its token: open /?token=<token>\n")
            if in_address and guard.token is not None:
                self._cookie = f"{TOKEN_COOKIE}={guard.token}; Path=/; HttpOnly; SameSite=Strict"
            if path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, "text/html; charset=utf-8", page)
            if path == "/view.json":
                body = latest.body()
                if body is None:
                    why = latest.problem or "no fleet view yet: is the coordinator running, with observe.view on?"
                    return self._send(HTTPStatus.SERVICE_UNAVAILABLE, "application/json",
                                      json.dumps({"error": why}).encode())
                return self._send(HTTPStatus.OK, "application/json", body)
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, status: HTTPStatus, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            if self._cookie is not None:
                self.send_header("Set-Cookie", self._cookie)
            # the page loads nothing from elsewhere and is not to be framed by another site
            self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline' 'self'; "
                                                        "style-src 'unsafe-inline' 'self'; frame-ancestors 'none'")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def follow(latest: LatestView, url: str, federation: str, login: BrokerLogin, stop: threading.Event) -> None:
    """Keep ``latest`` up to date from the broker until ``stop``; a lost connection or a payload
    that is not a view is shown on the page and retried, never the end of the dashboard."""
    while not stop.is_set():
        try:
            views = follow_views(url, federation, timeout=30.0, login=login,
                                 on_bad=lambda why: setattr(latest, "problem", f"passed over a message: {why}"))
            try:
                for view in views:
                    latest.update(view)
                    if stop.is_set():
                        break
            finally:
                views.close()
        except (TimeoutError, ConnectionError, OSError) as exc:
            latest.problem = str(exc)
            log.warning("fleet view: %s; trying again in 5 s", exc)
            stop.wait(5.0)


def serve(url: str, federation: str, login: BrokerLogin, listen: tuple[str, int],
          ready: threading.Event | None = None, *, allowed_hosts: tuple[str, ...] = (),
          token: str | None = None) -> ThreadingHTTPServer:
    """Start following the view and serving on ``listen``; returns the server (its
    ``server_address`` has the port when 0 was asked). ``shutdown()`` it to stop. Requests are
    answered as :class:`RequestGuard` says (``allowed_hosts``: more names; ``token``: required)."""
    latest = LatestView()
    stop = threading.Event()
    server = ThreadingHTTPServer(listen, BaseHTTPRequestHandler)
    # the guard knows the port only once it is bound (0 asks for a free one)
    server.RequestHandlerClass = _handler(latest, RequestGuard(listen[0], server.server_port, allowed_hosts, token))
    server.daemon_threads = True
    threading.Thread(target=follow, args=(latest, url, federation, login, stop), name="view", daemon=True).start()
    original = server.shutdown

    def shutdown() -> None:
        stop.set()
        original()

    server.shutdown = shutdown  # type: ignore[method-assign]
    if ready is not None:
        ready.set()
    return server


def _listen(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port from 0 to 65535")
    return host or "127.0.0.1", number


def _read_token(path: Path) -> str:
    """The token in ``path`` (its first line), one line naming the file when there is none."""
    try:
        lines = path.read_text().strip().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--token-file {path}: cannot read it ({exc})") from None
    token = lines[0].strip() if lines else ""
    if len(token) < 16 or any(c.isspace() or not c.isprintable() for c in token):
        raise InputError(f"--token-file {path}: needs a token of at least 16 printable characters on its first line "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())' > FILE)")
    return token


def main_dashboard(argv: list[str]) -> int:
    """``edgepfl dashboard``: serve the live fleet view until Ctrl-C or SIGTERM."""
    parser = OneLineParser(prog="edgepfl dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help="a YAML file with federation: and broker: (e.g. operator/operator.yaml from "
                             "edgepfl provision): URL, TLS files and credentials")
    parser.add_argument("--broker", default=None, help="mqtt://host[:port] or mqtts://host[:port] (overrides --config)")
    parser.add_argument("--federation", default=None, help="federation name (overrides --config)")
    parser.add_argument("--listen", type=_listen, default=("127.0.0.1", 8080),
                        help="HOST:PORT to serve on (default 127.0.0.1:8080; 0 picks a free port)")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="a further name the page is reached by (a reverse proxy's, this machine's DNS name); "
                             "requests naming any other Host are refused (421). Repeatable")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help="every request must show the token in FILE: open /?token=<token> (the page keeps it "
                             "in a cookie), or send Authorization: Bearer <token>")
    ns = parser.parse_args(argv)
    token = _read_token(Path(ns.token_file)) if ns.token_file else None
    federation, broker = read_access(ns.config) if ns.config else (None, None)
    federation = ns.federation or federation
    url = ns.broker or (broker.url if broker is not None else None)
    if not url or not federation:
        raise UsageError("give --broker and --federation, or --config with federation: and broker:")
    login = BrokerLogin.from_config(broker) if broker is not None else BrokerLogin()
    server = serve(url, federation, login, ns.listen, allowed_hosts=tuple(ns.allow_host), token=token)
    shown = f"[{ns.listen[0]}]" if ":" in ns.listen[0] else ns.listen[0]
    needs = f", with ?token= from {ns.token_file}" if token else ""
    print(f"edgepfl dashboard of {federation}: http://{shown}:{server.server_port}/ (Ctrl-C to stop{needs})",
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
        server.server_close()
    return 0
