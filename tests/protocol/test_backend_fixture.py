"""The ``backend`` fixture gives both legs a working Lua + streams server."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from helpers import Backend, RealServer

from broker_lookup.tools.embedded import EmbeddedServer

# The shape of every script in broker_lookup/scripts: streams, hashes and TTLs, all keys in KEYS.
SCRIPT = """
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', 100, '*', 'a', '1')
local added = redis.call('HSET', KEYS[2], 'state', 'pending', 'r0', ARGV[1])
local ttl_set = redis.call('PEXPIRE', KEYS[2], ARGV[2])
return {id, added, ttl_set, redis.call('HGETALL', KEYS[2]), redis.call('XLEN', KEYS[1])}
"""


def test_lua_streams_hashes_and_ttls(backend: Backend, engine_id: str) -> None:
    client = backend.factory()
    stream, lookup = f"bl:{{{engine_id}}}:requests", f"bl:{{{engine_id}}}:lookup:x"

    entry_id, added, ttl_set, fields, length = client.register_script(SCRIPT)(
        keys=[stream, lookup], args=["7", "60000"]
    )

    assert entry_id.count(b"-") == 1
    assert (added, ttl_set, length) == (2, 1, 1)
    assert fields == [b"state", b"pending", b"r0", b"7"]
    assert 0 < client.pttl(lookup) <= 60000
    assert client.xrange(stream) == [(entry_id, {b"a": b"1"})]


def test_factory_makes_new_clients_on_one_server(backend: Backend, engine_id: str) -> None:
    first, second = backend.factory(), backend.factory(decode_responses=True)

    first.set(f"{engine_id}:k", "v")

    assert first is not second
    assert second.get(f"{engine_id}:k") == "v"
    assert (backend.url is None) == (backend.kind == "fake")
    assert (backend.fake_server is None) == (backend.kind == "real")


def test_blocking_read_sees_an_entry_added_from_another_client(
    backend: Backend, engine_id: str
) -> None:
    stream = f"bl:{{{engine_id}}}:done"
    got: list[Any] = []
    reader = threading.Thread(
        target=lambda: got.extend(backend.factory().xread({stream: "0-0"}, block=3000) or []),
    )
    reader.start()
    backend.factory().xadd(stream, {"n": "1"})
    reader.join(timeout=5)

    assert [name for name, _entries in got] == [stream.encode()]


@pytest.mark.fake
@pytest.mark.parametrize("backend", ["fake"], indirect=True)
def test_fake_connection_loss_is_a_connection_error(backend: Backend, engine_id: str) -> None:
    client = backend.factory()
    client.set(engine_id, "1")
    assert backend.fake_server is not None
    backend.fake.connected = False

    with pytest.raises(redis.ConnectionError):
        client.get(engine_id)

    backend.fake.connected = True
    assert client.get(engine_id) == b"1"


def test_fresh_real_server_is_private_and_restartable(
    fresh_real_server: EmbeddedServer, real_server: RealServer
) -> None:
    assert fresh_real_server.url != real_server.url
    client = redis.Redis.from_url(fresh_real_server.url)
    client.set("k", "v")

    fresh_real_server.restart()

    assert client.get("k") is None  # same URL, new process: the client reconnects
