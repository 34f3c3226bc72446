"""Prometheus metric names and the collectors that export them.

Counters live as plain integers inside the client and the server (nothing is
added to the scheduler's hot path); the collectors below read them at scrape
time. No metric carries a per-lookup label.
"""

from __future__ import annotations

__all__ = ["CLIENT_METRICS", "METRIC_NAMES", "WORKER_METRICS"]

#: Client-side metrics (scheduler process): name -> (type, help).
CLIENT_METRICS: dict[str, tuple[str, str]] = {
    "broker_lookup_client_lookups_total": (
        "counter",
        "Finished lookups by outcome (hit, miss, timeout, cancelled, dead_rank, error).",
    ),
    "broker_lookup_client_latency_seconds": (
        "histogram",
        "Time from lookup() to the result being available to lookup_cache().",
    ),
    "broker_lookup_client_hit_tokens_total": ("counter", "Sum of hit tokens over finished lookups."),
    "broker_lookup_client_inflight": ("gauge", "Lookups submitted and not finished."),
    "broker_lookup_client_redis_errors_total": ("counter", "Redis errors seen by client threads."),
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
    "broker_lookup_worker_aborts_total": ("counter", "Abort entries handled."),
    "broker_lookup_worker_group_pending": ("gauge", "Entries delivered to the rank, not acked."),
    "broker_lookup_worker_group_lag": ("gauge", "Entries not yet delivered to the rank's group."),
    "broker_lookup_worker_heartbeat_age_seconds": ("gauge", "Seconds since the last heartbeat."),
    "broker_lookup_worker_redis_errors_total": ("counter", "Redis errors seen by the rank loop."),
}


def _exposed(name: str, kind: str) -> set[str]:
    if kind == "histogram":
        return {name + "_bucket", name + "_sum", name + "_count"}
    return {name}


#: Every series name a scrape can contain (histograms expand to _bucket/_sum/_count).
METRIC_NAMES: frozenset[str] = frozenset(
    n for name, (kind, _) in {**CLIENT_METRICS, **WORKER_METRICS}.items() for n in _exposed(name, kind)
)
