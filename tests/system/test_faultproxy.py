"""The fault proxy: RESP framing, pass-through, and each fault seen by plain redis-py clients.

Every fault is judged twice: by what a client through the proxy sees (an error, a stall,
a latency) and by what the server itself holds, read by a direct client that bypasses
the proxy. Clients made here never retry (redis-py retries by default), so an error the
proxy injects is the error the test sees.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from helpers import Made, RealServer, command, text, wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_lookup.tools.embedded import EmbeddedServer
from faultproxy.proxy import FaultProxy
from faultproxy.resp_frames import Frame, FrameParser, RespError

Connect = Callable[..., redis.Redis]


@pytest.fixture
def connect() -> Iterator[Connect]:
    """``connect(url, **kwargs)``: a redis-py client that never retries; closed at the end."""
    with Made() as made:

        def make(url: str, **kwargs: Any) -> redis.Redis:
            options: dict[str, Any] = {
                "socket_timeout": 10,
                "socket_connect_timeout": 5,
                "retry": Retry(NoBackoff(), 0),
            }
            return made.keep(redis.Redis.from_url(url, **{**options, **kwargs}))

        yield make


@pytest.fixture
def direct(real_server: Any, connect: Connect) -> redis.Redis:
    """A client of the session's server that bypasses the proxy: what the server holds."""
    return connect(real_server.url)


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``call`` in a thread; its list gets the result or the exception raised."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # the test judges it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _raw(proxy: FaultProxy, *commands: tuple[str, ...]) -> socket.socket:
    """A bare RESP2 socket through the proxy that has sent ``commands`` in one write."""
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"".join(_encode(*command) for command in commands))
    return sock


def _encode(*args: str) -> bytes:
    parts = [f"*{len(args)}\r\n".encode()]
    parts += [f"${len(arg.encode())}\r\n{arg}\r\n".encode() for arg in args]
    return b"".join(parts)


def _read_available(sock: socket.socket, quiet_s: float = 0.2) -> bytes:
    """Everything the socket has until it stays quiet for ``quiet_s``."""
    sock.settimeout(quiet_s)
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return got
        if not chunk:
            return got
        got += chunk


def _wait_blocked(direct: redis.Redis, name: str, command: str) -> None:
    """Until the server shows the client called ``name`` inside ``command``."""

    def inside() -> bool:
        return any(c.get("name") == name and c.get("cmd") == command for c in direct.client_list())

    wait_until(inside, message=f"{name} blocked in {command}")


# --- RESP framing ------------------------------------------------------------------------

REPLIES = (
    b"+OK\r\n",
    b"-ERR no\r\n",
    b":42\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"$0\r\n\r\n",
    b"$5\r\nhe\r\no\r\n",  # a CRLF inside a blob is payload, not a boundary
    b"*0\r\n",
    b"*2\r\n*1\r\n:1\r\n%1\r\n+k\r\n~2\r\n,1.5\r\n#t\r\n",
    b"%2\r\n+a\r\n(123\r\n+b\r\n_\r\n",
    b"!3\r\nbad\r\n",
    b"=7\r\ntxt:abc\r\n",
    b"|1\r\n+ttl\r\n:3\r\n$1\r\nv\r\n",  # an attribute belongs to the value after it
    b"*2\r\n|1\r\n+a\r\n+b\r\n:1\r\n:2\r\n",
)


def test_frames_are_found_whatever_the_pieces() -> None:
    stream = b"".join(REPLIES)
    for piece in (1, 2, 7, len(stream)):
        parser = FrameParser()
        frames: list[Frame] = []
        for start in range(0, len(stream), piece):
            frames += parser.feed(stream[start : start + piece])
        assert [f.size for f in frames] == [len(r) for r in REPLIES], piece
        assert parser.take(parser.complete) == stream


def test_commands_are_named_and_pushes_told_apart() -> None:
    commands = FrameParser(capture=2)
    frames = commands.feed(_encode("evalsha", "abc", "1", "k") + _encode("PING"))
    assert [(f.name, f.args) for f in frames] == [
        ("EVALSHA", (b"evalsha", b"abc")),
        ("PING", (b"PING",)),
    ]
    replies = FrameParser()
    frames = replies.feed(b">2\r\n$10\r\ninvalidate\r\n*1\r\n$1\r\nk\r\n+OK\r\n")
    assert [f.push for f in frames] == [True, False]


def test_a_partial_frame_stays_until_complete() -> None:
    parser = FrameParser()
    assert parser.feed(b"+OK\r\n$10\r\n01234") == [Frame(5)]
    assert parser.complete == 5
    assert parser.take(5) == b"+OK\r\n"
    with pytest.raises(ValueError):
        parser.take(1)  # only complete frames
    assert parser.feed(b"56789\r\n") == [Frame(17)]


def test_what_is_not_resp_is_refused() -> None:
    with pytest.raises(RespError):
        FrameParser().feed(b"PING\r\n")  # an inline command
    with pytest.raises(RespError):
        FrameParser().feed(b"$?\r\n")  # a streamed string


# --- pass-through ------------------------------------------------------------------------


def test_commands_pass_through_unchanged(
    fault_proxy: FaultProxy, connect: Connect, engine_id: str
) -> None:
    client = connect(fault_proxy.url)
    assert client.set(f"{engine_id}:k", "v", px=60_000)
    assert client.get(f"{engine_id}:k") == b"v"
    pipe = client.pipeline(transaction=False)
    for i in range(1000):
        command(pipe, "ECHO", str(i))
    assert pipe.execute() == [str(i).encode() for i in range(1000)]
    stats = fault_proxy.stats
    assert stats["commands"] == stats["replies"] >= 1002
    assert stats["connections"] == fault_proxy.connections() == 1


def test_a_1mb_value_passes(fault_proxy: FaultProxy, connect: Connect, engine_id: str) -> None:
    client = connect(fault_proxy.url)
    value = bytes(range(256)) * 4096
    client.set(f"{engine_id}:big", value, px=60_000)
    assert client.get(f"{engine_id}:big") == value


def test_a_blocking_read_gets_one_reply(
    fault_proxy: FaultProxy, connect: Connect, engine_id: str
) -> None:
    client = connect(fault_proxy.url)
    assert not client.xread({f"{engine_id}:stream": "$"}, block=100)  # nil after 100 ms
    assert client.ping()  # the next reply pairs with the next command
    stats = fault_proxy.stats
    assert stats["commands"] == stats["replies"]


@pytest.mark.parametrize("protocol", [2, 3])
def test_both_protocols_pass(
    fault_proxy: FaultProxy, connect: Connect, engine_id: str, protocol: int
) -> None:
    client = connect(fault_proxy.url, protocol=protocol)
    client.hset(f"{engine_id}:h", mapping={"a": 1, "b": 2})
    client.expire(f"{engine_id}:h", 60)
    assert client.hgetall(f"{engine_id}:h") == {b"a": b"1", b"b": b"2"}  # a map in RESP3


def test_a_push_is_no_reply(fault_proxy: FaultProxy, direct: redis.Redis, engine_id: str) -> None:
    # RESP3 client tracking sends "invalidate" pushes between replies: were one taken
    # for a reply, the wrong reply would be lost.
    key = f"{engine_id}:tracked"
    direct.set(key, "1", px=60_000)
    sock = _raw(fault_proxy, ("HELLO", "3"), ("CLIENT", "TRACKING", "ON"), ("GET", key))
    wait_until(lambda: fault_proxy.stats["replies"] == 3, message="three replies")
    _read_available(sock, quiet_s=0.05)
    fault_proxy.lose_reply("ECHO", then="hold")
    sock.sendall(_encode("SET", key, "2", "PX", "60000") + _encode("ECHO", "lost"))
    wait_until(lambda: fault_proxy.stats["replies_lost"] == 1, message="ECHO's reply lost")
    got = _read_available(sock)
    assert b"invalidate" in got and b"+OK\r\n" in got
    assert b"lost" not in got
    sock.close()


def test_for_url_keeps_the_database(
    real_server: RealServer, connect: Connect, engine_id: str
) -> None:
    url = real_server.url.rsplit("/", 1)[0] + "/3"
    with FaultProxy.for_url(url).start() as proxy:
        assert proxy.url == f"redis://127.0.0.1:{proxy.port}/3"
        connect(proxy.url).set(f"{engine_id}:db3", "x", px=60_000)
    assert connect(url).get(f"{engine_id}:db3") == b"x"
    assert connect(real_server.url).get(f"{engine_id}:db3") is None


# --- hold --------------------------------------------------------------------------------


def test_hold_stalls_and_release_delivers(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    key = f"{engine_id}:held"
    short = connect(fault_proxy.url, socket_timeout=0.5)
    patient = connect(fault_proxy.url)
    short.ping()
    patient.ping()
    fault_proxy.hold()
    late = connect(fault_proxy.url)  # connected during the hold
    thread, outcome = _in_thread(lambda: patient.set(key, "1", px=60_000))
    late_thread, late_outcome = _in_thread(lambda: late.ping())
    with pytest.raises(redis.TimeoutError):
        short.get(key)
    assert not outcome and not late_outcome  # 0.5 s later still stalled
    assert direct.get(key) is None  # nothing reached the server
    fault_proxy.release()
    thread.join(10)
    late_thread.join(10)
    assert outcome == [True] and late_outcome == [True]
    assert direct.get(key) == b"1"


# --- reset and refuse --------------------------------------------------------------------


def test_reset_breaks_open_connections(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    idle = connect(fault_proxy.url, single_connection_client=True)
    idle.ping()
    blocked = connect(fault_proxy.url, client_name=f"{engine_id}-blocked")
    thread, outcome = _in_thread(lambda: blocked.xread({f"{engine_id}:s": "$"}, block=20_000))
    _wait_blocked(direct, f"{engine_id}-blocked", "xread")
    assert fault_proxy.reset() == 2
    thread.join(10)
    assert isinstance(outcome[0], redis.ConnectionError)
    with pytest.raises(redis.ConnectionError):
        idle.ping()
    assert connect(fault_proxy.url).ping()  # a new connection works
    assert fault_proxy.stats["resets"] == 2


def test_refuse_resets_new_connections_only(fault_proxy: FaultProxy, connect: Connect) -> None:
    before = connect(fault_proxy.url, single_connection_client=True)
    before.ping()
    fault_proxy.refuse()
    with pytest.raises(redis.ConnectionError):
        connect(fault_proxy.url).ping()
    assert before.ping()
    fault_proxy.refuse(False)
    assert connect(fault_proxy.url).ping()
    assert fault_proxy.stats["refused"] == 1


# --- lose_reply --------------------------------------------------------------------------


def test_a_lost_reply_then_reset(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    counter = f"{engine_id}:n"
    client = connect(fault_proxy.url)
    client.ping()
    fault_proxy.lose_reply("incr")
    with pytest.raises(redis.ConnectionError):
        command(client, "INCR", counter)  # redis-py's incr() sends INCRBY
    assert direct.get(counter) == b"1"  # the server ran it
    assert command(client, "INCR", counter) == 2  # once only: the rule is used up
    assert fault_proxy.stats["replies_lost"] == 1
    assert fault_proxy.stats["resets"] == 1
    direct.delete(counter)


def test_a_lost_reply_then_hold(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    counter = f"{engine_id}:n"
    client = connect(fault_proxy.url, socket_timeout=0.5)
    client.ping()
    fault_proxy.lose_reply("INCR", then="hold")
    with pytest.raises(redis.TimeoutError):
        command(client, "INCR", counter)
    assert direct.get(counter) == b"1"
    wait_until(lambda: fault_proxy.connections() == 0, message="the timed-out client gone")
    direct.delete(counter)


def test_a_lost_reply_in_a_pipeline(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    a, n, b = (f"{engine_id}:{name}" for name in "anb")
    pipe = connect(fault_proxy.url).pipeline(transaction=False)
    pipe.set(a, "1", px=60_000)
    command(pipe, "INCR", n)
    pipe.set(b, "1", px=60_000)
    fault_proxy.lose_reply("INCR")
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    # The server ran all three; SET b came in the same write, before the reset.
    wait_until(lambda: direct.exists(b), message="SET b ran")
    assert direct.mget(a, n) == [b"1", b"1"]
    direct.delete(n)


def test_replies_before_the_lost_one_are_delivered(
    fault_proxy: FaultProxy, direct: redis.Redis, engine_id: str
) -> None:
    a, n, b = (f"{engine_id}:{name}" for name in "anb")
    fault_proxy.lose_reply("INCR", then="hold")
    sock = _raw(fault_proxy, ("SET", a, "1", "PX", "60000"), ("INCR", n), ("SET", b, "2"))
    wait_until(lambda: fault_proxy.stats["replies_lost"] == 1, message="INCR's reply lost")
    assert _read_available(sock) == b"+OK\r\n"  # SET a's reply; neither INCR's nor SET b's
    wait_until(lambda: direct.exists(b), message="SET b ran")
    sock.close()
    direct.delete(n, b)


def test_a_lost_reply_in_a_transaction_is_exec_s(
    fault_proxy: FaultProxy, direct: redis.Redis, engine_id: str
) -> None:
    counter = f"{engine_id}:n"
    fault_proxy.lose_reply("INCR", then="hold")
    sock = _raw(fault_proxy, ("MULTI",), ("INCR", counter), ("EXEC",))
    wait_until(lambda: fault_proxy.stats["replies_lost"] == 1, message="a reply lost")
    assert _read_available(sock) == b"+OK\r\n+QUEUED\r\n"  # EXEC's reply holds INCR's result
    assert direct.get(counter) == b"1"
    sock.close()
    direct.delete(counter)


def test_a_lost_delivery(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    stream, group = f"{engine_id}:requests", "rank-0"
    direct.xgroup_create(stream, group, id="0", mkstream=True)
    entry = direct.xadd(stream, {"id": "r1"})
    worker = connect(fault_proxy.url, socket_timeout=0.5)
    worker.ping()
    fault_proxy.lose_reply("XREADGROUP", then="hold")
    with pytest.raises(redis.TimeoutError):
        worker.xreadgroup(group, "w0", {stream: ">"}, count=1, block=100)
    pending = direct.xpending_range(stream, group, min="-", max="+", count=10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry, b"w0")]
    assert not connect(fault_proxy.url).xreadgroup(group, "w1", {stream: ">"}, count=1)
    direct.delete(stream)


def test_a_lost_script_reply_by_sha(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    counter = f"{engine_id}:n"
    bump = direct.register_script("return redis.call('INCR', KEYS[1])")
    other = direct.register_script("return redis.call('GET', KEYS[1])")
    direct.script_load(bump.script)  # else EVALSHA's NOSCRIPT would be the lost reply
    client = connect(fault_proxy.url)
    assert other(keys=[counter], client=client) is None  # loads it, through the proxy
    fault_proxy.lose_reply(f"EVALSHA:{bump.sha[:8]}", times=2)
    assert other(keys=[counter], client=client) is None  # another sha: delivered
    with pytest.raises(redis.ConnectionError):
        bump(keys=[counter], client=client)
    with pytest.raises(redis.ConnectionError):  # called by body, it is the same script
        client.eval(text(bump.script), 1, counter)
    assert direct.get(counter) == b"2"
    assert bump(keys=[counter], client=client) == 3
    direct.delete(counter)


# --- delay, clear, stop ------------------------------------------------------------------


def test_delay_adds_latency(fault_proxy: FaultProxy, connect: Connect) -> None:
    client = connect(fault_proxy.url)
    client.ping()
    fault_proxy.delay(200)
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started >= 0.2  # a lower bound only: the machine is loaded
    fault_proxy.delay(0)
    assert client.ping()


def test_clear_ends_every_fault(
    fault_proxy: FaultProxy, connect: Connect, direct: redis.Redis, engine_id: str
) -> None:
    counter = f"{engine_id}:n"
    fault_proxy.lose_reply("INCR", then="hold")
    hung = _raw(fault_proxy, ("INCR", counter))
    wait_until(lambda: fault_proxy.stats["replies_lost"] == 1, message="the reply lost")
    fault_proxy.lose_reply("INCR")
    fault_proxy.hold()
    fault_proxy.refuse()
    fault_proxy.delay(10_000)
    fault_proxy.clear()
    with pytest.raises(ConnectionResetError):
        hung.recv(1)  # the hung connection is reset
    client = connect(fault_proxy.url)
    assert command(client, "INCR", counter) == 2  # no hold, refusal, delay or loss
    assert fault_proxy.stats["replies_lost"] == 1
    hung.close()
    direct.delete(counter)


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]


def test_stop_closes_everything(real_server: RealServer, connect: Connect, engine_id: str) -> None:
    proxy = FaultProxy.for_url(real_server.url).start()
    idle = connect(proxy.url, single_connection_client=True)
    idle.ping()
    blocked = connect(proxy.url)
    thread, outcome = _in_thread(lambda: blocked.xread({f"{engine_id}:s": "$"}, block=20_000))
    wait_until(lambda: proxy.connections() == 2, message="two connections")
    proxy.hold()  # stop() does not wait for a fault to end
    proxy.stop()
    proxy.stop()  # idempotent
    assert not [t for t in _proxy_threads() if t.name == f"faultproxy-{proxy.port}"]
    assert proxy.connections() == 0
    thread.join(10)
    assert isinstance(outcome[0], redis.ConnectionError)
    with pytest.raises(redis.ConnectionError):
        idle.ping()
    with pytest.raises(redis.ConnectionError):
        connect(proxy.url).ping()  # nobody listens
    assert proxy.reset() == 0
    proxy.start()  # a restart listens on the same port again
    proxy.release()
    assert connect(proxy.url).ping()
    proxy.stop()


def test_a_server_down_behind_the_proxy(
    fresh_fault_proxy: FaultProxy, fresh_real_server: EmbeddedServer, connect: Connect
) -> None:
    # One connection, not a pool: a pool would swap the closed one for a new one.
    client = connect(fresh_fault_proxy.url, single_connection_client=True)
    assert client.ping()
    fresh_real_server.stop()
    with pytest.raises(redis.ConnectionError):
        client.ping()  # the server's FIN reaches the client
    with pytest.raises(redis.ConnectionError):
        connect(fresh_fault_proxy.url).ping()  # no upstream: the client is reset
    assert fresh_fault_proxy.stats["upstream_failures"] == 1
    fresh_real_server.start()
    assert connect(fresh_fault_proxy.url).ping()
