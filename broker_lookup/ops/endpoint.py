"""One process's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz`` from a thread.

A rank (``python -m workers``) and the exporter serve the same three paths with this one
server; each hands it what only it knows: the exposition, whether it is alive, whether
it is ready. ``/healthz`` should answer from memory only (a Redis blip must not get a
process restarted); ``/readyz`` may ask Redis, through a :class:`Pinger` where a hung
Redis must not pile up probe threads. From :meth:`Endpoint.stop` (or once
:attr:`Endpoint.draining` is set) ``/readyz`` fails first, before anything stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis

from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.transport.connection import ConnectionFactory

__all__ = ["Check", "Endpoint", "Exposition", "Pinger", "PostRoute"]

logger = logging.getLogger(__name__)

#: Returns None when the check passes, else the reason it does not.
Check = Callable[[], str | None]
#: One scrape: (HTTP status, body, content type).
Exposition = Callable[[], tuple[int, bytes, str]]
#: A POST route (``broker-lookup query --listen``'s ``/query``, the reference router's):
#: the request body in, (HTTP status, body, content type) out.
PostRoute = Callable[[bytes], tuple[int, bytes, str]]
#: The largest POST body read (a long prompt's token ids as JSON fit many times over).
MAX_POST_BYTES = 16 << 20
_TEXT = "text/plain; charset=utf-8"


class Pinger:
    """PINGs Redis through a fresh client from a short-lived thread, waiting a bounded time."""

    def __init__(self, factory: ConnectionFactory) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def ping(self, timeout_s: float = 1.0) -> str | None:
        """None if Redis answered within ``timeout_s``, else why not."""
        result: list[str | None] = []
        done = threading.Event()
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return "the previous Redis PING has not answered yet"
            self._thread = threading.Thread(
                target=self._run, args=(result, done), name="broker-lookup-ping", daemon=True
            )
            self._thread.start()
        if not done.wait(timeout_s):
            return f"Redis PING did not answer within {timeout_s:g}s"
        return result[0]

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for a PING still running; it ends by the socket timeout anyway."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self, result: list[str | None], done: threading.Event) -> None:
        try:
            client = self._factory()
            try:
                with translate_redis_errors("answering the readiness probe"):
                    client.ping()
            finally:
                client.close()
            result.append(None)
        except (BrokerLookupError, redis.RedisError, OSError) as exc:
            result.append(f"Redis PING failed: {exc}")
        finally:
            done.set()


class _Httpd(ThreadingHTTPServer):
    daemon_threads = True
    owner: Endpoint


class _Handler(BaseHTTPRequestHandler):
    server: _Httpd

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(*owner.metrics())
        elif path == "/healthz":
            self._send(*_answer(owner.alive(), b"ok\n", "not alive"))
        elif path == "/readyz":
            self._send(*_answer(owner.not_ready(), b"ready\n", "not ready"))
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

    def do_POST(self) -> None:
        route = self.server.owner.routes.get(self.path.split("?", 1)[0])
        length = int(self.headers.get("Content-Length") or 0)
        if route is None:
            self._send(404, b"not found: no such POST route\n")
        elif not 0 <= length <= MAX_POST_BYTES:
            self._send(413, b"body too large\n")
        else:
            try:
                answer = route(self.rfile.read(length))
            except Exception:  # a bug: this request fails, the endpoint serves the next
                logger.exception("http %s: the POST route failed", self.path)
                answer = (500, b"the route failed: see the log\n", _TEXT)
            self._send(*answer)

    def _send(self, code: int, body: bytes, ctype: str = _TEXT) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("http %s: " + format, self.address_string(), *args)


def _answer(reason: str | None, ok: bytes, failed: str) -> tuple[int, bytes]:
    return (200, ok) if reason is None else (503, f"{failed}: {reason}\n".encode())


def _always() -> str | None:
    return None


class Endpoint:
    """Serves the three paths from a thread, from :meth:`start` until :meth:`stop`.

    Args:
        host: Address to bind (``0.0.0.0`` so kubelet probes reach it).
        port: TCP port (0: one the kernel picks, read back from :attr:`port`).
        metrics: One scrape's status, body and content type (``/metrics``).
        alive: None while the process does its work, else why not (``/healthz``).
        ready: None when it should get traffic, else why not (``/readyz``).
        name: The HTTP thread's name.
        routes: POST routes served beside them, by path.

    Raises:
        OSError: The port cannot be bound.

    >>> Endpoint("127.0.0.1", 0, lambda: (200, b"", "text/plain")).start().stop()
    True
    """

    def __init__(
        self,
        host: str,
        port: int,
        metrics: Exposition,
        *,
        alive: Check = _always,
        ready: Check = _always,
        name: str = "broker-lookup-http",
        routes: dict[str, PostRoute] | None = None,
    ) -> None:
        self.metrics = metrics
        self.routes = dict(routes or {})
        self.alive = alive
        self._ready = ready
        #: Set first at shutdown, so ``/readyz`` fails before anything stops.
        self.draining = threading.Event()
        self._httpd = _Httpd((host, port), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name=name,
            daemon=True,
        )

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._httpd.server_address[1])

    def start(self) -> Endpoint:
        """Start serving."""
        self._thread.start()
        return self

    def not_ready(self) -> str | None:
        """The ``/readyz`` answer: None when ready, else why not."""
        if self.draining.is_set():
            return "shutting down"
        return self._ready()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop serving and close the socket; False if the thread did not end in time."""
        self.draining.set()
        if self._thread.is_alive():
            self._httpd.shutdown()  # returns once serve_forever has left its loop
            self._thread.join(timeout_s)
        self._httpd.server_close()
        return not self._thread.is_alive()
