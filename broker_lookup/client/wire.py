"""The client's hot commands on one connection, without redis-py's per-command layers.

A command through ``redis.Redis`` or a ``Pipeline`` costs the scheduler's process
50-100 µs of Python on top of the socket round trip (pool checkout and release, the
retry wrapper, observability hooks, argument packing, response callbacks), and the
sender and the listener send one or two commands per lookup: those layers were most
of their CPU. A :class:`Wire` keeps one connection of its client's pool checked out,
writes commands packed by hiredis with ``Connection.send_packed_command`` and reads
raw replies with ``Connection.read_response``. What a connection does stays
redis-py's: URL options, TLS, unix sockets, AUTH with ACL users, CLIENT SETNAME,
SELECT, health checks, reconnecting after an error, and Sentinel's master tracking
(its connections ask the sentinels for the master when they connect and turn a
demoted master's READONLY into a reconnect).

:func:`wire_for` answers None where there is no such pool: Redis Cluster (routing by
slot lives in ``RedisCluster``) and fakeredis; the loops then keep redis-py's client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis
from redis.exceptions import ResponseError

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.scripts import Call, ScriptSet, is_noscript

__all__ = ["Wire", "pack", "run_scripts", "wire_for"]

Arg = str | bytes | int

#: hiredis' packer; its stub types the argument as a 1-tuple, it takes any length.
_pack_command: Callable[[tuple[Arg, ...]], bytes] = hiredis.pack_command  # type: ignore[assignment]


def pack(*args: Arg) -> bytes:
    """One command in RESP, ready for :meth:`Wire.execute`."""
    return _pack_command(args)


def wire_for(client: object) -> Wire | None:
    """A wire over ``client``'s connection pool, or None where the pool is not redis-py's own
    (a Redis Cluster handle, fakeredis): the caller keeps using ``client`` then."""
    if not isinstance(client, redis.Redis):
        return None
    pool = client.connection_pool
    kind = pool.connection_class
    if not isinstance(kind, type) or not kind.__module__.startswith("redis."):
        return None  # fakeredis' connections speak to an in-process server
    return Wire(pool)


class Wire:
    """One pooled connection, used by one thread: packed commands in, raw replies out."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: Any = None

    def execute(self, commands: Sequence[bytes]) -> list[Any]:
        """Send ``commands`` in one write and read each reply; an error reply comes back as
        its ``ResponseError`` value. A broken or timed-out connection raises redis-py's
        ConnectionError or TimeoutError and is given back; the next call takes a new one."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self._pool.get_connection()
        out: list[Any] = []
        try:
            conn.send_packed_command([b"".join(commands)])
            for _ in commands:
                try:
                    out.append(conn.read_response())
                except ResponseError as exc:  # one command's error: the others' replies follow
                    out.append(exc)
        except BaseException:
            # Back to the pool and a new one from it next time: the pool's checkout runs
            # Connection.connect(), where Sentinel finds the current master; a dropped
            # connection reconnecting by itself would dial the address it had.
            self.close()
            raise
        return out

    def close(self) -> None:
        """Disconnect and give the connection back to its pool (idempotent)."""
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.disconnect()
            self._pool.release(conn)


def run_scripts(wire: Wire, scripts: ScriptSet, calls: Sequence[Call]) -> list[Any]:
    """:meth:`ScriptSet.run` over a wire: one round trip, per-call errors as values, the
    scripts loaded again and the calls that found none re-run once (they did not run)."""
    with translate_redis_errors("running Lua scripts"):
        results = wire.execute([_evalsha(scripts, c) for c in calls])
        redo = [i for i, res in enumerate(results) if is_noscript(res)]
        if redo:
            sources = scripts.source.values()
            loaded = wire.execute([pack("SCRIPT", "LOAD", text) for text in sources])
            for res in loaded:
                if isinstance(res, Exception):
                    raise res
            again = wire.execute([_evalsha(scripts, calls[i]) for i in redo])
            for i, res in zip(redo, again, strict=True):
                results[i] = res
    return results


def _evalsha(scripts: ScriptSet, call: Call) -> bytes:
    return _pack_command(
        ("EVALSHA", scripts.sha[call.script], len(call.keys), *call.keys, *call.args)
    )
