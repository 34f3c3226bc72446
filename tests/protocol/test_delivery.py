"""Stream delivery faults: groups that exist, entries trimmed while pending, redelivery,
a lost script cache, and shutdown while idle; on fakeredis and on a real server."""

from __future__ import annotations

import time

import pytest
from faultkit import MakeClient, MakeServer, Serve, alive, answer, config, prompt, ready
from helpers import (
    Backend,
    epoch_ms,
    lookup_request,
    request_entry,
    stream_entries,
    stream_fields,
    wait_until,
)

from broker_lookup.errors import BrokerResponseError, ConfigError
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import request_fields
from broker_lookup.protocol.scripts import REPORT, SUBMIT, Call, submit_args
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.connection import ensure_group
from broker_lookup.transport.link import ClientLink
from broker_lookup.transport.script_runner import ScriptSet

TOKENS = prompt(0, chunks=10)


def test_busygroup_on_restart_and_other_errors_surface(
    make_server: MakeServer, backend: Backend, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    first = make_server(StubEngine())
    ready(first)
    first.close()
    again = make_server(StubEngine())  # the group exists: BUSYGROUP is fine
    ready(again)
    assert again.stats().consumer.redis_errors == 0
    conn = backend.factory()
    assert ensure_group(conn, ks.requests, ks.group(0)) is False
    conn.set(ks.dead, "not a stream")
    with pytest.raises(BrokerResponseError, match="WRONGTYPE"):
        ensure_group(conn, ks.dead, ks.group(0))


def test_entries_trimmed_while_pending_are_acked_and_counted_not_dead_lettered(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    """A rank restarted after a crash finds its pending entries trimmed (the submits trim
    entries older than a lookup hash lives): expired lookups, not bad input, so they are
    acked and counted, and nothing reaches the dead-letter stream or its alert."""
    ks = KeySpace(engine_id)
    conn = backend.factory()
    conn.xgroup_create(ks.requests, ks.group(0), id="$", mkstream=True)
    deadline = epoch_ms() + 60_000
    for i in range(3):
        conn.xadd(ks.requests, request_entry(lookup_request(f"gone-{i}", deadline_ms=deadline)))
    # A rank read them and crashed before acking; then the stream was trimmed under them.
    conn.xreadgroup(ks.group(0), ks.consumer(0), {ks.requests: ">"})
    conn.xtrim(ks.requests, maxlen=0)
    engine = StubEngine()
    server = make_server(engine)
    ready(server)
    wait_until(lambda: server.stats().consumer.trimmed == 3)
    # Counted before the batch's XACK goes out: wait for the ack itself.
    wait_until(lambda: conn.xpending(ks.requests, ks.group(0))["pending"] == 0)
    assert server.stats().consumer.dead_letters == 0
    assert not conn.exists(ks.dead)
    assert engine.started_ids() == []
    client = make_client()
    alive(client)
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", 8)
    assert answer(client, "r1", timeout=10) == 8
    assert server.stats().alive


def test_duplicate_delivery_does_not_prefetch_twice(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    engine, server, client = serve(StubEngine())
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    conn = backend.factory()
    [(_, fields)] = stream_entries(conn.xrange(ks.requests))
    # A retried XADD: the same lookup and generation again.
    conn.xadd(ks.requests, stream_fields(fields))
    wait_until(lambda: server.stats().counts.get("duplicate") == 1)
    assert engine.started_ids() == ["r1"]
    engine.report("r1", 20)
    assert answer(client, "r1", timeout=10) == 20
    conn.xadd(ks.requests, stream_fields(fields))  # and once more after it completed
    wait_until(lambda: server.stats().counts.get("duplicate") == 2)
    assert engine.started_ids() == ["r1"]
    assert client.lookup_cache("r1") == 20


def test_script_cache_flushed_mid_traffic(serve: Serve, backend: Backend, engine_id: str) -> None:
    engine, server, client = serve(StubEngine())
    conn = backend.factory()
    ids = [f"a{i}" for i in range(20)]
    for lookup_id in ids:
        client.lookup(TOKENS, lookup_id)
    wait_until(lambda: len(engine.started_ids()) == 20)
    conn.script_flush()
    for lookup_id in ids:  # reports pipelined in batches: NOSCRIPT reload inside a pipeline
        engine.report(lookup_id, 12)
    assert [answer(client, i, timeout=10) for i in ids] == [12] * 20
    conn.script_flush()
    more = [f"b{i}" for i in range(20)]
    for lookup_id in more:  # submits pipelined in batches after the flush
        client.lookup(TOKENS, lookup_id)
    wait_until(lambda: len(engine.started_ids()) == 40)
    for lookup_id in more:
        engine.report(lookup_id, 4)
    assert [answer(client, i, timeout=10) for i in more] == [4] * 20
    assert server.stats().reporter_errors == 0 and client.stats().redis_errors == 0


def test_noscript_reload_in_one_pipeline(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    scripts = ScriptSet()
    scripts.load(conn)
    conn.script_flush()
    req = lookup_request("p1", 7, deadline_ms=epoch_ms() + 60_000)
    submit = Call(
        SUBMIT,
        (ks.lookup("p1"), ks.requests),
        submit_args(
            gen=7,
            expected="0",
            created_ms=1,
            deadline_ms=req.deadline_ms,
            tokens=8,
            ttl_ms=60_000,
            engine_ttl_ms=60_000,
            maxlen=100,
            lookup_id="p1",
            fields=request_fields(req),
        ),
    )
    report = Call(REPORT, (ks.lookup("p1"), ks.done), [0, 7, 8, 100, "p1", 1000, 60_000])
    results = scripts.run(ClientLink(conn), conn, [submit, report, report])
    assert results[1:] == [b"complete", b"duplicate"]
    assert conn.hget(ks.lookup("p1"), "result") == b"8"


def test_shutdown_while_idle_is_bounded_by_block(make_server: MakeServer) -> None:
    server = make_server(StubEngine(), block_ms=1000)
    ready(server)
    started = time.monotonic()
    server.close()
    # One BLOCK to notice the flag, plus the documented grace; generous for a loaded box.
    assert time.monotonic() - started < 1.0 + 2.0
    assert not server.stats().alive


def test_block_not_under_socket_timeout_is_refused() -> None:
    with pytest.raises(ConfigError, match="block_ms"):
        config(block_ms=5000, socket_timeout_ms=5000)
    with pytest.raises(ConfigError, match="block_ms"):
        config(block_ms=4500, socket_timeout_ms=5000)
