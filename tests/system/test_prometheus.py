"""A real Prometheus scrapes ``broker-lookup exporter`` in front of a scheduler and two ranks,
and of a second engine (a vLLM-style instance ``<engine>.b``) whose rank 1 never started:
the outcome and rank counters match what happened, every query of the shipped dashboard
returns data for All engines and for one (then that engine's series only), every alert
rule evaluates over series that exist, ``BrokerLookupRanksDead``'s expression names the
engine with the dead rank, and ``promtool check rules`` accepts the rules file. (The vLLM
leg does the same under a real vLLM engine.)

Then the alerts fire for what they promise, on a real Prometheus evaluating the shipped
rules (their ``for`` cut to seconds) and the fault proxy: the scheduler's link to Redis
held, Redis gone for the exporter, the exporter gone; and ``promtool test rules`` passes
the rules' unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import alive, answer, config, prompt, ready
from helpers import RealServer, wait_until
from promkit import (
    ALERT_TESTS,
    ALERTS,
    Prometheus,
    alert_exprs,
    check_shipped_queries,
    firing,
    promtool,
    require_prometheus,
    rules_with_for,
    wait_for,
)

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupMetadata
from broker_lookup.ops.exporter import ExporterServer, FleetCollector
from broker_lookup.protocol.keys import instance_engine_id
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.connection import make_factory
from faultproxy.proxy import FaultProxy
from workers.server import RedisAsyncLookupServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = 6
HITS = 24


@pytest.fixture
def prometheus_binary() -> str:
    return require_prometheus()


def test_promtool_accepts_the_alert_rules(prometheus_binary: str) -> None:
    done = promtool(prometheus_binary, "check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_of_the_alert_rules_pass(prometheus_binary: str) -> None:
    """Each alert that stands in for a series that cannot exist is unit-tested: the
    scheduler cut off from Redis, Redis down for everyone, no exporter."""
    done = promtool(prometheus_binary, "test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    tested = ALERT_TESTS.read_text()
    for alert in (
        "BrokerLookupSchedulerSilent",
        "BrokerLookupBreakerOpen",
        "BrokerLookupRedisDown",
        "BrokerLookupExporterDown",
    ):
        assert f"alertname: {alert}" in tested, alert


@pytest.fixture
def fleet(real_server: RealServer, engine_id: str) -> Iterator[RedisAsyncLookupClient]:
    """A scheduler and two ranks of ``engine_id``, publishing every 500 ms."""
    cfg = config(real_server.url, metrics_interval_ms=500)
    servers = [
        RedisAsyncLookupServer(
            StubEngine("instant", hits=HITS),
            LookupMetadata(engine_id=engine_id, world_size=2, worker_id=r),
            cfg,
        )
        for r in (0, 1)
    ]
    client = RedisAsyncLookupClient(cfg, LookupMetadata(engine_id=engine_id, world_size=2))
    try:
        ready(*servers)
        alive(client)
        yield client
    finally:
        client.close()
        for server in servers:
            server.close()


@pytest.fixture
def lame(real_server: RealServer, engine_id: str) -> Iterator[RedisAsyncLookupClient]:
    """A scheduler of ``<engine_id>@b``, an instance of the engine (world size 2), with
    only its rank 0 running."""
    cfg = config(real_server.url, metrics_interval_ms=500)
    other = instance_engine_id(engine_id, "b")
    server = RedisAsyncLookupServer(
        StubEngine("instant", hits=HITS),
        LookupMetadata(engine_id=other, world_size=2, worker_id=0),
        cfg,
    )
    client = RedisAsyncLookupClient(cfg, LookupMetadata(engine_id=other, world_size=2))
    try:
        ready(server)
        wait_until(lambda: client.stats().dead_ranks == (1,), message="rank 1 seen dead")
        yield client
    finally:
        client.close()
        server.close()


def test_prometheus_scrapes_the_exporter_and_runs_the_dashboard_and_alerts(
    prometheus_binary: str,
    real_server: RealServer,
    engine_id: str,
    fleet: RedisAsyncLookupClient,
    lame: RedisAsyncLookupClient,
    tmp_path: Path,
) -> None:
    for i in range(N):
        fleet.lookup(prompt(i * 10), f"p-{i}")
        assert answer(fleet, f"p-{i}", timeout=10) == HITS
    collector = FleetCollector(make_factory(config(real_server.url), "bl-exporter"), engine_id)
    exporter = ExporterServer(collector, "127.0.0.1", 0).start()
    prom = Prometheus(prometheus_binary, [f"127.0.0.1:{exporter.port}"], tmp_path)
    try:
        prom.start()
        mine = f'engine="{engine_id}"'
        wait_for(prom, f'broker_lookup_client_lookups_total{{{mine},outcome="hit"}}', N)
        for rank in (0, 1):
            wait_for(prom, f'broker_lookup_worker_requests_total{{{mine},rank="{rank}"}}', N)
        assert prom.scraped(), prom.log()
        wait_for(prom, f"broker_lookup_client_hit_tokens_total{{{mine}}}", N * HITS)
        wait_for(prom, f'broker_lookup_client_lookups_total{{{mine},outcome="miss"}}', 0)
        wait_for(prom, f'sum(broker_lookup_worker_reports_total{{{mine},rank="0"}})', N)
        wait_for(prom, f"broker_lookup_client_dead_ranks{{{mine}}}", 0)
        # The dead-rank alert's expression names the engine with the dead rank, only it.
        (dead_rule,) = [expr for name, expr in alert_exprs() if name == "BrokerLookupRanksDead"]
        other = instance_engine_id(engine_id, "b")
        wait_until(
            lambda: prom.values(dead_rule) == {frozenset({("engine", other)}): 1.0},
            timeout=60,
            interval=0.5,
            message=f"{dead_rule} names {other}",
        )
        shown = check_shipped_queries(prom, engine_id)
        assert {engine_id, other} <= shown  # All showed both: the filtered pass had one to drop
    finally:
        prom.stop()
        assert exporter.stop()


def _firing_for(prom: Prometheus, alert: str, **labels: str) -> bool:
    return any(labels.items() <= found.items() for found in firing(prom, alert))


# Waits out each alert's 'for' window four times (15 s): timing, so the long leg; the
# scrape, the dashboard's queries and the rules' load run in the default run above.
@pytest.mark.long
def test_the_alerts_fire_for_a_held_scheduler_link_redis_down_and_a_gone_exporter(
    prometheus_binary: str,
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    tmp_path: Path,
) -> None:
    """The scheduler reaches Redis through ``fault_proxy``, its ranks and the exporter
    (through a proxy of its own) directly."""
    cfg = config(real_server.url, metrics_interval_ms=500)
    servers = [
        RedisAsyncLookupServer(
            StubEngine("instant", hits=HITS),
            LookupMetadata(engine_id=engine_id, world_size=2, worker_id=r),
            cfg,
        )
        for r in (0, 1)
    ]
    client = RedisAsyncLookupClient(
        # A short socket timeout: the held link opens the breaker sooner.
        config(fault_proxy.url, metrics_interval_ms=500, socket_timeout_ms=1500),
        LookupMetadata(engine_id=engine_id, world_size=2),
    )
    exporter_link = FaultProxy.for_url(real_server.url).start()
    collector = FleetCollector(make_factory(config(exporter_link.url), "bl-exporter"), engine_id)
    exporter = ExporterServer(collector, "127.0.0.1", 0).start()
    prom = Prometheus(
        prometheus_binary,
        [f"127.0.0.1:{exporter.port}"],
        tmp_path,
        # Each alert waits out its `for`, then a scrape and an evaluation, four times over:
        # half-second ones keep the wait short (what fires stays the shipped expressions).
        rules=rules_with_for(tmp_path, "1s"),
        interval="500ms",
    )
    mine = f'engine="{engine_id}"'
    try:
        ready(*servers)
        alive(client)
        prom.start()
        wait_for(prom, f"broker_lookup_client_owner{{{mine}}}", 1)
        wait_for(prom, f'count(broker_lookup_worker_owner{{{mine},role="worker"}})', 2)
        assert not firing(prom, "BrokerLookupSchedulerSilent")

        # (a) The scheduler's link held: its breaker opens, but its snapshot cannot be
        # written, so the breaker's own series vanishes instead of reading 1.
        fault_proxy.hold()
        wait_until(lambda: client.stats().breaker_open, timeout=15, message="breaker opens")
        wait_until(
            lambda: _firing_for(prom, "BrokerLookupSchedulerSilent", engine=engine_id),
            timeout=60,
            interval=0.5,
            message="BrokerLookupSchedulerSilent fires for the held scheduler",
        )
        assert client.stats().breaker_open
        assert not prom.query(f"broker_lookup_client_breaker_open{{{mine}}}")
        assert not _firing_for(prom, "BrokerLookupBreakerOpen", engine=engine_id)
        fault_proxy.release()
        wait_until(lambda: not client.stats().breaker_open, timeout=30, message="it closes")
        wait_until(
            lambda: not _firing_for(prom, "BrokerLookupSchedulerSilent", engine=engine_id),
            timeout=60,
            interval=0.5,
            message="BrokerLookupSchedulerSilent resolves once the scheduler publishes",
        )

        # (b) Redis gone for the exporter: it still answers, with broker_lookup_redis_up 0.
        exporter_link.refuse()
        exporter_link.reset()
        wait_until(
            lambda: firing(prom, "BrokerLookupRedisDown"),
            timeout=60,
            interval=0.5,
            message="BrokerLookupRedisDown fires",
        )
        assert prom.scraped()  # the exporter's scrape itself succeeds
        assert not firing(prom, "BrokerLookupExporterDown")

        # (c) The exporter gone.
        assert exporter.stop()
        wait_until(
            lambda: firing(prom, "BrokerLookupExporterDown"),
            timeout=60,
            interval=0.5,
            message="BrokerLookupExporterDown fires",
        )
    finally:
        prom.stop()
        exporter.stop()
        exporter_link.stop()
        client.close()
        for server in servers:
            server.close()
