"""A lean connection path for hot loops: raw commands on one connection, raw replies.

redis-py spends tens of µs per command above the socket: the client and pipeline
objects, retries, observability hooks, and per-command response callbacks (XREADGROUP's
builds tuples and dicts in Python). A loop that sends a few known commands per wake-up
(the rank's loop in ``workers/pipeline``, the client's sender and listener threads)
skips all that with :class:`LeanLink`: it holds one ``Connection`` of the client's pool,
which keeps what the pool sets up (AUTH and ACL user, TLS, unix sockets, Sentinel's
master discovery and READONLY handling, CLIENT SETNAME, socket timeouts, health
checks), packs a batch with the connection's packer (hiredis when installed), writes it
in one ``sendall`` and reads the replies unparsed: bytes, ints, nested lists (maps on
RESP3), an error reply as a ``ResponseError`` value. Replies are taken from the
connection's own hiredis reader (:func:`read_replies`), below redis-py's
``read_response``, whose per-reply checks cost about 0.8 µs of the 1 µs a small reply
takes; the connection's parser still reads the socket and builds the error values.

A write may end with a *read*, a blocking command (XREADGROUP BLOCK) whose reply is
taken later with :meth:`Link.take_read`: a rank sends its reports, its acks and its next
read in one round trip. While a read is outstanding nothing else is sent;
:meth:`Link.settle_read` reads its reply early (kept for ``take_read``) when the
connection is needed meanwhile.

:func:`open_link` gives a :class:`LeanLink` for a plain ``redis.Redis`` client, and a
:class:`ClientLink` (same interface, redis-py's pipeline underneath) where there is no
plain pool (Redis Cluster's client: it routes each command by slot). Replies through a
``ClientLink`` are shaped by redis-py's callbacks, so callers accept both shapes. On
fakeredis, which runs a blocking command while it is written, a ``LeanLink`` sends the
read when it is taken instead of with the batch.

Another thread may write to a ``LeanLink`` while its owner reads the replies later
(:meth:`LeanLink.send_nowait`, :meth:`LeanLink.replies`): the client's caller writes its
own submits, and the sender thread reads their replies when it next wakes (see
:mod:`broker_lookup.client.sender` for the lock that keeps the two in wire order).

On a plain TCP or unix socket the connection's ``socket_timeout`` is kept by the kernel
(:func:`kernel_timeouts`): the socket blocks, so a read or a write is one system call
instead of Python's ``poll`` and then the call.

Errors: transport failures raise redis-py's ``ConnectionError``/``TimeoutError`` (the
caller translates them at its boundary) and drop the connection, so no reply of a
failed write is ever taken for a later one; it reconnects on the next call. (A timeout
inside redis-py's own read, a health check's PING, comes as its ``ConnectionError``:
both drop the connection and open the breaker alike.)
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any, Protocol

import redis
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from broker_lookup.protocol.commands import Command

if HIREDIS_AVAILABLE:
    import hiredis
    from redis._parsers import _HiredisParser
    from redis._parsers.hiredis import NOT_ENOUGH_DATA

__all__ = [
    "ClientLink",
    "LeanLink",
    "Link",
    "kernel_timeouts",
    "open_link",
    "pairs",
    "read_replies",
]


_NO_READ: Any = object()  # no read reply kept
#: Connection classes another thread may write to (:meth:`LeanLink.send_nowait`).
_DIRECT_CONNECTIONS = (redis.Connection, redis.UnixDomainSocketConnection)

#: hiredis' packer where installed (its stub types the argument as a 1-tuple, it takes any).
_pack_command: Any = hiredis.pack_command if HIREDIS_AVAILABLE else None
#: The parser whose reader :func:`read_replies` takes replies from directly.
_HIREDIS_PARSER: Any = _HiredisParser if HIREDIS_AVAILABLE else None
_NOT_ENOUGH: Any = NOT_ENOUGH_DATA if HIREDIS_AVAILABLE else object()
#: RESP3 push messages (hiredis 3.2+); nothing this package sends asks for one.
_PUSH: Any = getattr(hiredis, "PushNotification", None) if HIREDIS_AVAILABLE else None
#: Reply types that need no further look: everything but errors and pushes.
_PLAIN = frozenset({bytes, int, list, type(None)})
#: redis-py's own ``read_response``: a connection class that overrides it (Sentinel's
#: re-routes on READONLY, fakeredis has no socket) is read through its override.
_REDIS_READ = redis.connection.AbstractConnection.read_response
#: What redis-py's parsers raise for a peer that closed the connection.
_SERVER_CLOSED = "Connection closed by server."


def read_replies(conn: Any, n: int, wait: bool = True) -> list[Any]:
    """The next ``n`` replies on redis-py connection ``conn``, raw, an error reply as a
    ``ResponseError`` value; a connection-level error reply (LOADING, NOAUTH) is raised.

    Equivalent to ``conn.read_response(disable_decoding=True)`` per reply, without its
    per-reply layers: the connection's hiredis reader is read directly, and its parser
    refills it from the socket (a timeout, a closed or reset peer raise redis-py's
    ``TimeoutError`` and ``ConnectionError``, as ``read_response`` does). Other
    parsers (no hiredis) and connection classes with their own ``read_response``
    (Sentinel's, fakeredis') go through ``read_response``.

    ``wait`` False: only the replies already there (up to ``n``). The socket is read
    only while ``select`` says it holds data, so a stalled server costs no wait; this
    needs the direct path (:attr:`LeanLink.accepts_direct`).
    """
    parser = conn._parser
    direct = type(parser) is _HIREDIS_PARSER and type(conn).read_response is _REDIS_READ
    reader = parser._reader if direct else None
    sock: Any = getattr(conn, "_sock", None)
    if reader is None or (not wait and sock is None):
        if not wait:
            raise ConnectionError("replies without waiting need a connected hiredis connection")
        return _read_responses(conn, n)
    out: list[Any] = []
    gets = reader.gets
    # A plain TCP or unix socket is read here, as the parser would (TLS goes through it).
    buffer = parser._buffer if type(sock) is socket.socket else None
    left = n
    while left:
        reply = gets(False)
        if reply is _NOT_ENOUGH:
            if not wait and not select.select([sock], [], [], 0)[0]:
                break
            _refill(parser, sock, buffer)
            continue
        kind = type(reply)
        if kind not in _PLAIN:
            if isinstance(reply, ConnectionError):
                raise reply
            if kind is _PUSH:
                continue  # unasked for: not a reply to any command sent
        elif kind is list and reply and isinstance(reply[0], ConnectionError):
            raise reply[0]
        out.append(reply)
        left -= 1
    interval = conn.health_check_interval
    if interval and out:  # what read_response does per reply: the connection proved alive
        conn.next_health_check = time.monotonic() + interval
    return out


def kernel_timeouts(sock: socket.socket) -> None:
    """Make a plain socket blocking, its timeout kept by the kernel instead of Python.

    Python keeps a socket's timeout by making it non-blocking and calling ``poll`` before
    every ``recv`` and ``send``: two system calls and two releases of the GIL per read
    or write. With the same timeout as ``SO_RCVTIMEO`` and ``SO_SNDTIMEO`` on a blocking
    socket each is one call; a timed-out one fails with ``EAGAIN`` (``BlockingIOError``),
    which :func:`_refill` and :func:`_send_all` raise as redis-py's ``TimeoutError``.

    Idempotent and cheap (one ``gettimeout`` once done), so it is called before each use:
    redis-py puts its own timeout back when it reconnects or reads with a timeout of its
    own (a pool's checkout). A socket without a timeout, or non-blocking, is left as is.
    """
    timeout = sock.gettimeout()
    if not timeout:
        return
    seconds, fraction = divmod(timeout, 1.0)
    # A zeroed timeval means no timeout at all to the kernel: never round down to it.
    micros = max(int(fraction * 1_000_000), 0 if seconds else 1)
    value = struct.pack("@ll", int(seconds), micros)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    sock.settimeout(None)


def _refill(parser: Any, sock: Any, buffer: bytearray | None) -> None:
    """Read what the socket holds into ``parser``'s hiredis reader; ``buffer`` (the
    parser's own) for a plain socket read here, None to let the parser read it."""
    try:
        if buffer is None:
            parser.read_from_socket()
            return
        kernel_timeouts(sock)
        got = sock.recv_into(buffer)
    except (TimeoutError, BlockingIOError) as exc:  # Python's timeout, or the kernel's
        raise RedisTimeoutError("Timeout reading from socket") from exc
    except OSError as exc:  # a reset peer: what read_response raises for it
        raise ConnectionError(f"Error while reading from the socket: {exc!r}") from exc
    if not got:
        raise ConnectionError(_SERVER_CLOSED)
    parser._reader.feed(buffer, 0, got)


def _send_all(sock: socket.socket, chunks: list[bytes]) -> None:
    """``send_packed_command`` on a plain socket: the same errors, without its layers (the
    caller drops the connection on any of them, as redis-py would)."""
    try:
        kernel_timeouts(sock)
        for chunk in chunks:
            sock.sendall(chunk)
    except (TimeoutError, BlockingIOError) as exc:  # Python's timeout, or the kernel's
        raise RedisTimeoutError("Timeout writing to socket") from exc
    except OSError as exc:
        raise ConnectionError(f"Error while writing to socket: {exc!r}") from exc


def _read_responses(conn: Any, n: int) -> list[Any]:
    """:func:`read_replies` through redis-py's ``read_response``, which raises error replies."""
    out: list[Any] = []
    for _ in range(n):
        try:
            out.append(conn.read_response(disable_decoding=True))
        except ResponseError as exc:
            out.append(exc)
    return out


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
        #: A plain TCP or unix connection of redis-py's own: written here, not through it.
        self._plain = False
        self._defer = pool.connection_class.__module__.startswith("fakeredis")
        # Fixed per pool, so decided once: hiredis packs str as UTF-8, nothing else.
        encoding = pool.connection_kwargs.get("encoding", "utf-8")
        self._hiredis = HIREDIS_AVAILABLE and encoding == "utf-8"

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
            sock = conn._sock if self._plain else None
            if sock is None or (
                conn.health_check_interval and conn.next_health_check < time.monotonic()
            ):
                conn.send_packed_command(chunks)  # connects, or PINGs a quiet connection first
            else:
                _send_all(sock, chunks)
            self._on_wire = reads
            return read_replies(conn, n) if n else []
        except BaseException:
            self._drop()
            raise

    @property
    def accepts_direct(self) -> bool:
        """Whether :meth:`send_nowait` can write on the current connection."""
        conn = self._conn
        return (
            conn is not None
            and type(conn) in _DIRECT_CONNECTIONS
            and type(getattr(conn, "_sock", None)) is socket.socket
            and type(conn._parser) is _HIREDIS_PARSER  # replies(wait=False) reads its reader
        )

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
        sock: socket.socket = conn._sock
        data = b"".join(self._pack(conn, commands))
        written: int
        try:
            if sock.gettimeout() is None:  # blocking (kernel_timeouts): the flag never waits
                written = sock.send(data, socket.MSG_DONTWAIT)
            else:
                # Not converted yet (no read or write of the owner's since it connected):
                # non-blocking underneath, and its send() would poll for room for up to
                # the timeout, so write to the descriptor instead.
                written = os.write(sock.fileno(), data)
        except OSError:  # full (nothing written) or broken: the owner's next call finds out
            return None
        return written == len(data)

    def replies(self, n: int, wait: bool = True) -> list[Any]:
        """The next ``n`` replies of commands another thread sent (:meth:`send_nowait`);
        ``wait`` False: only those already there. Transport errors drop the connection."""
        conn = self._conn
        if conn is None or not n:
            return []
        try:
            return read_replies(conn, n, wait)
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
        # is_connected, spelled out: this runs once per rank turn.
        if conn is None or (conn._sock is None if self._plain else not conn.is_connected):
            conn = self._connection()
        try:
            deferred = self._deferred
            if deferred is not None:
                self._deferred = None
                conn.send_packed_command(self._pack(conn, [deferred]))
            self._on_wire = False
            [reply] = read_replies(conn, 1)
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
            self._plain = type(conn) in _DIRECT_CONNECTIONS
        elif not conn.is_connected:
            # Through the connection's own connect(): a Sentinel-managed one asks the
            # sentinels for the master again (a write would reconnect to the old address).
            conn.connect()
        return conn

    def _pack(self, conn: Any, commands: Sequence[Command]) -> Any:
        """The wire bytes of ``commands``: hiredis's packer called directly where redis-py
        would call it too (a fifth of the cost: redis-py re-checks every argument first)."""
        if not self._hiredis:
            return conn.pack_commands(commands)
        if len(commands) == 1:
            return [_pack_command(tuple(commands[0]))]
        return [b"".join([_pack_command(tuple(c)) for c in commands])]

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

    def close(self) -> None:
        """Forget the outstanding read; the client is its owner's to close."""
        self._read = None
