"""Commands and replies on a redis-py connection below redis-py's API: the one module that
reads redis-py's internals.

Why: latency. redis-py spends tens of µs per command above the socket, and about 0.8 µs
of the 1 µs a small reply takes in ``read_response``'s per-reply checks. The hot loops'
link (:class:`~broker_lookup.transport.link.LeanLink`) keeps redis-py's connection (what
its pool sets up: AUTH, TLS, Sentinel, health checks) and does the per-command part here:

* :func:`pack` packs with hiredis' packer directly (redis-py re-checks every argument first);
* :func:`write` writes a plain TCP or unix connection's socket itself, and
  :func:`write_nowait` writes it without ever waiting, from another thread;
* :func:`read_replies` takes replies from the connection's own hiredis reader, which its
  parser refills from the socket (a plain socket's is read here, into the parser's buffer);
* :func:`kernel_timeouts` gives the socket's timeout to the kernel: one system call per
  read or write instead of Python's ``poll`` and then the call.

What it reads that redis-py does not publish: a connection's ``_sock`` and ``_parser``,
the hiredis parser's ``_reader``, ``_buffer`` and ``read_from_socket``, and
``redis._parsers``' ``_HiredisParser`` and ``NOT_ENOUGH_DATA``. Tested with redis-py
8.0, 8.1 and 8.2 (:data:`SUPPORTED_REDIS_PY`, the range ``pyproject.toml`` pins). At
import it checks that the installed redis-py still has them (:data:`MISSING`); where
one is gone, every call takes redis-py's own path instead (``send_packed_command``,
``read_response``): slower, the same replies, and :func:`warn_once_if_missing` says why.

Errors are redis-py's: a timeout raises its ``TimeoutError``, a closed or reset peer its
``ConnectionError``, as its own write and ``read_response`` do.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import ConnectionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from broker_lookup.protocol.commands import Command

_IMPORT_ERROR: str | None = None
if HIREDIS_AVAILABLE:
    import hiredis

    try:
        from redis._parsers import _HiredisParser
        from redis._parsers.hiredis import NOT_ENOUGH_DATA
    except ImportError as exc:  # a redis-py that moved them: redis-py's own path
        _IMPORT_ERROR = f"redis._parsers ({exc})"

__all__ = [
    "MISSING",
    "SUPPORTED_REDIS_PY",
    "accepts_direct",
    "connected",
    "hiredis_packs",
    "is_plain",
    "kernel_timeouts",
    "pack",
    "read_replies",
    "warn_once_if_missing",
    "write",
    "write_nowait",
]

log = logging.getLogger(__name__)

#: The redis-py versions this module is tested with; ``pyproject.toml`` pins the same.
SUPPORTED_REDIS_PY = ">=8.0,<8.3"

#: Connection classes whose socket is written here (TLS, Sentinel's and fakeredis' are not).
_DIRECT_CONNECTIONS = (redis.Connection, redis.UnixDomainSocketConnection)
_DIRECT = HIREDIS_AVAILABLE and _IMPORT_ERROR is None
#: hiredis' packer where installed (its stub types the argument as a 1-tuple, it takes any).
_pack_command: Any = hiredis.pack_command if HIREDIS_AVAILABLE else None
#: The parser whose reader :func:`read_replies` takes replies from directly.
_HIREDIS_PARSER: Any = _HiredisParser if _DIRECT else None
_NOT_ENOUGH: Any = NOT_ENOUGH_DATA if _DIRECT else object()
#: RESP3 push messages (hiredis 3.2+); nothing this package sends asks for one.
_PUSH: Any = getattr(hiredis, "PushNotification", None) if HIREDIS_AVAILABLE else None
#: Reply types that need no further look: everything but errors and pushes.
_PLAIN = frozenset({bytes, int, list, type(None)})
#: redis-py's own ``read_response``: a connection class that overrides it (Sentinel's
#: re-routes on READONLY, fakeredis has no socket) is read through its override.
_REDIS_READ = redis.connection.AbstractConnection.read_response
#: What redis-py's parsers raise for a peer that closed the connection.
_SERVER_CLOSED = "Connection closed by server."


def _missing() -> str | None:
    """What this module reads that the installed redis-py lacks; None: nothing.

    Looked for on a connection that never connects (no I/O): the attributes a connection
    and its parser set up, its hiredis reader made as on connecting, and the parser's
    socket read.
    """
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    connection_class: Any = redis.Connection  # its __init__ is untyped
    conn = connection_class()
    state = vars(conn)
    for name in ("_sock", "_parser", "health_check_interval", "next_health_check"):
        if name not in state:
            return f"Connection.{name}"
    if not HIREDIS_AVAILABLE:
        return None  # no hiredis: replies go through read_response anyway
    parser = conn._parser
    if type(parser) is not _HIREDIS_PARSER:
        return f"hiredis parser by default (got {type(parser).__name__})"
    if not isinstance(vars(parser).get("_buffer"), bytearray):
        return "_HiredisParser._buffer"
    if not callable(getattr(parser, "read_from_socket", None)):
        return "_HiredisParser.read_from_socket"
    try:  # the reader is made when the connection connects: make one without a socket
        parser.on_connect(conn)
        reader = vars(parser).get("_reader")
        parser.on_disconnect()
    except Exception as exc:  # a parser that needs more than it did
        return f"_HiredisParser.on_connect/on_disconnect ({exc!r})"
    if not isinstance(reader, hiredis.Reader):
        return "_HiredisParser._reader"
    return None


#: What of redis-py's internals the installed redis-py lacks (None: it has them all);
#: where set, writes and reads take redis-py's own path.
MISSING: str | None = _missing()
_warned = False


def warn_once_if_missing() -> None:
    """Log once per process that redis-py's own, slower path is taken, and why."""
    global _warned
    if MISSING is None or _warned:
        return
    _warned = True
    log.warning(
        "redis-py %s lacks %s: the hot loops take redis-py's own, slower path "
        "(the lean link is tested with redis-py %s)",
        redis.__version__,
        MISSING,
        SUPPORTED_REDIS_PY,
    )


def hiredis_packs(pool: redis.ConnectionPool) -> bool:
    """Whether :func:`pack` packs for ``pool``'s connections with hiredis directly:
    hiredis packs str as UTF-8, so only with hiredis installed and that encoding."""
    return HIREDIS_AVAILABLE and pool.connection_kwargs.get("encoding", "utf-8") == "utf-8"


def pack(conn: Any, commands: Sequence[Command], hiredis_packer: bool) -> list[bytes]:
    """The wire bytes of ``commands``: hiredis's packer called directly where redis-py
    would call it too (a fifth of the cost: redis-py re-checks every argument first)."""
    if not hiredis_packer:
        packed: list[bytes] = conn.pack_commands(commands)
        return packed
    if len(commands) == 1:
        return [_pack_command(tuple(commands[0]))]
    return [b"".join([_pack_command(tuple(c)) for c in commands])]


def is_plain(conn: Any) -> bool:
    """Whether ``conn`` is a plain TCP or unix connection of redis-py's own, whose socket
    :func:`write` writes itself."""
    return MISSING is None and type(conn) in _DIRECT_CONNECTIONS


def connected(conn: Any, plain: bool) -> bool:
    """``conn.is_connected``, read from its socket directly where :func:`is_plain`
    (the same answer, cheaper: this runs once per rank turn)."""
    return conn._sock is not None if plain else bool(conn.is_connected)


def accepts_direct(conn: Any) -> bool:
    """Whether :func:`write_nowait` can write on ``conn`` and :func:`read_replies` read
    it without waiting: a plain connection, connected, with the hiredis parser."""
    return (
        is_plain(conn)
        and type(conn._sock) is socket.socket
        and type(conn._parser) is _HIREDIS_PARSER
    )


def write(conn: Any, chunks: list[bytes], plain: bool) -> None:
    """Write ``chunks`` on ``conn``: on its socket directly where ``plain``
    (:func:`is_plain`), else, or to connect, or when a health check is due, through
    ``send_packed_command`` (it connects, or PINGs a quiet connection first)."""
    sock = conn._sock if plain else None
    if sock is None or (conn.health_check_interval and conn.next_health_check < time.monotonic()):
        conn.send_packed_command(chunks)
    else:
        _send_all(sock, chunks)


def write_nowait(conn: Any, data: bytes) -> int | None:
    """Write ``data`` on ``conn``'s socket without ever waiting (:func:`accepts_direct`
    connections only): how much was written, None for nothing (its buffer is full, or
    the socket is broken: the owner's next call finds out)."""
    sock: socket.socket = conn._sock
    try:
        if sock.gettimeout() is None:  # blocking (kernel_timeouts): the flag never waits
            return sock.send(data, socket.MSG_DONTWAIT)
        # Not converted yet (no read or write of the owner's since it connected):
        # non-blocking underneath, and its send() would poll for room for up to the
        # timeout, so write to the descriptor instead.
        return os.write(sock.fileno(), data)
    except OSError:
        return None


def read_replies(conn: Any, n: int, wait: bool = True) -> list[Any]:
    """The next ``n`` replies on redis-py connection ``conn``, raw, an error reply as a
    ``ResponseError`` value; a connection-level error reply (LOADING, NOAUTH) is raised.

    Equivalent to ``conn.read_response(disable_decoding=True)`` per reply, without its
    per-reply layers: the connection's hiredis reader is read directly, and its parser
    refills it from the socket (a timeout, a closed or reset peer raise redis-py's
    ``TimeoutError`` and ``ConnectionError``, as ``read_response`` does). Other
    parsers (no hiredis), connection classes with their own ``read_response``
    (Sentinel's, fakeredis') and a redis-py without the internals (:data:`MISSING`) go
    through ``read_response``.

    ``wait`` False: only the replies already there (up to ``n``). The socket is read
    only while ``select`` says it holds data, so a stalled server costs no wait; this
    needs the direct path (:func:`accepts_direct`).
    """
    parser: Any = None if MISSING else conn._parser
    direct = type(parser) is _HIREDIS_PARSER and type(conn).read_response is _REDIS_READ
    reader = parser._reader if direct else None
    sock: Any = getattr(conn, "_sock", None) if direct else None
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
