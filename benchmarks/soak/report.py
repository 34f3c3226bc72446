"""What ``python -m benchmarks.soak`` reports: the counts, the verdict, and the text for a person.

The soak passes iff every count in :data:`MUST_BE_ZERO` is 0 (:func:`passed`); everything
else in the summary (faults by kind, latency, memory, breaker) is there to be read.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.soak.faults import FaultLog
from benchmarks.soak.traffic import Traffic
from broker_lookup.protocol.stats import ClientStats

__all__ = ["COUNTS", "MUST_BE_ZERO", "format_summary", "passed", "summarize"]

#: The counts that fail the soak unless they are 0.
MUST_BE_ZERO = ("wrong", "hangs", "leaked_keys", "lost_hits")
#: Every lookup count of the summary.
COUNTS = ("lookups", "right", "zero", "cancels", "reused_ids", "quiet_hits", *MUST_BE_ZERO)


def summarize(
    traffic: Traffic, log: FaultLog, stats: ClientStats, leaked: list[str]
) -> dict[str, Any]:
    """The traffic's counts, the faults, and the client's ``stats()`` that tell how it coped."""
    out: dict[str, Any] = {k: traffic.counts[k] for k in COUNTS}
    out.update(
        faults=log.counts(),
        faults_unfired=log.unfired(),
        leaked_keys=len(leaked),
        leaked_examples=leaked[:5],
        p99_latency_ms=traffic.p99_ms(),
        breaker_openings=stats.breaker_openings,
        rejected=stats.rejected,
        client_outcomes=stats.outcomes,
        client_redis_errors=stats.redis_errors,
        slowest_recovery=traffic.slowest_recovery,
        quiet_s=log.quiet_s,
        diagnosis=log.examples,
        fault_log=[f.describe(log.origin) for f in log.faults],
    )
    return out


def passed(summary: dict[str, Any]) -> bool:
    """Whether no lookup was wrong, hung or lost its hit, and no key leaked."""
    return all(summary[k] == 0 for k in MUST_BE_ZERO)


def format_summary(s: dict[str, Any]) -> str:
    """The summary for a person: what ran, what broke, and the counts that must be 0."""
    faults = ", ".join(f"{k} {v}" for k, v in s["faults"].items()) or "none"
    rss = ", ".join(
        f"{name} {s['rss_kb_start'].get(name)} -> {kb}" for name, kb in s["rss_kb_end"].items()
    )
    recovery = ", ".join(f"{k} {v['lag_s']}" for k, v in sorted(s["slowest_recovery"].items()))
    lines = [
        f"soak: {s['duration_s']} s, {s['lookups']} lookups ({s['right']} right, "
        f"{s['zero']} zero, {s['cancels']} cancelled, {s['reused_ids']} reused ids)",
        f"faults: {faults}; lost replies armed but not triggered: {s['faults_unfired']}",
        f"wrong {s['wrong']}, hangs {s['hangs']}, leaked keys {s['leaked_keys']}, "
        f"lost hits {s['lost_hits']} (of {s['quiet_hits']} hits looked up with no fault)",
        f"slowest recovery (a 0 for a hit, s after the fault ended; quiet time {s['quiet_s']} s):"
        f" {recovery or 'none'}",
        f"p99 {s['p99_latency_ms']} ms; breaker openings {s['breaker_openings']}; "
        f"rejected {s['rejected']}",
        f"RSS KiB start -> end: {rss}",
    ]
    for verdict, examples in s["diagnosis"].items():
        lines += [f"{verdict}: {json.dumps(e, sort_keys=True)}" for e in examples]
    return "\n".join(lines)
