"""The native floor's C turn (``benchmarks/bench/_native_floor.c``) over a socket pair.

The other end plays the server: it has the XREADGROUP's reply (and the replies to what
the turn will write) waiting, so each turn runs without a server and the exact bytes it
writes can be checked. The end-to-end run on a real server is ``test_bench``'s floor test.
Without the extension built these skip, except under ``CI``, which must build it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import hiredis
import pytest
from helpers import optional_extension

#: hiredis' packer (its stub types the argument as a 1-tuple; it takes any).
_pack: Any = hiredis.pack_command
ACK_HEAD = (b"XACK", b"s", b"g")
READ = _pack((b"XREADGROUP", b"GROUP", b"g", b"c", b"BLOCK", 5, b"STREAMS", b"s", b">"))


@pytest.fixture
def native() -> ModuleType:
    return optional_extension(
        "benchmarks.bench._native_floor", build="python -m benchmarks.build_native"
    )


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, server = socket.socketpair()
    try:
        yield ours, server
    finally:
        ours.close()
        server.close()


def _reply(entries: list[tuple[bytes, list[bytes] | None]]) -> bytes:
    """An XREADGROUP reply in RESP2: one stream, these entries (None: fields trimmed)."""
    out = b"*1\r\n*2\r\n$1\r\ns\r\n" + b"*%d\r\n" % len(entries)
    for entry_id, fields in entries:
        out += b"*2\r\n$%d\r\n%s\r\n" % (len(entry_id), entry_id)
        if fields is None:
            out += b"*-1\r\n"
            continue
        out += b"*%d\r\n" % len(fields)
        out += b"".join(b"$%d\r\n%s\r\n" % (len(f), f) for f in fields)
    return out


def _written(server: socket.socket) -> bytes:
    server.setblocking(False)
    try:
        return server.recv(1 << 20)
    except BlockingIOError:
        return b""
    finally:
        server.setblocking(True)


def test_a_turn_acks_every_entry_writes_each_answer_then_the_read(
    native: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    entries = [
        (b"1-0", [b"type", b"lookup", b"m", b"AAA"]),
        (b"2-0", [b"m", b"BB"]),  # its answer is None: acked, nothing written for it
        (b"3-0", None),  # trimmed while pending: acked, never handed over
        (b"4-0", [b"type", b"lookup"]),  # no m: the same
    ]
    # The reply to the XACK and to the one answer, and the next read's (left pending).
    server.sendall(_reply(entries) + b":4\r\n$8\r\nrecorded\r\n" + b"*-1\r\n")
    seen: list[tuple[bytes, bytes]] = []

    def answer(entry_id: bytes, m: bytes) -> tuple[bytes | str | int, ...] | None:
        seen.append((entry_id, m))
        return ("EVALSHA", b"sha", 2, "k\u00e9y", -7) if m == b"AAA" else None

    pending = bytearray()
    assert native.turn(ours.fileno(), 1000, pending, READ, ACK_HEAD, answer) == 4
    assert seen == [(b"1-0", b"AAA"), (b"2-0", b"BB")]
    expected = _pack((*ACK_HEAD, b"1-0", b"2-0", b"3-0", b"4-0"))
    expected += _pack(("EVALSHA", b"sha", 2, "k\u00e9y", -7)) + READ
    assert _written(server) == expected
    assert bytes(pending) == b"*-1\r\n"  # the next turn's reply, kept for it
    # That next turn: a nil reply (the BLOCK ran out) writes the read alone.
    assert native.turn(ours.fileno(), 1000, pending, READ, ACK_HEAD, answer) == 0
    assert _written(server) == READ
    assert pending == bytearray()


def test_a_reply_split_across_reads_is_put_together(
    native: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    whole = _reply([(b"9-1", [b"m", b"x" * 200_000])]) + b":1\r\n"
    pending = bytearray(whole[:7])  # a turn may start on a reply's first bytes
    server.sendall(whole[7:])
    sizes: list[int] = []
    assert (
        native.turn(ours.fileno(), 1000, pending, READ, ACK_HEAD, lambda i, m: sizes.append(len(m)))
        == 1
    )
    assert sizes == [200_000]
    assert _written(server) == _pack((*ACK_HEAD, b"9-1")) + READ


@pytest.mark.parametrize(
    ("server_does", "raised"),
    [
        ("nothing", TimeoutError),
        ("closes", ConnectionError),
        ("junk", ValueError),
    ],
)
def test_a_silent_closed_or_garbled_server_raises(
    native: ModuleType,
    pair: tuple[socket.socket, socket.socket],
    server_does: str,
    raised: type[Exception],
) -> None:
    ours, server = pair
    if server_does == "closes":
        server.close()
    elif server_does == "junk":
        server.sendall(b"?what\r\n")
    with pytest.raises(raised):
        native.turn(ours.fileno(), 50, bytearray(), READ, ACK_HEAD, lambda i, m: None)


def test_an_answer_that_raises_or_returns_a_wrong_type_propagates(
    native: ModuleType, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, server = pair
    reply = _reply([(b"1-0", [b"m", b"A"])])
    server.sendall(reply)

    def boom(entry_id: bytes, m: bytes) -> None:
        raise KeyError("engine")

    with pytest.raises(KeyError, match="engine"):
        native.turn(ours.fileno(), 1000, bytearray(), READ, ACK_HEAD, boom)
    server.sendall(reply)
    with pytest.raises(TypeError, match="tuple or None"):
        native.turn(ours.fileno(), 1000, bytearray(), READ, ACK_HEAD, lambda i, m: ["EVALSHA"])
    server.sendall(reply)
    with pytest.raises(TypeError, match="bytes, str or int"):
        native.turn(ours.fileno(), 1000, bytearray(), READ, ACK_HEAD, lambda i, m: (1.5,))
    assert _written(server) == b""  # nothing half-packed went out
