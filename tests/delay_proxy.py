"""A TCP proxy on loopback that delays every reply: a Redis in another zone, for tests.

Bytes from the client go to the server at once; bytes from the server reach the client
`delay_s` after they arrived, in order, so each request/response round trip takes at least
`delay_s` longer. It listens on 127.0.0.1 only, serves at most `max_connections`, and stops
by itself after `lifetime_s` if the test forgets to (every thread is a daemon and every
socket has a timeout).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from urllib.parse import urlparse


class DelayProxy:
    def __init__(self, target: str, delay_s: float, max_connections: int = 32, lifetime_s: float = 300.0):
        """Args:
        target: the server's URL (redis://host:port/db or unix:///path.sock).
        """
        self.target = urlparse(target)
        self.delay_s = delay_s
        self.max_connections = max_connections
        self.stop_at = time.monotonic() + lifetime_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, name="delay-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """A redis:// URL through the proxy (same database as the target)."""
        db = self.target.path.lstrip("/") if self.target.scheme == "redis" else ""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _connect_upstream(self) -> socket.socket:
        if self.target.scheme == "unix":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(self.target.path)
            return s
        return socket.create_connection((self.target.hostname or "127.0.0.1", self.target.port or 6379))

    def _running(self) -> bool:
        return not self._stopped.is_set() and time.monotonic() < self.stop_at

    def _accept_loop(self) -> None:
        served = 0
        while self._running() and served < self.max_connections:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            served += 1
            upstream = self._connect_upstream()
            for s in (client, upstream):
                s.settimeout(0.2)
                self._sockets.append(s)
            delayed: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
            for target, args in (
                (self._pump, (client, upstream)),  # requests: at once
                (self._pump_into, (upstream, delayed)),  # replies: stamped on arrival ...
                (self._release, (delayed, client)),  # ... and sent delay_s later
            ):
                threading.Thread(target=target, args=args, daemon=True).start()
        self.stop()

    def _recv(self, src: socket.socket) -> bytes | None:
        """The next bytes, b"" while idle, None once the connection is over."""
        try:
            data = src.recv(1 << 16)
        except TimeoutError:
            return b"" if self._running() else None
        except OSError:
            return None
        return data or None

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while (data := self._recv(src)) is not None:
            if data:
                try:
                    dst.sendall(data)
                except OSError:
                    break
        dst.close()  # the client left: so does the server side, and with it the reply threads

    def _pump_into(self, src: socket.socket, out: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        while (data := self._recv(src)) is not None:
            if data:
                out.put((time.monotonic() + self.delay_s, data))
        out.put((0.0, b""))  # end of stream

    def _release(self, src: queue.SimpleQueue[tuple[float, bytes]], dst: socket.socket) -> None:
        while True:
            try:
                due, data = src.get(timeout=0.2)
            except queue.Empty:
                if not self._running():
                    return
                continue
            if not data:
                dst.close()
                return
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                dst.sendall(data)
            except OSError:
                return

    def stop(self) -> None:
        self._stopped.set()
        for s in [self._listener, *self._sockets]:
            with suppress(OSError):
                s.close()


@contextmanager
def delay_proxy(target: str, delay_s: float) -> Iterator[DelayProxy]:
    """A `DelayProxy` in front of `target`, stopped on exit."""
    proxy = DelayProxy(target, delay_s)
    try:
        yield proxy
    finally:
        proxy.stop()
