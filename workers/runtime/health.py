"""The rank's HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``.

``/healthz`` answers from memory only (a Redis blip must not get a worker restarted);
``/readyz`` also PINGs Redis through a fresh client, bounded to one second and with
at most one PING in flight, so a hung Redis cannot pile up probe threads.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis

from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.transport.connection import ConnectionFactory

__all__ = ["HealthServer", "Pinger"]

logger = logging.getLogger(__name__)

#: Returns None when ready, else the reason it is not.
ReadyCheck = Callable[[], str | None]
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
    owner: HealthServer


class _Handler(BaseHTTPRequestHandler):
    server: _Httpd

    def do_GET(self) -> None:
        owner = self.server.owner
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype = owner.metrics()
            self._send(200, body, ctype)
        elif path == "/healthz":
            ok = owner.alive()
            self._send(200 if ok else 503, b"ok\n" if ok else b"rank loop is not running\n")
        elif path == "/readyz":
            reason = owner.not_ready()
            if reason is None:
                self._send(200, b"ready\n")
            else:
                self._send(503, f"not ready: {reason}\n".encode())
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n")

    def _send(self, code: int, body: bytes, ctype: str = _TEXT) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("http %s: " + format, self.address_string(), *args)


class HealthServer:
    """Serves the three endpoints from a thread until :meth:`stop`.

    Args:
        host: Address to bind (``0.0.0.0`` so kubelet probes reach it).
        port: TCP port (> 0).
        alive: Whether the rank's loop thread runs (``/healthz``).
        ready: None when ready, else the reason (``/readyz``).
        metrics: The exposition bytes and their content type (``/metrics``).

    Raises:
        OSError: The port cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        alive: Callable[[], bool],
        ready: ReadyCheck,
        metrics: Callable[[], tuple[bytes, str]],
    ) -> None:
        self.alive = alive
        self._ready = ready
        self.metrics = metrics
        #: Set first at shutdown, so ``/readyz`` fails before anything stops.
        self.draining = threading.Event()
        self._httpd = _Httpd((host, port), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="broker-lookup-http",
            daemon=True,
        )

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

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
