"""A link: what a hot loop needs from a connection (pipelined calls, and a read to take
later), and the lean connection path that gives it: raw commands on one connection, raw
replies.

redis-py spends tens of µs per command above the socket: the client and pipeline
objects, retries, observability hooks, and per-command response callbacks (XREADGROUP's
builds tuples and dicts in Python). A loop that sends a few known commands per wake-up
(the rank's loop in ``workers/pipeline``, the client's sender and listener threads)
skips all that with :class:`LeanLink`: it holds one ``Connection`` of the client's pool,
which keeps what the pool sets up (AUTH and ACL user, TLS, unix sockets, Sentinel's
master discovery and READONLY handling, CLIENT SETNAME, socket timeouts, health
checks), packs a batch with hiredis' packer, writes it in one ``sendall`` and reads the
replies unparsed: bytes, ints, nested lists (maps on RESP3), an error reply as a
``ResponseError`` value. The part below redis-py's API (packing, writing the socket,
taking replies from the connection's hiredis reader, the kernel's socket timeouts) is
:mod:`broker_lookup.transport.redis_internals`, the one module that reads redis-py's
internals, with the redis-py versions it is tested with.

A write may end with a *read*, a blocking command (XREADGROUP BLOCK) whose reply is
taken later with :meth:`Link.take_read`: a rank sends its reports, its acks and its next
read in one round trip. While a read is outstanding nothing else is sent;
:meth:`Link.settle_read` reads its reply early (kept for ``take_read``) when the
connection is needed meanwhile.

:func:`open_link` gives a :class:`LeanLink` for a plain ``redis.Redis`` client, and a
:class:`ClientLink` (same interface, redis-py's pipeline underneath) where there is no
plain pool (Redis Cluster's client: it routes each command by slot). A loop holds the
one it is given and never asks which: what a ``ClientLink`` cannot do (a write from
another thread) it declines through the same interface. Replies through a
``ClientLink`` are shaped by redis-py's callbacks, so callers accept both shapes
(:func:`pairs`, :func:`stream_entries`). On fakeredis, which runs a blocking command
while it is written, a ``LeanLink`` sends the read when it is taken instead of with the
batch.

Another thread may write to a ``LeanLink`` while its owner reads the replies later
(:meth:`LeanLink.send_nowait`, :meth:`LeanLink.replies`): the client's caller writes its
own submits, and the sender thread reads their replies when it next wakes (see
:mod:`broker_lookup.client.sender` for the lock that keeps the two in wire order).

Errors: transport failures raise redis-py's ``ConnectionError``/``TimeoutError`` (the
caller translates them at its boundary) and drop the connection, so no reply of a
failed write is ever taken for a later one; it reconnects on the next call. (A timeout
inside redis-py's own read, a health check's PING, comes as its ``ConnectionError``:
both drop the connection and open the breaker alike.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import redis
from redis.exceptions import ResponseError

from broker_lookup.protocol.commands import Command
from broker_lookup.transport import redis_internals as raw

__all__ = [
    "ClientLink",
    "LeanLink",
    "Link",
    "open_link",
    "pairs",
    "stream_entries",
]


_NO_READ: Any = object()  # no read reply kept


class Link(Protocol):
    """What a hot loop needs from a connection: pipelined calls, and a read to take later."""

    @property
    def reading(self) -> bool:
        """Whether a read was sent and its reply not taken yet."""
        ...

    def call(self, commands: Sequence[Command], read: Command | None = None) -> list[Any]:
        """Send ``commands`` (then ``read``) in one write; their replies, errors as values.

        ``read``'s reply is left for :meth:`take_read`. Raises RuntimeError while a read's
        reply is still on the wire (:meth:`settle_read` first), or for a second read.
        """
        ...

    def take_read(self) -> Any:
        """The reply of the outstanding read (waits for it); an error reply is raised."""
        ...

    def settle_read(self) -> None:
        """Read the outstanding read's reply now, so other commands can be sent meanwhile."""
        ...

    @property
    def accepts_direct(self) -> bool:
        """Whether :meth:`send_nowait` can write on the current connection."""
        ...

    def send_nowait(self, commands: Sequence[Command]) -> bool | None:
        """Write ``commands`` from another thread without waiting (see :class:`LeanLink`);
        None: nothing written, send them another way."""
        ...

    def replies(self, n: int, wait: bool = True) -> list[Any]:
        """The next ``n`` replies of commands :meth:`send_nowait` wrote."""
        ...

    def drop(self) -> None:
        """Disconnect now; it reconnects on next use."""
        ...

    def close(self) -> None:
        """Give the connection back, dropping it if a reply is still unread. Idempotent."""
        ...


def open_link(client: redis.Redis) -> LeanLink | ClientLink:
    """A :class:`LeanLink` on ``client``'s pool where it has a plain one, else a ClientLink.

    Does no I/O: the connection is taken from the pool on the first call.
    """
    pool = getattr(client, "connection_pool", None) if isinstance(client, redis.Redis) else None
    if isinstance(pool, redis.ConnectionPool):
        return LeanLink(pool)
    return ClientLink(client)


def pairs(flat: Any) -> dict[Any, Any]:
    """A raw RESP2 field/value list (``[f1, v1, f2, v2]``) as a dict; a dict stays itself."""
    if isinstance(flat, dict):
        return flat
    it = iter(flat)
    return dict(zip(it, it, strict=True))


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """(id, fields) of each entry of an XREAD or XREADGROUP reply: RESP2 lists or RESP3 maps, raw
    (fields a flat list, None for an entry trimmed while pending) or redis-py's dicts."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [s[1] for s in reply]
    out: list[tuple[bytes, dict[bytes, bytes] | None]] = []
    for entries in streams:
        for entry_id, fields in entries:
            out.append((entry_id, None if fields is None else pairs(fields)))
    return out


class LeanLink:
    """One connection of a redis-py pool, used raw (see the module docstring).

    Not thread-safe: one loop owns it.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._conn: Any = None
        self._on_wire = False  # a read was written and its reply not read yet
        self._kept: Any = _NO_READ  # a read's reply, read early by settle_read
        self._deferred: Command | None = None  # fakeredis: the read, sent when taken
        #: A plain TCP or unix connection of redis-py's own: written on its socket directly.
        self._plain = False
        self._defer = pool.connection_class.__module__.startswith("fakeredis")
        self._hiredis = raw.hiredis_packs(pool)  # fixed per pool, so decided once
        raw.warn_once_if_missing()

    @property
    def reading(self) -> bool:
        """Whether a read was sent and its reply not taken yet."""
        return self._on_wire or self._kept is not _NO_READ or self._deferred is not None

    def call(self, commands: Sequence[Command], read: Command | None = None) -> list[Any]:
        """Send ``commands`` (then ``read``) in one write; their replies, errors as values."""
        if self._on_wire or (read is not None and self.reading):
            raise RuntimeError("LeanLink.call while a read is outstanding")
        wire = commands
        if read is not None:
            if self._defer:
                self._deferred = read
            else:
                wire = [*commands, read]
        if not wire:
            return []
        conn = self._conn
        if conn is None or not conn.is_connected:
            conn = self._connection()
        reads = read is not None and not self._defer
        return self._send(conn, self._pack(conn, wire), len(commands), reads)

    def _send(self, conn: Any, chunks: list[bytes], n: int, reads: bool) -> list[Any]:
        """Write ``chunks`` on ``conn``; the replies of the first ``n`` commands. ``reads``:
        the write ends with a read whose reply stays on the wire. Errors drop the connection."""
        try:
            raw.write(conn, chunks, self._plain)
            self._on_wire = reads
            return raw.read_replies(conn, n) if n else []
        except BaseException:
            self._drop()
            raise

    @property
    def accepts_direct(self) -> bool:
        """Whether :meth:`send_nowait` can write on the current connection."""
        conn = self._conn
        return conn is not None and raw.accepts_direct(conn)

    def send_nowait(self, commands: Sequence[Command]) -> bool | None:
        """Write ``commands`` without ever waiting, from a thread other than the owner's.

        True: all of it is on the wire, the replies are the owner's to read in order
        (:meth:`replies`). None: nothing was written (no plain connected socket, or its
        buffer is full): send it another way. False: part of it was written, so the
        connection is out of step and its owner must :meth:`drop` it. Only plain TCP and
        unix connections qualify: TLS, Sentinel's and fakeredis' go through the owner.
        """
        if self._on_wire or not self.accepts_direct:
            return None
        conn = self._conn
        data = b"".join(self._pack(conn, commands))
        written = raw.write_nowait(conn, data)
        return None if written is None else written == len(data)

    def replies(self, n: int, wait: bool = True) -> list[Any]:
        """The next ``n`` replies of commands another thread sent (:meth:`send_nowait`);
        ``wait`` False: only those already there. Transport errors drop the connection."""
        conn = self._conn
        if conn is None or not n:
            return []
        try:
            return raw.read_replies(conn, n, wait)
        except BaseException:
            self._drop()
            raise

    def drop(self) -> None:
        """Disconnect now (a write was torn, a reply is overdue); it reconnects on next use."""
        self._drop()

    def take_read(self) -> Any:
        """The reply of the outstanding read (waits for it); an error reply is raised."""
        kept = self._kept
        if kept is not _NO_READ:
            self._kept = _NO_READ
            if isinstance(kept, ResponseError):
                raise kept
            return kept
        if not (self._on_wire or self._deferred is not None):
            raise RuntimeError("LeanLink.take_read with no read outstanding")
        conn = self._conn
        if conn is None or not raw.connected(conn, self._plain):
            conn = self._connection()
        try:
            deferred = self._deferred
            if deferred is not None:
                self._deferred = None
                conn.send_packed_command(self._pack(conn, [deferred]))
            self._on_wire = False
            [reply] = raw.read_replies(conn, 1)
            if isinstance(reply, ResponseError):
                raise reply
            return reply
        except ResponseError:
            raise  # a whole reply was read: the connection stays in step
        except BaseException:
            self._drop()
            raise

    def settle_read(self) -> None:
        """Read the outstanding read's reply now; :meth:`take_read` returns it later."""
        if not self._on_wire:
            return  # nothing on the wire: none yet, already kept, or deferred
        try:
            reply = self.take_read()
        except ResponseError as exc:
            reply = exc
        self._kept = reply

    def close(self) -> None:
        """Give the connection back to its pool, disconnected. Idempotent."""
        conn = self._conn
        self._conn = None
        self._forget()
        if conn is not None:
            conn.disconnect()
            self._pool.release(conn)

    def _connection(self) -> Any:
        """The connection, checked out of the pool the first time, reconnected after a drop."""
        conn = self._conn
        if conn is None:
            conn = self._conn = self._pool.get_connection()  # connected by the pool
            self._plain = raw.is_plain(conn)
        elif not conn.is_connected:
            # Through the connection's own connect(): a Sentinel-managed one asks the
            # sentinels for the master again (a write would reconnect to the old address).
            conn.connect()
        return conn

    def _pack(self, conn: Any, commands: Sequence[Command]) -> list[bytes]:
        """The wire bytes of ``commands`` on ``conn`` (:func:`.redis_internals.pack`)."""
        return raw.pack(conn, commands, self._hiredis)

    def _forget(self) -> None:
        self._on_wire = False
        self._kept = _NO_READ
        self._deferred = None

    def _drop(self) -> None:
        """Disconnect (it reconnects on the next call) and forget every pending reply."""
        self._forget()
        if self._conn is not None:
            self._conn.disconnect()


class ClientLink:
    """The :class:`Link` interface over a client's own pipeline (Redis Cluster)."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._read: Command | None = None

    @property
    def reading(self) -> bool:
        """Whether a read was sent and its reply not taken yet."""
        return self._read is not None

    def call(self, commands: Sequence[Command], read: Command | None = None) -> list[Any]:
        """Run ``commands`` in one pipelined round trip; ``read`` runs when it is taken."""
        if read is not None and self._read is not None:
            raise RuntimeError("ClientLink.call with a read while one is outstanding")
        results: list[Any] = []
        if commands:
            pipe = self._client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]  # untyped in redis-py
            results = list(pipe.execute(raise_on_error=False))
        if read is not None:
            self._read = read
        return results

    def take_read(self) -> Any:
        """Run the read now and return its reply; an error reply is raised."""
        read, self._read = self._read, None
        if read is None:
            raise RuntimeError("ClientLink.take_read with no read outstanding")
        return self._client.execute_command(*read)  # type: ignore[no-untyped-call]  # untyped in redis-py

    def settle_read(self) -> None:
        """Nothing to settle: the read is only sent when it is taken."""

    @property
    def accepts_direct(self) -> bool:
        """Never: a cluster's commands are routed by its client, not written on a socket."""
        return False

    def send_nowait(self, commands: Sequence[Command]) -> bool | None:
        """Writes nothing (None): the commands go through :meth:`call` instead."""
        return None

    def replies(self, n: int, wait: bool = True) -> list[Any]:
        """None owed: :meth:`send_nowait` never writes."""
        return []

    def drop(self) -> None:
        """Forget the outstanding read; redis-py's client reconnects on its own."""
        self._read = None

    def close(self) -> None:
        """Forget the outstanding read; the client is its owner's to close."""
        self._read = None
