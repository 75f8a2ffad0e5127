"""A TCP relay that counts what crosses it: the bytes on a device's link to its broker.

Point a client at :attr:`CountingRelay.url` instead of the broker and read
:attr:`~CountingRelay.down_bytes` (broker to client) and :attr:`~CountingRelay.up_bytes`
(client to broker): every byte of MQTT framing, every retained replay and every resend is
counted, which no broker statistic gives per client. For tests and benchmarks.
"""

from __future__ import annotations

import selectors
import socket
import threading


class CountingRelay:
    """Relays every connection made to it to ``host:port``, counting bytes both ways."""

    def __init__(self, host: str, port: int):
        self.upstream = (host, port)
        self.down_bytes = 0
        self.up_bytes = 0
        self._lock = threading.Lock()
        self._server: socket.socket | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the relay is not started")
        return f"mqtt://127.0.0.1:{self._server.getsockname()[1]}"

    def start(self) -> CountingRelay:
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._spawn(self._accept)
        return self

    def reset(self) -> None:
        """Count from zero again."""
        with self._lock:
            self.down_bytes = self.up_bytes = 0

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> CountingRelay:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        assert self._server is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                broker = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()
                continue
            self._spawn(self._pipe, client, broker)

    def _pipe(self, client: socket.socket, broker: socket.socket) -> None:
        """Copy both ways until either side closes (or the relay stops), counting."""
        with selectors.DefaultSelector() as sel, client, broker:
            sel.register(client, selectors.EVENT_READ, (broker, False))
            sel.register(broker, selectors.EVENT_READ, (client, True))
            while not self._stopping.is_set():
                for key, _ in sel.select(timeout=0.2):
                    source: socket.socket = key.fileobj  # type: ignore[assignment]
                    target, downstream = key.data
                    try:
                        data = source.recv(65536)
                        if data:
                            target.sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        return
                    with self._lock:
                        if downstream:
                            self.down_bytes += len(data)
                        else:
                            self.up_bytes += len(data)
