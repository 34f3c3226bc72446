"""Prometheus metric names and the collectors that export them.

Counters live as plain integers inside the client and the server (nothing is
added to the scheduler's hot path); :class:`ClientCollector` and
:class:`ServerCollector` read their ``stats()`` at scrape time. No metric carries
a per-lookup label: client series have at most ``outcome`` (or ``rank``, for the
``rank_*`` series of ``rank_insights``: one per expected rank), worker series carry
``rank`` (plus ``result``/``reason``/``state`` where the help says so). Both collectors
also export :data:`PROCESS_METRICS` (which LMCache the process runs), so register one of
them per registry.

>>> registry = CollectorRegistry()                  # doctest: +SKIP
>>> registry.register(ClientCollector(client))      # doctest: +SKIP
>>> generate_latest(registry)                       # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from broker_lookup.client.insights import SPREAD_BUCKETS
from broker_lookup.client.table import OUTCOMES
from broker_lookup.histogram import Histogram
from broker_lookup.lmcache_version import running_lmcache_version
from broker_lookup.protocol.stats import ClientStats, InsightsStats, RankStats

__all__ = [
    "CLIENT_METRICS",
    "EXPORTER_METRICS",
    "METRIC_NAMES",
    "PROCESS_METRICS",
    "WORKER_METRICS",
    "ClientCollector",
    "ServerCollector",
]

#: Client-side metrics (scheduler process): name -> (type, help).
CLIENT_METRICS: dict[str, tuple[str, str]] = {
    "broker_lookup_client_lookups_total": (
        "counter",
        "Finished lookups by outcome (hit, miss, timeout, cancelled, dead_rank, error, "
        "unavailable, rejected, duplicate_scheduler).",
    ),
    "broker_lookup_client_owner": (
        "gauge",
        "1 while this scheduler holds its engine's lease (0: another scheduler of the same "
        "engine id holds it, or ours lapsed: lookups answer 0).",
    ),
    "broker_lookup_client_owner_conflicts_total": (
        "counter",
        "Times this scheduler found another live scheduler holding its engine id.",
    ),
    "broker_lookup_client_rejected_total": (
        "counter",
        "Requests answered 0 because the protocol cannot carry them, by reason.",
    ),
    "broker_lookup_client_truncated_total": (
        "counter",
        "Prompts over max_chunks_per_request looked up by their first chunks.",
    ),
    "broker_lookup_client_breaker_open": (
        "gauge",
        "1 while the circuit breaker is open (Redis failing or stalled: lookups answer 0).",
    ),
    "broker_lookup_client_breaker_openings_total": (
        "counter",
        "Times the circuit breaker opened.",
    ),
    "broker_lookup_client_latency_seconds": (
        "histogram",
        "Time from lookup() to the result being available to lookup_cache().",
    ),
    "broker_lookup_client_hit_tokens_total": (
        "counter",
        "Sum of hit tokens over finished lookups.",
    ),
    "broker_lookup_client_inflight": ("gauge", "Lookups submitted and not finished."),
    "broker_lookup_client_dead_ranks": (
        "gauge",
        "Expected ranks the scheduler finds without a heartbeat (their lookups answer 0; "
        "before its first heartbeat read, every expected rank).",
    ),
    "broker_lookup_client_redis_errors_total": ("counter", "Redis errors seen by client threads."),
    "broker_lookup_client_rank_report_seconds": (
        "histogram",
        "Time from the lookup's submit to this rank's report, both on the Redis server's "
        "clock (rank_insights).",
    ),
    "broker_lookup_client_rank_last_total": (
        "counter",
        "Lookups this rank completed by reporting last (rank_insights).",
    ),
    "broker_lookup_client_rank_excess_lookups_total": (
        "counter",
        "Lookups where this rank reported more hits than the minimum over the ranks "
        "(rank_insights).",
    ),
    "broker_lookup_client_rank_excess_tokens_total": (
        "counter",
        "Tokens this rank reported above the minimum: prefetched in vain (rank_insights).",
    ),
    "broker_lookup_client_rank_late_total": (
        "counter",
        "Lookups that reached their deadline (a timeout, or a partial answer) before this "
        "rank reported (rank_insights).",
    ),
    "broker_lookup_client_rank_spread_tokens": (
        "histogram",
        "Max - min hits over the ranks of one lookup, in tokens (rank_insights).",
    ),
}

#: Worker-side metrics (one series per rank, label ``rank``): name -> (type, help).
WORKER_METRICS: dict[str, tuple[str, str]] = {
    "broker_lookup_worker_requests_total": ("counter", "Lookup requests dispatched to the engine."),
    "broker_lookup_worker_engine_seconds": (
        "histogram",
        "Engine lookup + prefetch time, from dispatch to report.",
    ),
    "broker_lookup_worker_reports_total": ("counter", "Reports written, by result."),
    "broker_lookup_worker_reports_dropped_total": (
        "counter",
        "Reports that changed nothing (late, stale or duplicate), by reason.",
    ),
    "broker_lookup_worker_dead_letters_total": ("counter", "Entries dead-lettered, by reason."),
    "broker_lookup_worker_expired_total": ("counter", "Requests dropped past their deadline."),
    "broker_lookup_worker_trimmed_total": (
        "counter",
        "Own pending entries found trimmed when read again (expired unread), acked.",
    ),
    "broker_lookup_worker_aborts_total": ("counter", "Abort entries handled."),
    "broker_lookup_worker_group_pending": ("gauge", "Entries delivered to the rank, not acked."),
    "broker_lookup_worker_group_lag": ("gauge", "Entries not yet delivered to the rank's group."),
    "broker_lookup_worker_heartbeat_age_seconds": ("gauge", "Seconds since the last heartbeat."),
    "broker_lookup_worker_redis_errors_total": ("counter", "Redis errors seen by the rank loop."),
    "broker_lookup_worker_engine_errors_total": (
        "counter",
        "Engine calls that raised (the rank answered 0 or went on).",
    ),
    "broker_lookup_worker_lookups": (
        "gauge",
        "Lookups the rank holds now, by state (running, waiting, held).",
    ),
    "broker_lookup_worker_progress_total": (
        "counter",
        "Progress reports (partial_answers) written, by progress.lua's answer.",
    ),
    "broker_lookup_worker_owner": (
        "gauge",
        "1 while this process holds the rank's lease and serves it (0: another process "
        "of the same engine id and rank holds it, or ours lapsed).",
    ),
    "broker_lookup_worker_owner_conflicts_total": (
        "counter",
        "Times this process found another live process serving its rank.",
    ),
    "broker_lookup_worker_owner_lost_total": (
        "counter",
        "Times this process lost its rank's lease to another process and stopped serving.",
    ),
    "broker_lookup_worker_keeps_total": (
        "counter",
        "Keep entries of partial answers handled: kept, unknown (no such generation "
        "here), unsupported (the engine has no keep_memory_objs).",
    ),
    "broker_lookup_worker_probes_total": (
        "counter",
        "Fleet-query probes and reserves answered, by result: ok, unsupported (the engine "
        "cannot look up without a load), error (the engine raised), malformed (ignored).",
    ),
    "broker_lookup_worker_reservations_total": (
        "counter",
        "Reservations for routed requests, by result: reserved, refused_full, released_ttl, "
        "released_lookup, released_shutdown, unsupported, engine_errors.",
    ),
    "broker_lookup_worker_reservations": ("gauge", "Reservations the rank holds now."),
}
#: Probe results and reservation events (``probe_<result>``, ``reservation_<event>`` counts).
_PROBE_RESULTS = ("ok", "unsupported", "error", "malformed")
_RESERVATION_EVENTS = (
    "reserved",
    "refused_full",
    "released_ttl",
    "released_lookup",
    "released_shutdown",
    "unsupported",
    "engine_errors",
)


#: Metrics of the process, exported by both collectors: name -> (type, help).
PROCESS_METRICS: dict[str, tuple[str, str]] = {
    "broker_lookup_lmcache_info": (
        "gauge",
        "1, labelled with the version of LMCache this process has imported (none: not imported).",
    ),
}


#: Metrics of ``broker-lookup exporter`` itself: name -> (type, help).
EXPORTER_METRICS: dict[str, tuple[str, str]] = {
    "broker_lookup_exporter_snapshots": (
        "gauge",
        "Metrics snapshots read at this scrape, by state (read: one per live scheduler and "
        "rank; malformed: not decoded, skipped; denied: the ACL user may not read it).",
    ),
    "broker_lookup_engine_split": (
        "gauge",
        "1 while this namespace is one side of a split engine: its scheduler misses ranks "
        "that serve another namespace of the same configured engine id, or its ranks serve "
        "no scheduler while such a one exists (give every process one explicit engine id).",
    ),
    "broker_lookup_redis_up": (
        "gauge",
        "1 when this scrape read Redis, 0 when Redis did not answer (the scrape itself "
        "succeeds, so Prometheus's up still says whether the exporter answers).",
    ),
}


def _exposed(name: str, kind: str) -> set[str]:
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count"}
    return {name}


#: Every series name a scrape can contain (histograms expand to _bucket/_sum/_count).
METRIC_NAMES: frozenset[str] = frozenset(
    n
    for name, (kind, _) in {
        **CLIENT_METRICS,
        **WORKER_METRICS,
        **PROCESS_METRICS,
        **EXPORTER_METRICS,
    }.items()
    for n in _exposed(name, kind)
)

#: Script answers of ``report.lua`` counted as ``reports_total{result}``.
_REPORT_RESULTS = (
    "complete",
    "recorded",
    "dropped",
    "stale",
    "duplicate",
    "unknown_rank",
    "invalid",
    "settled",
    "fenced",
    "error",
)
#: Answers of ``progress.lua`` counted as ``progress_total{result}``.
_PROGRESS_RESULTS = (
    "recorded",
    "behind",
    "reported",
    "settled",
    "dropped",
    "stale",
    "unknown_rank",
    "invalid",
    "fenced",
    "error",
    "overflow",
)
_KEEP_RESULTS = ("kept", "unknown", "unsupported")
#: Server count -> ``reports_dropped_total{reason}``: reports that changed nothing.
_DROP_REASONS = {
    "report_dropped": "late",
    "report_stale": "stale",
    "report_duplicate": "duplicate",
    "report_skipped_aborted": "aborted",
    "report_unknown": "unknown",
    "report_after_keep": "kept",
}


class _ClientLike(Protocol):
    def stats(self) -> ClientStats: ...


class _ServerLike(Protocol):
    def stats(self) -> RankStats: ...


def _help(name: str) -> str:
    return {**CLIENT_METRICS, **WORKER_METRICS, **PROCESS_METRICS}[name][1]


def _counter(name: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, _help(name), labels=list(labels))


def _gauge(name: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _help(name), labels=list(labels))


def _histogram(name: str, hist: Histogram, labels: Mapping[str, str]) -> HistogramMetricFamily:
    """The family of one in-memory histogram, with Prometheus's bucket labels."""
    family = HistogramMetricFamily(name, _help(name), labels=list(labels))
    _add_histogram(family, hist, list(labels.values()))
    return family


#: Which LMCache a process runs (None: none); by default, this process.
VersionSource = Callable[[], str | None]


def _lmcache_info(version: VersionSource) -> GaugeMetricFamily:
    """``broker_lookup_lmcache_info{version}``: which LMCache the process runs."""
    family = _gauge("broker_lookup_lmcache_info", ["version"])
    family.add_metric([version() or "none"], 1.0)
    return family


def _add_histogram(family: HistogramMetricFamily, hist: Histogram, values: list[str]) -> None:
    buckets = [
        ("+Inf" if bound == math.inf else repr(bound), float(count))
        for bound, count in hist.cumulative()
    ]
    family.add_metric(values, buckets, hist.total)


def _rank_families(insights: InsightsStats | None) -> Iterator[Metric]:
    """The ``rank_*`` families from ``stats().rank_insights`` (empty when it is off)."""
    ranks = insights.ranks if insights is not None else {}
    order = sorted(ranks)
    report = HistogramMetricFamily(
        "broker_lookup_client_rank_report_seconds",
        _help("broker_lookup_client_rank_report_seconds"),
        labels=["rank"],
    )
    for rank in order:
        row = ranks[rank]
        _add_histogram(report, Histogram.of(row.report_counts, row.report_sum), [str(rank)])
    yield report
    labels = [str(rank) for rank in order]
    rows = [ranks[rank] for rank in order]
    for name, values in (
        ("broker_lookup_client_rank_last_total", [row.last for row in rows]),
        ("broker_lookup_client_rank_excess_lookups_total", [row.excess_lookups for row in rows]),
        ("broker_lookup_client_rank_excess_tokens_total", [row.excess_tokens for row in rows]),
        ("broker_lookup_client_rank_late_total", [row.late for row in rows]),
    ):
        family = _counter(name, ["rank"])
        for label, value in zip(labels, values, strict=True):
            family.add_metric([label], float(value))
        yield family
    spread = HistogramMetricFamily(
        "broker_lookup_client_rank_spread_tokens",
        _help("broker_lookup_client_rank_spread_tokens"),
        labels=[],
    )
    # A snapshot of an older client says "off" with no ranks rather than None.
    if insights is not None and ranks:
        hist = Histogram.of(insights.spread_counts, insights.spread_sum, SPREAD_BUCKETS)
        _add_histogram(spread, hist, [])
    yield spread


class ClientCollector(Collector):
    """Exports a lookup client's ``stats()`` (scheduler process) at scrape time.

    Args:
        client: anything whose ``stats()`` returns :class:`ClientStats`.
        lmcache_version: which LMCache the client's process runs (default: this one's).
    """

    def __init__(
        self, client: _ClientLike, lmcache_version: VersionSource = running_lmcache_version
    ) -> None:
        self._client = client
        self._version = lmcache_version

    def collect(self) -> Iterator[Metric]:
        """Yield one family per name of :data:`CLIENT_METRICS`."""
        st = self._client.stats()
        lookups = _counter("broker_lookup_client_lookups_total", ["outcome"])
        outcomes = st.outcomes
        for outcome in sorted({*OUTCOMES, *outcomes}):
            lookups.add_metric([outcome], float(outcomes.get(outcome, 0)))
        yield lookups
        latency = Histogram.of(st.latency_counts, st.latency_sum)
        yield _histogram("broker_lookup_client_latency_seconds", latency, {})
        rejected = _counter("broker_lookup_client_rejected_total", ["reason"])
        for kind, count in sorted(st.rejected.items()):
            rejected.add_metric([kind], float(count))
        yield rejected
        for name, value in (
            ("broker_lookup_client_hit_tokens_total", st.hit_tokens),
            ("broker_lookup_client_redis_errors_total", st.redis_errors),
            ("broker_lookup_client_truncated_total", st.truncated),
            ("broker_lookup_client_breaker_openings_total", st.breaker_openings),
            ("broker_lookup_client_owner_conflicts_total", st.ownership.conflicts),
        ):
            family = _counter(name)
            family.add_metric([], float(value))
            yield family
        for name, value in (
            ("broker_lookup_client_inflight", st.inflight),
            ("broker_lookup_client_dead_ranks", len(st.dead_ranks)),
            ("broker_lookup_client_breaker_open", st.breaker_open),
            ("broker_lookup_client_owner", st.ownership.owner),
        ):
            gauge = _gauge(name)
            gauge.add_metric([], float(value))
            yield gauge
        yield from _rank_families(st.rank_insights)
        yield _lmcache_info(self._version)


class ServerCollector(Collector):
    """Exports one worker rank's ``RedisAsyncLookupServer.stats()`` at scrape time.

    Args:
        server: the rank's server (anything whose ``stats()`` returns :class:`RankStats`).
        clock: wall clock for the heartbeat age (tests pass their own).
        lmcache_version: which LMCache the rank's process runs (default: this one's).
    """

    def __init__(
        self,
        server: _ServerLike,
        clock: Any = time.time,
        lmcache_version: VersionSource = running_lmcache_version,
    ) -> None:
        self._server = server
        self._clock = clock
        self._version = lmcache_version

    def collect(self) -> Iterator[Metric]:
        """Yield one family per name of :data:`WORKER_METRICS`, each labelled ``rank``."""
        st = self._server.stats()
        rank = str(st.rank)
        counts = st.counts
        consumer = st.consumer
        yield from self._simple(rank, st)
        engine = Histogram.of(st.engine_seconds, st.engine_seconds_sum)
        yield _histogram("broker_lookup_worker_engine_seconds", engine, {"rank": rank})
        yield self._by_label(
            "broker_lookup_worker_reports_total",
            "result",
            rank,
            {r: counts.get("report_" + r, 0) for r in _REPORT_RESULTS},
        )
        yield self._by_label(
            "broker_lookup_worker_reports_dropped_total",
            "reason",
            rank,
            {reason: counts.get(key, 0) for key, reason in _DROP_REASONS.items()},
        )
        yield self._by_label(
            "broker_lookup_worker_progress_total",
            "result",
            rank,
            {r: counts.get("progress_" + r, 0) for r in _PROGRESS_RESULTS},
        )
        keeps = {r: counts.get("keep_" + r, 0) for r in _KEEP_RESULTS}
        yield self._by_label("broker_lookup_worker_keeps_total", "result", rank, keeps)
        probes = {r: counts.get("probe_" + r, 0) for r in _PROBE_RESULTS}
        yield self._by_label("broker_lookup_worker_probes_total", "result", rank, probes)
        events = {e: counts.get("reservation_" + e, 0) for e in _RESERVATION_EVENTS}
        yield self._by_label("broker_lookup_worker_reservations_total", "result", rank, events)
        by_reason = consumer.dead_letter_reasons or {"all": consumer.dead_letters}
        yield self._by_label("broker_lookup_worker_dead_letters_total", "reason", rank, by_reason)
        yield self._by_label(
            "broker_lookup_worker_lookups",
            "state",
            rank,
            {"running": st.running, "waiting": st.waiting, "held": st.held},
            gauge=True,
        )
        yield _lmcache_info(self._version)

    def _simple(self, rank: str, st: RankStats) -> Iterator[Metric]:
        beat = st.last_heartbeat
        own, counts, consumer = st.ownership, st.counts, st.consumer
        values: dict[str, float] = {
            "broker_lookup_worker_owner": float(own.owner),
            "broker_lookup_worker_owner_conflicts_total": own.conflicts,
            "broker_lookup_worker_owner_lost_total": own.lost,
            "broker_lookup_worker_requests_total": counts.get("requests", 0),
            "broker_lookup_worker_expired_total": counts.get("expired", 0),
            "broker_lookup_worker_trimmed_total": consumer.trimmed,
            "broker_lookup_worker_aborts_total": counts.get("aborts", 0),
            "broker_lookup_worker_engine_errors_total": counts.get("engine_errors", 0),
            "broker_lookup_worker_reservations": counts.get("reservations_held", 0),
            "broker_lookup_worker_redis_errors_total": consumer.redis_errors + st.reporter_errors,
            "broker_lookup_worker_group_pending": consumer.pending,
            "broker_lookup_worker_group_lag": consumer.lag,
            # Never beaten yet: infinitely old, so the staleness alert sees it.
            "broker_lookup_worker_heartbeat_age_seconds": (
                max(0.0, self._clock() - beat) if beat else math.inf
            ),
        }
        for name, value in values.items():
            kind = WORKER_METRICS[name][0]
            family = _counter(name, ["rank"]) if kind == "counter" else _gauge(name, ["rank"])
            family.add_metric([rank], float(value))
            yield family

    @staticmethod
    def _by_label(
        name: str, label: str, rank: str, values: Mapping[str, int], gauge: bool = False
    ) -> Metric:
        family = _gauge(name, ["rank", label]) if gauge else _counter(name, ["rank", label])
        for key in sorted(values):
            family.add_metric([rank, key], float(values[key]))
        return family
