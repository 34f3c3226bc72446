"""Metrics through Redis: every scheduler and rank publishes a snapshot, the exporter serves
them all, labelled by engine, role and rank, on fakeredis and a real server.

After N lookups the exporter's scrape holds the scheduler's outcome counters and each
rank's counters with the values the processes counted; a snapshot expires within its TTL
(a gone process's series vanish, the live ones stay); only the holder of a role publishes;
two engines on one server are told apart; the ranks the scheduler sees dead are a gauge.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faultkit import MakeClient, MakeServer, Serve, ServedRanks, answer, prompt, ready
from helpers import Backend, wait_until
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.lmcache_version import running_lmcache_version
from broker_lookup.ops.exporter import FleetCollector, render_once
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, rank_role
from broker_lookup.stub_engine import StubEngine

#: Publish every 200 ms (FAST beats every 100 ms): snapshots expire 600 ms after the last.
QUICK: dict[str, Any] = {"metrics_interval_ms": 200}
N = 5
HITS = 24

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(factory: Callable[[], Any], engine_id: str | None = None) -> Series:
    """One exporter scrape, as {(sample name, labels): value}."""
    collector = FleetCollector(factory, engine_id)
    try:
        text = render_once(collector).decode()
    finally:
        collector.close()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(series: Series, name: str, **labels: str) -> float | None:
    """The one sample of ``name`` whose labels include ``labels`` (None: none; two fail)."""
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    assert len(found) <= 1, f"{name} {labels}: {len(found)} samples"
    return found[0] if found else None


def _lookups(client: RedisAsyncLookupClient, n: int, tag: str) -> None:
    for i in range(n):
        client.lookup(prompt(i * 100), f"{tag}-{i}")
        assert answer(client, f"{tag}-{i}", timeout=10) == HITS


def _two_ranks(serve: Serve) -> ServedRanks[StubEngine]:
    """Two ranks answering :data:`HITS`, and a client, all publishing every :data:`QUICK`."""
    return serve.ranks([StubEngine("instant", hits=HITS) for _ in (0, 1)], QUICK, **QUICK)


@pytest.fixture
def other_engine(backend: Backend, engine_id: str) -> Iterator[tuple[MakeServer, MakeClient]]:
    """Ranks and clients of a second engine, ``<engine_id>-b``: ``make_server`` and
    ``make_client`` of that engine."""
    other = engine_id + "-b"
    with MakeServer(backend, other) as make_server, MakeClient(backend, other) as make_client:
        yield make_server, make_client


def test_the_exporter_serves_the_scheduler_and_each_rank_after_n_lookups(
    backend: Backend, serve: Serve, engine_id: str
) -> None:
    client = _two_ranks(serve).client
    _lookups(client, N, "n")
    mine = {"engine": engine_id, "configured_engine_id": engine_id}

    def published() -> Series | None:
        series = scrape(backend.factory)
        hits = value(series, "broker_lookup_client_lookups_total", outcome="hit", **mine)
        ranks = [
            value(series, "broker_lookup_worker_requests_total", rank=str(r), **mine)
            for r in (0, 1)
        ]
        return series if hits == N and ranks == [N, N] else None

    series = wait_until(published, timeout=10, interval=0.05, message="N lookups exported")
    assert isinstance(series, dict)
    host = socket.gethostname()
    sched = {**mine, "role": "scheduler", "host": host}
    assert value(series, "broker_lookup_client_lookups_total", outcome="miss", **sched) == 0
    assert value(series, "broker_lookup_client_hit_tokens_total", **sched) == N * HITS
    assert value(series, "broker_lookup_client_latency_seconds_count", **sched) == N
    assert value(series, "broker_lookup_client_owner", **sched) == 1
    for r in (0, 1):
        worker = {**mine, "role": "worker", "host": host, "rank": str(r)}
        assert value(series, "broker_lookup_worker_engine_seconds_count", **worker) == N
        reports = [
            v
            for (n, ls), v in series.items()
            if n == "broker_lookup_worker_reports_total" and set(worker.items()) <= ls
        ]
        assert sum(reports) == N  # one report per lookup and rank, whichever completed it
        age = value(series, "broker_lookup_worker_heartbeat_age_seconds", **worker)
        assert age is not None and 0 <= age < 60
    # What this process (the scheduler and the ranks here) imported: another test may have
    # imported LMCache before this one.
    lmcache = running_lmcache_version() or "none"
    assert value(series, "broker_lookup_lmcache_info", version=lmcache, **sched) == 1
    # Two ranks on one host: each process's series stay apart by rank.
    for r in (0, 1):
        labels = {**mine, "role": "worker", "rank": str(r)}
        assert value(series, "broker_lookup_lmcache_info", version=lmcache, **labels) == 1
    only = scrape(backend.factory, engine_id)  # the real server holds other tests' engines
    assert value(only, "broker_lookup_exporter_snapshots", state="read") == 3
    # Each snapshot carries its own TTL, bounded by the config's.
    conn, keys = backend.factory(), KeySpace(engine_id)
    for role in (SCHEDULER_ROLE, rank_role(0), rank_role(1)):
        assert 0 < conn.pttl(keys.metrics(role)) <= client.config.metrics_ttl_ms


def test_a_gone_process_series_vanish_after_the_ttl(
    backend: Backend, serve: Serve, engine_id: str
) -> None:
    _, servers, client = _two_ranks(serve)

    def ranks() -> set[str]:
        return {
            dict(labels)["rank"]
            for name, labels in scrape(backend.factory)
            if name == "broker_lookup_worker_requests_total" and ("engine", engine_id) in labels
        }

    wait_until(lambda: ranks() == {"0", "1"}, timeout=10, message="both ranks exported")
    servers[1].close()
    wait_until(lambda: ranks() == {"0"}, timeout=10, message="rank 1's series gone")
    client.close()
    wait_until(
        lambda: (
            not [
                labels
                for _, labels in scrape(backend.factory, engine_id)
                if ("role", "scheduler") in labels
            ]
        ),
        timeout=10,
        message="the scheduler's series gone too",
    )
    assert ranks() == {"0"}  # the live rank's stay


def test_the_exporter_serves_the_ranks_the_scheduler_sees_dead(
    backend: Backend, make_server: MakeServer, make_client: MakeClient, engine_id: str
) -> None:
    """An idle engine with a rank down shows it: no lookup needs to fail first."""
    ready(make_server(StubEngine("instant", hits=HITS), 0, 2, **QUICK))
    client = make_client(2, **QUICK)
    sched = {"engine": engine_id, "role": "scheduler"}

    def dead() -> float | None:
        return value(scrape(backend.factory, engine_id), "broker_lookup_client_dead_ranks", **sched)

    wait_until(lambda: client.stats().liveness_known, message="heartbeats read")
    wait_until(lambda: dead() == 1, timeout=10, message="rank 1 exported dead")
    ready(make_server(StubEngine("instant", hits=HITS), 1, 2, **QUICK))
    wait_until(lambda: dead() == 0, timeout=10, message="no rank exported dead")


def test_two_engines_on_one_server_are_told_apart(
    backend: Backend,
    make_server: MakeServer,
    make_client: MakeClient,
    engine_id: str,
    other_engine: tuple[MakeServer, MakeClient],
) -> None:
    other_server, other_client = other_engine
    ready(
        make_server(StubEngine("instant", hits=HITS), **QUICK),
        other_server(StubEngine("instant", hits=8), **QUICK),
    )
    a, b = make_client(**QUICK), other_client(**QUICK)
    _lookups(a, 3, "a")
    for i in range(2):
        b.lookup(prompt(i), f"b-{i}")
        assert answer(b, f"b-{i}", timeout=10) == 8

    def counts(engine_filter: str | None = None) -> dict[str, float | None]:
        series = scrape(backend.factory, engine_filter)
        return {
            e: value(series, "broker_lookup_client_lookups_total", outcome="hit", engine=e)
            for e in (engine_id, engine_id + "-b")
        }

    wait_until(lambda: counts() == {engine_id: 3, engine_id + "-b": 2}, timeout=10, interval=0.05)
    # --engine-id: that engine only (and its vLLM instances, "<id>@<instance>").
    assert counts(engine_id + "-b") == {engine_id: None, engine_id + "-b": 2}


def test_only_the_lease_holder_publishes(
    backend: Backend, make_server: MakeServer, make_client: MakeClient, engine_id: str
) -> None:
    """A second scheduler of the engine answers 0 (duplicate_scheduler) and publishes
    nothing: the role's snapshot stays the holder's."""
    ready(make_server(StubEngine("instant", hits=HITS), **QUICK))
    holder = make_client(**QUICK)
    _lookups(holder, 2, "h")
    other = make_client(**QUICK)
    for i in range(3):
        assert other.lookup(prompt(i), f"o-{i}") == 0
    assert other.stats().outcomes["duplicate_scheduler"] == 3
    mine, its = holder._beat.metrics, other._beat.metrics
    assert mine is not None and its is not None
    start = mine.published
    # Three more publishes of the holder: the second scheduler had as many chances.
    wait_until(lambda: mine.published >= start + 3, timeout=10, message="holder publishes")
    assert its.published == 0
    series = scrape(backend.factory)
    lookups = "broker_lookup_client_lookups_total"
    assert value(series, lookups, outcome="duplicate_scheduler", engine=engine_id) == 0
    assert value(series, lookups, outcome="hit", engine=engine_id) == 2


def test_a_malformed_snapshot_is_counted_not_served(backend: Backend, engine_id: str) -> None:
    conn = backend.factory()
    conn.set(KeySpace(engine_id).metrics("0"), b"not json", px=5000)
    series = scrape(backend.factory, engine_id)
    assert value(series, "broker_lookup_exporter_snapshots", state="malformed") == 1
    assert value(series, "broker_lookup_exporter_snapshots", state="read") == 0
    assert not [k for k in series if k[0].startswith("broker_lookup_worker_")]
