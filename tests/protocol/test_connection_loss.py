"""The connection drops in the middle of a report, a cancel or a blocking read.

fakeredis's ``connected = False`` fails every command of every client at once; on the
real server the worker's connections are killed (``CLIENT KILL``) or stalled past the
socket timeout (``CLIENT PAUSE``). Every write is one Lua script, so a failed one
applied nothing; retries are bounded by ``redis_retries``; errors are counted; work
resumes once the server is back.
"""

from __future__ import annotations

import pytest
from faultkit import MakeClient, Serve, alive, answer, config, prompt, ready
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(0, chunks=10)
FULL = len(TOKENS)
fake_only = pytest.mark.parametrize("backend", ["fake"], indirect=True)
real_only = pytest.mark.parametrize("backend", ["real"], indirect=True)


def _breaker_closed(client: RedisAsyncLookupClient) -> None:
    """Until the client's loops answered again: meanwhile lookups answer 0 by design."""
    wait_until(lambda: not client.stats().breaker_open, timeout=10, message="breaker closed")


def _answered_again(
    client: RedisAsyncLookupClient, engine: StubEngine, lookup_id: str, hits: int
) -> int:
    """Once the breaker closed, the answer to a new lookup the engine reports ``hits`` for."""
    _breaker_closed(client)
    client.lookup(TOKENS, lookup_id)
    _started(engine, lookup_id)
    engine.report(lookup_id, hits)
    return answer(client, lookup_id, timeout=10)


def _started(engine: StubEngine, lookup_id: str) -> None:
    wait_until(lambda: lookup_id in engine.started_ids(), message=f"{lookup_id} started")


@fake_only
def test_connection_lost_during_a_report(serve: Serve, backend: Backend, engine_id: str) -> None:
    engine, server, client = serve(StubEngine(), lookup_timeout_ms=800)
    client.lookup(TOKENS, "r1")
    _started(engine, "r1")
    backend.fake.connected = False
    engine.report("r1", 24)
    retries = server.config.redis_retries
    wait_until(lambda: server.stats().counts.get("report_error") == 1, timeout=10)
    assert server.stats().reporter_errors == retries  # bounded: one batch, N attempts
    assert engine.released == ["r1"]  # an unsent report releases its pins
    assert answer(client, "r1", timeout=5) == 0  # its timeout fires without Redis
    backend.fake.connected = True
    key = KeySpace(engine_id).lookup("r1")
    fields = backend.factory().hgetall(key)
    assert b"r0" not in fields  # nothing half-applied
    assert server.stats().reporter_errors == retries
    assert _answered_again(client, engine, "r2", 24) == 24
    assert server.stats().alive


@fake_only
def test_connection_lost_during_a_cancel(serve: Serve, backend: Backend, engine_id: str) -> None:
    engine, _, client = serve(StubEngine(), lookup_timeout_ms=5000)
    client.lookup(TOKENS, "r1")
    _started(engine, "r1")
    ks = KeySpace(engine_id)
    conn = backend.factory()
    before = (conn.hgetall(ks.lookup("r1")), conn.xlen(ks.requests))
    backend.fake.connected = False
    client.cancel_lookup("r1")
    retries = client.config.redis_retries
    wait_until(lambda: client._sender.errors == retries, timeout=10, message="cancel given up")
    assert client.lookup_cache("r1") == -1  # the caller's view is settled at once
    backend.fake.connected = True
    # The cancel script never ran: the hash and the stream are exactly as they were.
    assert (conn.hgetall(ks.lookup("r1")), conn.xlen(ks.requests)) == before
    assert conn.pttl(ks.lookup("r1")) > 0  # and the hash still expires by itself
    assert client._sender.errors == retries  # no retry after giving up
    assert client.stats().redis_errors >= retries
    engine.report("r1", 40)  # the undelivered cancel: the rank finishes normally
    assert _answered_again(client, engine, "r2", 12) == 12


@fake_only
def test_connection_lost_during_blocking_reads(serve: Serve, backend: Backend) -> None:
    engine, server, client = serve(StubEngine())
    backend.fake.connected = False
    wait_until(lambda: server.stats().consumer.redis_errors >= 2, timeout=10)
    wait_until(lambda: client._listener.errors >= 2, timeout=10)
    backend.fake.connected = True
    wait_until(lambda: server.ready, timeout=10)
    alive(client, timeout=10)
    assert _answered_again(client, engine, "r1", 8) == 8
    assert server.stats().alive


@real_only
def test_connections_killed_mid_read(serve: Serve, backend: Backend) -> None:
    engine, server, client = serve(StubEngine())
    admin = backend.factory()
    # Every other connection drops: the rank's blocked XREADGROUP, the client's XREAD, ...
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 2
    wait_until(lambda: server.stats().consumer.redis_errors >= 1, timeout=10)
    assert _answered_again(client, engine, "r1", 16) == 16
    assert server.stats().alive


@real_only
def test_blocking_read_times_out_then_recovers(
    make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    engine = StubEngine()
    # Connected by URL, so the config's socket timeout applies; the stall below outlasts
    # it and redis-py's own retries: the rank's XREADGROUP fails with TimeoutError.
    cfg = config(backend.url, socket_timeout_ms=1050, block_ms=50)
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    with RedisAsyncLookupServer(engine, meta, cfg) as server:
        ready(server)
        client = make_client()
        alive(client)
        backend.factory().execute_command(  # type: ignore[no-untyped-call]
            "CLIENT", "PAUSE", 4500, "WRITE"
        )
        wait_until(lambda: server.stats().consumer.redis_errors >= 1, timeout=10)
        wait_until(lambda: server.ready, timeout=10)
        alive(client, timeout=10)
        assert _answered_again(client, engine, "r1", 4) == 4
        assert server.stats().alive
