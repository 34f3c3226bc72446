"""The Prometheus collectors export exactly the documented names, from ``stats()`` alone."""

from __future__ import annotations

import math
import sys
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.client.table import OUTCOMES
from broker_lookup.histogram import LATENCY_BUCKETS
from broker_lookup.ops.metrics import (
    CLIENT_METRICS,
    EXPORTER_METRICS,
    METRIC_NAMES,
    PROCESS_METRICS,
    WORKER_METRICS,
    ClientCollector,
    ServerCollector,
)
from broker_lookup.protocol.stats import ClientStats, RankStats, client_stats, rank_stats

PROCESS_NAMES = set(PROCESS_METRICS)  # gauges only: exposed under their own names
CLIENT_NAMES = {n for n in METRIC_NAMES if n.startswith("broker_lookup_client_")} | PROCESS_NAMES
#: ``stats().rank_insights`` of a two-rank client (see tests/unit/test_rank_insights_model.py).
RANK_INSIGHTS: dict[str, Any] = {
    "recorded": 3,
    "ranks": {
        r: {
            "report_counts": [0, 1, 2] + [0] * (len(LATENCY_BUCKETS) - 2),
            "report_sum": 0.01,
            "last": r + 1,
            "excess_lookups": r,
            "excess_tokens": 16 * r,
        }
        for r in (0, 1)
    },
    "spread_counts": [2, 1],
    "spread_sum": 16.0,
    "spread_warnings": 0,
}
WORKER_NAMES = {n for n in METRIC_NAMES if n.startswith("broker_lookup_worker_")} | PROCESS_NAMES


class FakeClient:
    def __init__(self, **stats: Any) -> None:
        self.calls = 0
        self._stats = {
            "outcomes": {"hit": 3, "miss": 1, "timeout": 2, "cancelled": 0, "dead_rank": 1},
            "hit_tokens": 4096,
            "inflight": 5,
            "dead_ranks": [1, 3],
            "redis_errors": 7,
            "rejected": {"bad_id": 2, "configs_too_large": 1},
            "truncated": 4,
            "breaker_open": True,
            "breaker_openings": 3,
            "latency_counts": [1, 0, 2] + [0] * (len(LATENCY_BUCKETS) - 3) + [4],
            "latency_sum": 12.5,
            "rank_insights": RANK_INSIGHTS,
            "ownership": {"owner": False, "epoch": None, "conflicts": 2, "lost": 0, "claims": 0},
            **stats,
        }

    def stats(self) -> ClientStats:
        self.calls += 1
        return client_stats(self._stats)


class FakeServer:
    def __init__(self, rank: int = 1, last_heartbeat: float = 990.0, **extra: Any) -> None:
        self.engine_seconds = [0, 2, 0] + [0] * (len(LATENCY_BUCKETS) - 3) + [1]
        self.engine_seconds_sum = 4.25
        self._stats = {
            "rank": rank,
            "counts": {
                "requests": 9,
                "expired": 2,
                "aborts": 3,
                "engine_errors": 1,
                "report_complete": 4,
                "report_recorded": 5,
                "report_dropped": 1,
                "report_stale": 2,
                "report_skipped_aborted": 6,
                "report_fenced": 7,
            },
            "running": 2,
            "waiting": 1,
            "held": 8,
            "consumer": {"pending": 11, "lag": 12, "dead_letters": 3, "redis_errors": 4},
            "reporter_errors": 1,
            "last_heartbeat": last_heartbeat,
            "ownership": {"owner": True, "epoch": 3, "conflicts": 1, "lost": 2, "claims": 3},
            **extra,
        }

    def stats(self) -> RankStats:
        engine = {
            "engine_seconds": self.engine_seconds,
            "engine_seconds_sum": self.engine_seconds_sum,
        }
        return rank_stats({**self._stats, **engine})


def _scrape(collector: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):  # the exposition parses back
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _names(samples: dict[tuple[str, Any], float]) -> set[str]:
    return {name for name, _ in samples}


def test_client_collector_exports_exactly_the_client_names() -> None:
    assert _names(_scrape(ClientCollector(FakeClient()))) == CLIENT_NAMES


def test_worker_collector_exports_exactly_the_worker_names() -> None:
    assert _names(_scrape(ServerCollector(FakeServer(), clock=lambda: 1000.0))) == WORKER_NAMES


def test_every_declared_name_is_exported_by_one_collector() -> None:
    """Client and worker names by their collectors; the exporter's own by the exporter
    (tests/protocol/test_fleet_metrics.py)."""
    assert CLIENT_NAMES | WORKER_NAMES | set(EXPORTER_METRICS) == METRIC_NAMES
    assert {n[: -len("_bucket")] for n in METRIC_NAMES if n.endswith("_bucket")} == {
        name
        for name, (kind, _) in {**CLIENT_METRICS, **WORKER_METRICS}.items()
        if kind == "histogram"
    }


def test_client_values_and_outcome_label() -> None:
    samples = _scrape(ClientCollector(FakeClient()))
    outcome = {
        dict(labels)["outcome"]: v
        for (name, labels), v in samples.items()
        if name == "broker_lookup_client_lookups_total"
    }
    assert outcome == {
        "hit": 3,
        "partial": 0,
        "miss": 1,
        "timeout": 2,
        "cancelled": 0,
        "dead_rank": 1,
        "error": 0,
        "unavailable": 0,
        "rejected": 0,
        "duplicate_scheduler": 0,
    }
    assert set(OUTCOMES) <= set(outcome)
    # Another scheduler holds this engine id: not the owner, one conflict each episode.
    assert samples[("broker_lookup_client_owner", ())] == 0
    assert samples[("broker_lookup_client_owner_conflicts_total", ())] == 2
    assert samples[("broker_lookup_client_hit_tokens_total", ())] == 4096
    assert samples[("broker_lookup_client_inflight", ())] == 5
    assert samples[("broker_lookup_client_dead_ranks", ())] == 2
    assert samples[("broker_lookup_client_redis_errors_total", ())] == 7
    rejected = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "broker_lookup_client_rejected_total"
    }
    assert rejected == {"bad_id": 2, "configs_too_large": 1}
    assert samples[("broker_lookup_client_truncated_total", ())] == 4
    assert samples[("broker_lookup_client_breaker_open", ())] == 1
    assert samples[("broker_lookup_client_breaker_openings_total", ())] == 3


def test_client_histogram_is_cumulative_with_overflow_in_inf() -> None:
    samples = _scrape(ClientCollector(FakeClient()))
    name = "broker_lookup_client_latency_seconds_bucket"
    buckets = {dict(labels)["le"]: v for (n, labels), v in samples.items() if n == name}
    assert buckets[str(LATENCY_BUCKETS[0])] == 1
    assert buckets[str(LATENCY_BUCKETS[1])] == 1
    assert buckets[str(LATENCY_BUCKETS[2])] == 3
    assert buckets[str(LATENCY_BUCKETS[-1])] == 3
    assert buckets["+Inf"] == 7
    assert len(buckets) == len(LATENCY_BUCKETS) + 1
    assert samples[("broker_lookup_client_latency_seconds_count", ())] == 7
    assert samples[("broker_lookup_client_latency_seconds_sum", ())] == 12.5


def test_no_per_lookup_labels() -> None:
    client = _scrape(ClientCollector(FakeClient()))
    worker = _scrape(ServerCollector(FakeServer(), clock=lambda: 1000.0))
    allowed = {"outcome", "rank", "result", "reason", "state", "le", "version"}
    for _, labels in [*client, *worker]:
        assert {k for k, _ in labels} <= allowed


def test_worker_series_carry_the_rank_and_read_stats() -> None:
    samples = _scrape(ServerCollector(FakeServer(rank=3), clock=lambda: 1000.0))
    for (name, labels), _ in samples.items():
        if name not in PROCESS_NAMES:
            assert dict(labels)["rank"] == "3", name

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"rank": "3", **labels}.items())))]

    assert value("broker_lookup_worker_requests_total") == 9
    assert value("broker_lookup_worker_expired_total") == 2
    assert value("broker_lookup_worker_aborts_total") == 3
    assert value("broker_lookup_worker_group_pending") == 11
    assert value("broker_lookup_worker_group_lag") == 12
    assert value("broker_lookup_worker_redis_errors_total") == 5  # loop + reporter
    assert value("broker_lookup_worker_heartbeat_age_seconds") == pytest.approx(10.0)
    assert value("broker_lookup_worker_reports_total", result="complete") == 4
    assert value("broker_lookup_worker_reports_total", result="recorded") == 5
    assert value("broker_lookup_worker_reports_total", result="fenced") == 7
    assert value("broker_lookup_worker_owner") == 1
    assert value("broker_lookup_worker_owner_conflicts_total") == 1
    assert value("broker_lookup_worker_owner_lost_total") == 2
    assert value("broker_lookup_worker_reports_dropped_total", reason="late") == 1
    assert value("broker_lookup_worker_reports_dropped_total", reason="stale") == 2
    assert value("broker_lookup_worker_reports_dropped_total", reason="aborted") == 6
    assert value("broker_lookup_worker_dead_letters_total", reason="all") == 3
    assert value("broker_lookup_worker_lookups", state="held") == 8
    assert value("broker_lookup_worker_engine_seconds_bucket", le="+Inf") == 3
    assert value("broker_lookup_worker_engine_seconds_count") == 3
    assert value("broker_lookup_worker_engine_seconds_sum") == 4.25


def test_dead_letters_by_reason_when_the_consumer_counts_them() -> None:
    server = FakeServer()
    server._stats["consumer"] = {"dead_letter_reasons": {"undecodable": 2, "invalid": 1}}
    samples = _scrape(ServerCollector(server, clock=lambda: 1000.0))
    reasons = {
        dict(labels)["reason"]: v
        for (name, labels), v in samples.items()
        if name == "broker_lookup_worker_dead_letters_total"
    }
    assert reasons == {"undecodable": 2, "invalid": 1}


def test_heartbeat_age_is_infinite_before_the_first_beat() -> None:
    samples = _scrape(ServerCollector(FakeServer(last_heartbeat=0.0), clock=lambda: 1000.0))
    age = samples[("broker_lookup_worker_heartbeat_age_seconds", (("rank", "1"),))]
    assert math.isinf(age)


def test_stats_are_read_at_scrape_time_only() -> None:
    client = FakeClient()
    registry = CollectorRegistry()
    registry.register(ClientCollector(client))
    assert client.calls == 0  # registering does not read
    generate_latest(registry)
    generate_latest(registry)
    assert client.calls == 2


@pytest.mark.parametrize(
    "make", [lambda: ClientCollector(FakeClient()), lambda: ServerCollector(FakeServer())]
)
def test_both_collectors_say_which_lmcache_the_process_runs(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(sys.modules, "lmcache", raising=False)
    info = {k: v for k, v in _scrape(make()).items() if k[0] == "broker_lookup_lmcache_info"}
    assert info == {("broker_lookup_lmcache_info", (("version", "none"),)): 1.0}
    fake = ModuleType("lmcache")
    fake.__version__ = "0.5.7rc2"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lmcache", fake)
    info = {k: v for k, v in _scrape(make()).items() if k[0] == "broker_lookup_lmcache_info"}
    assert info == {("broker_lookup_lmcache_info", (("version", "0.5.7rc2"),)): 1.0}
