"""The lean link's reply path under real TCP faults (through the fault proxy).

``read_replies`` reads the connection's hiredis reader directly, below redis-py's
``read_response``: these check it still raises what ``read_response`` would (redis-py's
``ConnectionError``, which the loops translate to ``BrokerUnavailable``), never a bare
``OSError`` that a loop would take for a bug.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from helpers import wait_until

from broker_lookup.transport.link import LeanLink, open_link
from faultproxy.proxy import FaultProxy


def _through(proxy: FaultProxy, socket_timeout: float) -> Iterator[LeanLink]:
    """A lean link through ``proxy``, closed with its client after the test."""
    client = redis.Redis.from_url(proxy.url, socket_timeout=socket_timeout)
    lean = open_link(client)
    assert isinstance(lean, LeanLink)
    yield lean
    lean.close()
    client.close()


@pytest.fixture
def link(fault_proxy: FaultProxy) -> Iterator[LeanLink]:
    """A lean link through the fault proxy."""
    yield from _through(fault_proxy, 5)


def test_a_reset_while_a_read_waits_raises_redis_connection_error(
    link: LeanLink, fault_proxy: FaultProxy
) -> None:
    assert link.call([("PING",)]) == [b"PONG"]
    link.call([], ("XREAD", "BLOCK", 4000, "STREAMS", "lean-reset", "$"))
    threading.Timer(0.3, fault_proxy.reset).start()
    with pytest.raises(redis.ConnectionError) as caught:
        link.take_read()
    assert not isinstance(caught.value, OSError)
    assert not link.reading
    assert link.call([("PING",)]) == [b"PONG"]  # reconnected on the next call


def test_a_reply_lost_after_the_server_ran_the_command_raises_and_reconnects(
    link: LeanLink, fault_proxy: FaultProxy
) -> None:
    try:
        link.call([("DEL", "lean-lost")])
        fault_proxy.lose_reply("INCR", then="reset")
        with pytest.raises(redis.ConnectionError):
            link.call([("INCR", "lean-lost")])
        # The server ran it: the caller must treat a lost reply as "maybe applied".
        assert link.call([("GET", "lean-lost")]) == [b"1"]
    finally:
        link.call([("DEL", "lean-lost")])


def test_error_replies_come_back_as_values_in_order(link: LeanLink) -> None:
    replies = link.call([("PING",), ("NO-SUCH-COMMAND",), ("ECHO", "x")])
    assert replies[0] == b"PONG" and replies[2] == b"x"
    assert isinstance(replies[1], redis.ResponseError)


# -- writes from another thread, replies read later (the client's own submits) --------


def test_writes_that_never_wait_keep_their_replies_in_wire_order(link: LeanLink) -> None:
    try:
        assert link.send_nowait([("PING",)]) is None  # not connected yet: nothing written
        assert not link.accepts_direct
        link.call([("DEL", "lean-direct")])
        assert link.accepts_direct
        assert link.send_nowait([("INCR", "lean-direct")]) is True
        assert link.send_nowait([("NO-SUCH-COMMAND",), ("INCR", "lean-direct")]) is True
        got = link.replies(3)
        assert got[0] == 1 and isinstance(got[1], redis.ResponseError) and got[2] == 2
        assert link.call([("GET", "lean-direct")]) == [b"2"]  # in step after them
    finally:
        link.call([("DEL", "lean-direct")])


def test_replies_without_waiting_never_wait_for_a_held_server(
    link: LeanLink, fault_proxy: FaultProxy
) -> None:
    link.call([("PING",)])
    fault_proxy.hold()
    assert link.send_nowait([("ECHO", "held")]) is True
    assert link.replies(1, wait=False) == []  # no reply, and no wait for it
    fault_proxy.release()
    got: list[object] = []

    def delivered() -> bool:
        got.extend(link.replies(1 - len(got), wait=False))
        return bool(got)

    wait_until(delivered, message="the held reply arrives")
    assert got == [b"held"]


def test_a_reset_under_unread_replies_raises_and_drops(
    link: LeanLink, fault_proxy: FaultProxy
) -> None:
    link.call([("PING",)])
    fault_proxy.lose_reply("ECHO", then="reset")
    assert link.send_nowait([("ECHO", "lost")]) is True
    with pytest.raises(redis.ConnectionError):
        wait_until(lambda: link.replies(1, wait=False))
    assert not link.accepts_direct  # dropped: nothing is written on it any more
    assert link.call([("PING",)]) == [b"PONG"]


def test_only_plain_sockets_take_writes_from_another_thread() -> None:
    client = fakeredis.FakeRedis()
    link = open_link(client)
    assert isinstance(link, LeanLink)
    link.call([("PING",)])
    assert not link.accepts_direct and link.send_nowait([("PING",)]) is None


# -- the socket's timeout, kept by the kernel ---------------------------------------------


@pytest.fixture
def short_link(fault_proxy: FaultProxy) -> Iterator[LeanLink]:
    """A lean link through the fault proxy whose socket times out after 0.5 s."""
    yield from _through(fault_proxy, 0.5)


def _socket_of(link: LeanLink) -> socket.socket:
    sock: socket.socket = link._conn._sock
    return sock


def test_a_held_server_times_out_a_read_on_the_kernels_timeout(
    short_link: LeanLink, fault_proxy: FaultProxy
) -> None:
    assert short_link.call([("PING",)]) == [b"PONG"]
    sock = _socket_of(short_link)
    # Blocking, with redis-py's 0.5 s as the kernel's: one system call a read, no poll.
    assert sock.gettimeout() is None
    seconds, micros = struct.unpack(
        "@ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)
    )
    assert 500_000 <= seconds * 1_000_000 + micros < 510_000  # kept in clock ticks
    fault_proxy.hold()
    with pytest.raises(redis.TimeoutError, match="reading"):
        short_link.call([("PING",)])
    fault_proxy.release()
    assert short_link.call([("PING",)]) == [b"PONG"]  # a new connection, converted too
    assert _socket_of(short_link) is not sock and _socket_of(short_link).gettimeout() is None


def test_a_held_server_times_out_a_write_that_fills_the_buffers(
    short_link: LeanLink, fault_proxy: FaultProxy
) -> None:
    short_link.call([("PING",)])
    fault_proxy.hold()  # the proxy stops reading: the socket buffers fill, then the write waits
    with pytest.raises(redis.TimeoutError, match="writing"):
        short_link.call([("SET", "lean-big", b"x" * (64 << 20))])
    fault_proxy.release()
    assert short_link.call([("EXISTS", "lean-big")]) == [0]  # the torn write never ran
