"""A hung or unreachable Redis on the rank's side: the read loop notices within a socket
timeout of BLOCK + breaker_open_ms, the watchdog runs on regardless, the report queue is
bounded, everything recovers by itself, and close() leaves no connection open."""

from __future__ import annotations

import pytest
import redis
from faultkit import MakeServer, config, hold_reports, ready
from helpers import RealServer, epoch_ms, lookup_request, request_entry, wait_until
from redis.typing import EncodableT, FieldT

from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from faultproxy.proxy import FaultProxy
from workers.server import RedisAsyncLookupServer


def _entry(lookup_id: str, budget_ms: int = 60_000) -> dict[FieldT, EncodableT]:
    req = lookup_request(lookup_id, deadline_ms=epoch_ms() + budget_ms, budget_ms=budget_ms)
    return request_entry(req)


def _names(conn: redis.Redis, engine_id: str) -> list[str]:
    prefix = f"bl-worker-{engine_id}-"
    return [c["name"] for c in conn.client_list() if c.get("name", "").startswith(prefix)]


def test_stalled_redis_pauses_neither_the_read_loop_nor_the_watchdog(
    real_server: RealServer, fault_proxy: FaultProxy, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    engine = StubEngine()
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    cfg = config(fault_proxy.url, worker_watchdog_grace_ms=200)  # socket_timeout_ms 5 s
    with RedisAsyncLookupServer(engine, meta, cfg) as server:
        ready(server)
        conn.xadd(ks.requests, _entry("stuck", budget_ms=500))
        wait_until(lambda: engine.started_ids() == ["stuck"])
        fault_proxy.hold()  # no RST: a SIGSTOPped server or a partition
        # The blocking read fails after BLOCK + breaker_open_ms, not 5 s x redis-py retries.
        wait_until(lambda: server.stats().consumer.redis_errors >= 1, timeout=4)
        # The engine never reports: released by the watchdog while Redis is still stalled.
        wait_until(lambda: engine.released == ["stuck"], timeout=4)
        assert server.stats().counts["watchdog"] == 1
        fault_proxy.release()
        wait_until(lambda: server.ready, timeout=10)
        conn.xadd(ks.requests, _entry("after"))
        wait_until(lambda: engine.started_ids() == ["stuck", "after"], timeout=10)
        assert server.stats().alive


def test_close_leaves_no_connection_open(real_server: RealServer, engine_id: str) -> None:
    conn = redis.Redis.from_url(real_server.url)
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    server = RedisAsyncLookupServer(StubEngine(), meta, config(real_server.url))
    ready(server)
    # The read loop's at least (the reporter connects on its first report).
    wait_until(lambda: len(_names(conn, engine_id)) >= 1, message="the rank's connections")
    server.close()
    wait_until(lambda: _names(conn, engine_id) == [], message="every connection closed")


def test_reports_beyond_the_bounded_queue_are_released(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, server, ks, conn = make_server.lone()
    reporter = server._reporter
    monkeypatch.setattr(reporter, "_max_queue", 2)
    gate = hold_reports(server, monkeypatch)  # a Redis that does not answer: the first batch hangs
    ids = [f"q{i}" for i in range(5)]
    for lookup_id in ids:
        conn.xadd(ks.requests, _entry(lookup_id))
    wait_until(lambda: len(engine.started_ids()) == 5)
    engine.report("q0", 8)
    wait_until(lambda: reporter.queued == 0)  # q0 is in the hanging batch
    for lookup_id in ids[1:]:
        engine.report(lookup_id, 8)
    # q1 and q2 wait in the queue; q3 and q4 do not fit: released at once, not queued.
    assert server.stats().counts["report_overflow"] == reporter.overflows == 2
    assert sorted(engine.released) == ["q3", "q4"]
    gate.set()
    wait_until(lambda: sorted(engine.released) == ids)  # no hash: "dropped", released
    assert server.stats().reporting == 0
