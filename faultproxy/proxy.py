"""A TCP proxy for the Redis protocol that injects the faults a Kubernetes network produces.

Tooling for the fault tests and the chaos soak (:mod:`benchmarks.soak.command`); the client
and worker runtime never import it. :class:`FaultProxy` sits between real redis-py
clients and one real server, frames RESP both ways (:mod:`.resp_frames`)
and so knows which reply answers which command. That is what :meth:`FaultProxy.lose_reply`
needs: a command that ran on the server but whose reply never arrived, the ambiguous
failure a client must survive. The other faults are a stall (:meth:`~FaultProxy.hold`),
resets, refused connections and latency.

One selector thread (:mod:`faultproxy.loop`) serves every socket; each
connection is a :mod:`~faultproxy.link` link. The public methods change
the fault state (:mod:`faultproxy.state`) under a lock, or hand the thread
a call and wait for it, so no socket is touched by two threads.

>>> with FaultProxy.for_url(server.url).start() as proxy:  # doctest: +SKIP
...     client = redis.Redis.from_url(proxy.url)
...     proxy.lose_reply("INCR")
...     client.execute_command("INCR", "n")  # ConnectionError, yet the server did INCR n

Names are matched as sent: redis-py's ``incr()`` sends INCRBY. After SUBSCRIBE,
PSUBSCRIBE, SSUBSCRIBE or MONITOR replies no longer pair with commands, so that
connection is forwarded raw and loses no reply (this project uses no pub/sub).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from types import TracebackType
from typing import TypeVar
from urllib.parse import urlsplit

from faultproxy.loop import ProxyLoop
from faultproxy.state import FaultState, LoseRule

__all__ = ["FaultProxy"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_THENS = ("reset", "hold")
_STOP_JOIN_S = 2.0
_CALL_TIMEOUT_S = 5.0


class FaultProxy:
    """A TCP proxy between Redis clients and one server that injects network faults.

    Every fault is thread-safe and applies to open and new connections until cleared.
    Bytes are forwarded unchanged, whole RESP frames at a time.

    Args:
        upstream_host: The server's host.
        upstream_port: The server's port.
        listen_host: Where the proxy listens.
        listen_port: Its port; 0 picks a free one at the first :meth:`start` (a restart
            after :meth:`stop` keeps it, so clients reconnect to the same URL).
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.port = listen_port
        self._db = 0
        self._auth = ""
        self._state = FaultState()
        self._loop: ProxyLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_url(cls, url: str) -> FaultProxy:
        """A proxy in front of the server of ``redis://[user:password@]host:port/db``.

        Its :attr:`url` keeps the database and the credentials.
        """
        parts = urlsplit(url)
        if parts.scheme != "redis":
            raise ValueError(f"not a redis:// URL (TLS cannot be framed): {url!r}")
        proxy = cls(parts.hostname or "localhost", parts.port or 6379)
        path = parts.path.strip("/")
        proxy._db = int(path) if path else 0
        proxy._auth = parts.netloc.rpartition("@")[0] + "@" if "@" in parts.netloc else ""
        return proxy

    @property
    def url(self) -> str:
        """``redis://listen_host:port/db`` of the proxy, for clients to connect through it."""
        return f"redis://{self._auth}{self.listen_host}:{self.port}/{self._db}"

    @property
    def stats(self) -> dict[str, int]:
        """A snapshot of the counters: connections, refused, resets, commands, replies, ..."""
        with self._state.lock:
            return dict(self._state.stats)

    def connections(self) -> int:
        """How many client connections are open now."""
        with self._state.lock:
            return self._state.open_clients

    def start(self) -> FaultProxy:
        """Listen and start forwarding; returns self. Already listening when it returns."""
        if self._thread is not None:
            return self
        loop = ProxyLoop(self._state, self.upstream, (self.listen_host, self.port))
        self.port = loop.port
        thread = threading.Thread(target=loop.run, name=f"faultproxy-{self.port}", daemon=True)
        self._loop = loop
        self._thread = thread
        thread.start()
        return self

    def stop(self) -> None:
        """Close every socket and stop the thread (within about 2 s). Idempotent."""
        loop = self._loop
        thread = self._thread
        self._loop = None
        self._thread = None
        if loop is None or thread is None:
            return
        loop.stop()
        thread.join(_STOP_JOIN_S)
        if thread.is_alive():
            logger.warning("fault proxy on port %d: thread still running after stop", self.port)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def hold(self) -> None:
        """Stall both ways, sockets open: a partition that will heal, or a SIGSTOPped server.

        Nothing is lost: what the peers send waits (in the kernel's buffers and the
        proxy's queues) until :meth:`release`.
        """
        self._set(held=True)

    def release(self) -> None:
        """End a :meth:`hold`: forward what was queued, resume."""
        self._set(held=False)

    def reset(self) -> int:
        """Reset (RST) every open connection now, on both sides; returns how many."""
        return self._call(lambda loop: loop.reset_all(), 0)

    def refuse(self, on: bool = True) -> None:
        """While on, every new connection is reset as soon as it is accepted."""
        self._set(refusing=on)

    def lose_reply(self, command: str, times: int = 1, *, then: str = "reset") -> None:
        """Run the next ``times`` commands named ``command`` on the server, but lose their reply.

        Replies before the lost one (in a pipeline) are delivered, nothing after it. Then
        the client connection is reset (``then="reset"``: a connection lost after the
        server ran the command) or hears nothing more (``then="hold"``: the client only
        learns by its socket timeout; for XREADGROUP, a lost delivery). Commands the
        client sent before the loss still reach the server. Inside MULTI, the reply lost
        is EXEC's, which holds the command's result.

        Args:
            command: A command name, any case; ``"EVALSHA:<sha prefix>"`` (or ``EVAL:``)
                matches one script only, called by EVALSHA or by EVAL.
            times: How many such commands lose their reply.
            then: "reset" or "hold".
        """
        if then not in _THENS:
            raise ValueError(f"then must be one of {_THENS}, not {then!r}")
        if times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        name, _, sha = command.strip().upper().partition(":")
        rule = LoseRule(name=name, sha=sha.lower(), left=times, then=then)
        with self._state.lock:
            self._state.rules.append(rule)

    def delay(self, ms: float) -> None:
        """Add ``ms`` of latency to every chunk, both ways; 0 ends it (for queued chunks too)."""
        if ms < 0:
            raise ValueError(f"delay must be >= 0 ms, not {ms}")
        self._set(delay_s=ms / 1000.0)
        if ms == 0:
            self._call(lambda loop: loop.undelay(), None)

    def clear(self) -> None:
        """End every fault: release, stop refusing, no delay, no pending ``lose_reply``.

        Connections left hanging by ``lose_reply(..., then="hold")`` are reset.
        """
        self._set(held=False, refusing=False, delay_s=0.0)
        with self._state.lock:
            self._state.rules.clear()
        self._call(lambda loop: loop.clear_links(), None)

    def _set(
        self,
        *,
        held: bool | None = None,
        refusing: bool | None = None,
        delay_s: float | None = None,
    ) -> None:
        with self._state.lock:
            if held is not None:
                self._state.held = held
            if refusing is not None:
                self._state.refusing = refusing
            if delay_s is not None:
                self._state.delay_s = delay_s
        loop = self._loop
        if loop is not None:
            loop.wake()

    def _call(self, action: Callable[[ProxyLoop], T], default: T) -> T:
        """Run ``action`` on the loop's thread and wait for it; ``default`` if not running."""
        loop = self._loop
        if loop is None:
            return default
        future: Future[T] = loop.submit(action)
        try:
            return future.result(_CALL_TIMEOUT_S)
        except CancelledError:  # the loop stopped first
            return default
        except FutureTimeout:
            logger.warning("fault proxy on port %d: the loop did not answer", self.port)
            return default
