"""The metrics snapshot a process publishes: when, with which TTL, how big; and how the
exporter renders one (heartbeat age at scrape time, the process's LMCache, HTTP)."""

from __future__ import annotations

import http.client
import logging
from typing import Any

import fakeredis
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.config import LookupConfig
from broker_lookup.errors import ConfigError, MalformedMessage
from broker_lookup.ops.exporter import ExporterServer, FleetCollector, render_once
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.snapshot import (
    MAX_SNAPSHOT_BYTES,
    MetricsPublisher,
    MetricsSnapshot,
    decode_snapshot,
    encode_snapshot,
)
from broker_lookup.protocol.stats import RankStats, rank_stats

KEYS = KeySpace("e1")


def _publisher(stats: RankStats, interval_ms: int = 1000) -> MetricsPublisher:
    return MetricsPublisher(
        KEYS, "0", "server", lambda: stats, interval_ms=interval_ms, ttl_ms=3 * interval_ms
    )


def test_a_snapshot_is_due_once_per_interval_with_its_ttl() -> None:
    pub = _publisher(RankStats(rank=3))
    command = pub.command(100.0)
    assert command is not None
    verb, key, body, px, ttl = command
    assert (verb, key, px, ttl) == ("SET", "bl:{e1}:metrics:0", "PX", 3000)
    assert isinstance(body, bytes)
    snap = decode_snapshot(body)
    assert (snap.kind, snap.role, snap.stats["rank"]) == ("server", "0", 3)
    assert rank_stats(snap.stats) == RankStats(rank=3)
    assert pub.command(100.5) is None  # not due yet
    assert pub.command(101.0) is not None
    assert pub.published == 2


def test_interval_zero_publishes_nothing() -> None:
    assert _publisher(RankStats(), interval_ms=0).command(1e9) is None


def test_an_oversized_snapshot_is_not_written_and_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    big = RankStats(counts={"x" * MAX_SNAPSHOT_BYTES: 1})
    pub = _publisher(big)
    with caplog.at_level(logging.ERROR):
        assert pub.command(0.0) is None
        assert pub.command(10.0) is None
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "over" in caplog.records[0].message and "bl:{e1}:metrics:0" in caplog.records[0].message
    assert pub.published == 0


def test_stats_json_cannot_hold_are_refused_not_raised() -> None:
    # A bug that put something JSON cannot hold into the stats.
    bad = RankStats(counts={"x": object()})  # type: ignore[dict-item]  # on purpose
    assert _publisher(bad).command(0.0) is None


def test_a_malformed_snapshot_raises_malformed_message() -> None:
    with pytest.raises(MalformedMessage):
        decode_snapshot(b'{"kind": "nope"}')


@pytest.mark.parametrize("interval", [1, 499])
def test_metrics_interval_under_the_heartbeat_is_refused(interval: int) -> None:
    with pytest.raises(ConfigError, match="metrics_interval_ms"):
        LookupConfig(metrics_interval_ms=interval)


def test_metrics_ttl_stays_within_the_engine_ttl() -> None:
    assert LookupConfig().metrics_ttl_ms == 15_000
    assert LookupConfig().metrics_period_ms == 5000
    short = LookupConfig(
        engine_ttl_ms=6000, key_grace_ms=500, lookup_timeout_ms=1000, lookup_timeout_max_ms=1000
    )
    assert short.metrics_ttl_ms == 6000
    assert short.metrics_period_ms == 2000  # three publishes within the TTL
    assert LookupConfig(metrics_interval_ms=0).metrics_period_ms == 0


def _served(server_stats: dict[str, Any], ts_ms: int, lmcache: str | None) -> fakeredis.FakeRedis:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    snap = MetricsSnapshot(
        kind="server",
        role="1",
        host="pod-a",
        pid=7,
        started_ms=0,
        ts_ms=ts_ms,
        configured_engine_id="vllm-0",
        lmcache=lmcache,
        stats=server_stats,
    )
    conn.set(KeySpace("vllm-0.3f2a1").metrics("1"), encode_snapshot(snap), px=60_000)
    return conn


def test_the_heartbeat_age_is_computed_at_scrape_time() -> None:
    """A rank whose loop stopped publishing ages in the exporter until its snapshot expires."""
    conn = _served({"rank": 1, "last_heartbeat": 1000.0}, 1_000_000, "0.5.6")
    collector = FleetCollector(lambda: conn, clock=lambda: 1042.0)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(render_once(collector).decode())
        for s in f.samples
    }
    base = (
        ("configured_engine_id", "vllm-0"),
        ("engine", "vllm-0.3f2a1"),
        ("host", "pod-a"),
        ("rank", "1"),
        ("role", "worker"),
    )
    assert samples["broker_lookup_worker_heartbeat_age_seconds", base] == 42.0
    info = tuple(sorted((*base, ("version", "0.5.6"))))  # the exporter adds the rank
    assert samples["broker_lookup_lmcache_info", info] == 1.0


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_the_http_endpoint_serves_metrics_health_and_readiness() -> None:
    conn = _served({"rank": 1, "counts": {"requests": 3}}, 0, None)
    server = ExporterServer(FleetCollector(lambda: conn), "127.0.0.1", 0).start()
    try:
        status, body = _get(server.port, "/metrics")
        assert status == 200
        assert b'broker_lookup_worker_requests_total{configured_engine_id="vllm-0"' in body
        assert _get(server.port, "/healthz")[0] == 200
        assert _get(server.port, "/readyz")[0] == 200
        assert _get(server.port, "/nope")[0] == 404
    finally:
        assert server.stop()


def test_redis_down_is_a_series_an_alert_reads_and_fails_readiness() -> None:
    """A scrape that cannot read Redis still succeeds, with ``broker_lookup_redis_up 0``
    alone (a 503 would read as a gone exporter, and no rule could tell the two apart);
    once Redis answers again the series are back with it at 1."""
    fake = fakeredis.FakeServer()
    conn = fakeredis.FakeRedis(server=fake)
    fake.connected = False
    server = ExporterServer(FleetCollector(lambda: conn), "127.0.0.1", 0).start()
    try:
        status, body = _get(server.port, "/metrics")
        assert status == 200
        samples = [line for line in body.decode().splitlines() if not line.startswith("#")]
        assert samples == ["broker_lookup_redis_up 0.0"]
        assert _get(server.port, "/readyz")[0] == 503
        assert _get(server.port, "/healthz")[0] == 200
        fake.connected = True
        status, body = _get(server.port, "/metrics")
        assert status == 200 and b"broker_lookup_redis_up 1.0" in body
        assert b'broker_lookup_exporter_snapshots{state="read"} 0.0' in body
    finally:
        assert server.stop()
