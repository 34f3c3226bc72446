"""The client behind ``redis+cluster://``: one ``RedisCluster`` shared by a factory's clients.

A ``RedisCluster`` is thread-safe and holds a connection pool per node, so every
component a factory serves (sender, listener, consumer, reporter...) shares one. Each
factory call returns a :class:`_Handle`: it does no I/O until first used (a factory
call never raises, as with the other URL schemes), and its ``close()`` gives its
reference back; the last one closes the client, and a later call makes a new one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import ConnectionError, RedisClusterException

__all__ = ["SharedCluster"]


class _LocalKeys:
    """Finds the keys of EVALSHA, EVAL, XREAD and XREADGROUP without asking the server.

    redis-py routes these "movablekeys" commands with a ``COMMAND GETKEYS`` round trip
    to the default node before each one (every EVALSHA of a ``ClusterPipeline``, every
    blocking read): a second round trip per command, all on one node. Their key
    positions are fixed by the protocol, so we read them here; any other command, and
    every other attribute, is left to the parser redis-py made (wrapped, not subclassed:
    its class lives in a private module of redis-py).
    """

    def __init__(self, parser: Any) -> None:
        self._parser = parser

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        """The keys of one command: read from its arguments where the protocol fixes them."""
        name = str(args[0]).upper() if args else ""
        if name in ("EVALSHA", "EVAL") and len(args) > 2:
            return list(args[3 : 3 + int(args[2])]) or None
        start = {"XREAD": 1, "XREADGROUP": 4}.get(name)
        if start is not None:
            words = [a.upper() if isinstance(a, (str, bytes)) else a for a in args]
            words = [w.decode("latin-1") if isinstance(w, bytes) else w for w in words]
            if "STREAMS" in words[start:]:
                streams = args[words.index("STREAMS", start) + 1 :]
                return list(streams[: len(streams) // 2])
        return self._parser.get_keys(redis_conn, *args)


class SharedCluster:
    """One client made on first use, shared by every handle, closed with the last handle."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._client: Any = None
        self._refs = 0

    def acquire(self) -> redis.Redis:
        """A new handle; it is a client, and its ``close()`` gives the reference back."""
        with self._lock:
            self._refs += 1
        handle: Any = _Handle(self)
        return handle  # type: ignore[no-any-return]  # duck-typed like redis.Redis

    def get(self) -> Any:
        """The shared client, made now if there is none."""
        with self._lock:
            if self._client is None:
                try:
                    client = self._make()
                except RedisClusterException as exc:  # no node reachable, or no full coverage
                    raise ConnectionError(f"Redis Cluster unreachable: {exc}") from exc
                parser = getattr(client, "commands_parser", None)
                if parser is not None and not isinstance(parser, _LocalKeys):
                    client.commands_parser = _LocalKeys(parser)
                self._client = client
            return self._client

    def release(self) -> None:
        """One handle is closed; the last one closes the client."""
        with self._lock:
            self._refs -= 1
            client = self._client
            last = self._refs == 0
            if last:
                self._client = None
        if last and client is not None:
            client.close()


class _Handle:
    """A client made lazily, so a factory call never does I/O and never raises."""

    __slots__ = ("_closed", "_shared")

    def __init__(self, shared: SharedCluster) -> None:
        self._shared = shared
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        if self._closed:
            raise ConnectionError("this Redis Cluster handle is closed")
        return getattr(self._shared.get(), name)

    def close(self) -> None:
        """Give the shared client back; the last handle closes it. Idempotent."""
        if not self._closed:
            self._closed = True
            self._shared.release()

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
