"""The lean link the rank's loop runs on: raw replies, a read sent with a write and taken
later, settling it to send meanwhile, errors that drop the connection; on fakeredis and
on a real server, plus the ClientLink fallback over redis-py's pipeline."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from helpers import Backend, wait_until

from broker_lookup.protocol.commands import Command
from broker_lookup.transport import redis_internals
from broker_lookup.transport.link import ClientLink, LeanLink, open_link, pairs


def _key() -> str:
    return "lean-" + uuid.uuid4().hex[:8]


def _read(stream: str, block_ms: int = 100) -> Command:
    return ("XREADGROUP", "GROUP", "g", "c", "COUNT", 10, "BLOCK", block_ms, "STREAMS", stream, ">")


def _entry_fields(reply: Any) -> list[dict[Any, Any]]:
    """Each entry's fields of an XREADGROUP reply (RESP3 map or RESP2 list)."""
    streams = reply.values() if isinstance(reply, dict) else [s[1] for s in reply]
    return [pairs(fields) for entries in streams for _, fields in entries]


def test_a_read_rides_with_a_write_and_is_taken_later(backend: Backend) -> None:
    stream = _key()
    link = open_link(backend.factory())
    assert isinstance(link, LeanLink)
    try:
        created, busy = link.call(
            [("XGROUP", "CREATE", stream, "g", "$", "MKSTREAM")] * 2
        )  # errors come back as values, in order
        assert created == b"OK" and isinstance(busy, redis.ResponseError)
        assert link.call([("XADD", stream, "*", "f", "v")], _read(stream))[0]
        assert link.reading
        with pytest.raises(RuntimeError):
            link.call([], _read(stream))  # one read at a time
        assert _entry_fields(link.take_read()) == [{b"f": b"v"}]
        assert not link.reading
        link.call([], _read(stream, block_ms=50))
        assert link.take_read() is None  # BLOCK ran out: nothing new
    finally:
        link.close()


def test_settling_a_read_frees_the_connection_for_other_commands(backend: Backend) -> None:
    stream = _key()
    conn = backend.factory()
    conn.xgroup_create(stream, "g", id="$", mkstream=True)
    conn.xadd(stream, {"f": "1"})
    link = open_link(backend.factory())
    try:
        link.call([], _read(stream))
        link.settle_read()
        assert link.reading
        assert link.call([("PING",)]) == [b"PONG"]
        assert _entry_fields(link.take_read()) == [{b"f": b"1"}]
    finally:
        link.close()


def test_without_redis_pys_internals_the_link_takes_redis_pys_own_path(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redis-py that lacks what redis_internals reads: the same replies, through
    ``send_packed_command`` and ``read_response``; no write from another thread."""
    monkeypatch.setattr(redis_internals, "MISSING", "Connection._sock")
    through_redis_py: list[int] = []
    read_responses = redis_internals._read_responses

    def counting(conn: Any, n: int) -> list[Any]:
        through_redis_py.append(n)
        return read_responses(conn, n)

    monkeypatch.setattr(redis_internals, "_read_responses", counting)
    stream = _key()
    link = open_link(backend.factory())
    assert isinstance(link, LeanLink)
    try:
        created, busy = link.call([("XGROUP", "CREATE", stream, "g", "$", "MKSTREAM")] * 2)
        assert created == b"OK" and isinstance(busy, redis.ResponseError)
        assert link.call([("XADD", stream, "*", "f", "v")], _read(stream))[0]
        assert _entry_fields(link.take_read()) == [{b"f": b"v"}]
        assert not link.accepts_direct and link.send_nowait([("PING",)]) is None
        assert through_redis_py == [2, 1, 1]
    finally:
        link.close()


def test_an_error_reply_to_the_read_is_raised_and_the_link_stays_usable(
    backend: Backend,
) -> None:
    link = open_link(backend.factory())
    try:
        link.call([], _read(_key()))  # no such group
        with pytest.raises(redis.ResponseError):  # NOGROUP (fakeredis words it otherwise)
            link.take_read()
        assert link.call([("PING",)]) == [b"PONG"]
    finally:
        link.close()


def test_a_lost_connection_drops_the_read_and_reconnects(backend: Backend) -> None:
    if backend.kind != "fake":
        pytest.skip("the fake server can refuse one connection; see test_rank_network")
    link = open_link(backend.factory())
    try:
        assert link.call([("PING",)]) == [b"PONG"]
        backend.fake.connected = False
        with pytest.raises(redis.ConnectionError):
            link.call([("PING",)], _read(_key()))
        assert not link.reading  # the read's reply can never be taken for a later one
        backend.fake.connected = True
        assert link.call([("PING",)]) == [b"PONG"]
    finally:
        link.close()


def test_client_link_keeps_the_interface_over_the_pipeline(backend: Backend) -> None:
    stream = _key()
    conn = backend.factory()
    conn.xgroup_create(stream, "g", id="$", mkstream=True)
    link = ClientLink(conn)
    assert link.call([("XADD", stream, "*", "f", "v")], _read(stream))[0]
    assert link.call([("PING",)])[0] in (True, b"PONG", "PONG")  # a read may wait meanwhile
    assert _entry_fields(link.take_read()) == [{b"f": b"v"}]
    link.close()


def test_close_gives_the_connection_back_closed(backend: Backend) -> None:
    if backend.kind != "real":
        pytest.skip("CLIENT LIST of the real server")
    name = "lean-" + uuid.uuid4().hex[:8]
    admin = backend.factory()
    link = open_link(backend.factory(client_name=name))
    link.call([], _read(_key(), block_ms=1000))  # left unread: close must drop it
    assert [c for c in admin.client_list() if c.get("name") == name]
    link.close()
    # The server drops a closed client on its next event-loop turn, not at the FIN.
    wait_until(
        lambda: not [c for c in admin.client_list() if c.get("name") == name],
        message="the closed connection left the server's CLIENT LIST",
    )
