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
names every device, so expose it only behind your own authentication.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from edgepfl.errors import OneLineParser, UsageError
from edgepfl.protocol.connection import BrokerLogin
from edgepfl.protocol.view import FleetView

from .dashboard_page import PAGE
from .status import follow_views, read_access

log = logging.getLogger("edgepfl.dashboard")

#: rounds of accuracy kept for the curve (a run of more rounds shows its last ones)
HISTORY_ROUNDS = 10_000


class LatestView:
    """The latest view and the accuracy curve so far, shared by the MQTT and HTTP threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._view: FleetView | None = None
        self._received = 0.0
        self._history: dict[int, tuple[float, bool]] = {}
        self._body: bytes | None = None
        self.problem: str | None = None  # the last thing that went wrong reading views, for the page

    def update(self, view: FleetView) -> None:
        with self._lock:
            if self._view is not None and (view.federation, view.started) != (self._view.federation,
                                                                                self._view.started):
                self._history.clear()  # another run: its own curve
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


def _handler(latest: LatestView) -> type[BaseHTTPRequestHandler]:
    page = PAGE.encode()

    class Handler(BaseHTTPRequestHandler):
        server_version = "edgepfl-dashboard"

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            path = self.path.split("?", 1)[0]
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
          ready: threading.Event | None = None) -> ThreadingHTTPServer:
    """Start following the view and serving on ``listen``; returns the server (its
    ``server_address`` has the port when 0 was asked). ``shutdown()`` it to stop."""
    latest = LatestView()
    stop = threading.Event()
    server = ThreadingHTTPServer(listen, _handler(latest))
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
    ns = parser.parse_args(argv)
    federation, broker = read_access(ns.config) if ns.config else (None, None)
    federation = ns.federation or federation
    url = ns.broker or (broker.url if broker is not None else None)
    if not url or not federation:
        raise UsageError("give --broker and --federation, or --config with federation: and broker:")
    login = BrokerLogin.from_config(broker) if broker is not None else BrokerLogin()
    server = serve(url, federation, login, ns.listen)
    print(f"edgepfl dashboard of {federation}: http://{ns.listen[0]}:{server.server_port}/ (Ctrl-C to stop)",
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.shutdown()
        server.server_close()
    return 0
