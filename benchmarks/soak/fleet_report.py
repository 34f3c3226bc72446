"""The fleet soak's summary: what ran, what it cost the server, and the checks.

The figures an operator sizes a shard with: ``lookups_per_s`` (what the fleet sent, all
engines together) and ``redis_cpu_us_per_lookup`` (the server's CPU, system + user,
over the run, divided by the lookups): one core of the server serves about
``1e6 / redis_cpu_us_per_lookup`` lookups a second, so at a fleet's rate of lookups per
engine that many engines (``lookups_per_s_per_redis_core``). ``redis_cpu_share`` is how
busy the server was at this load.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import redis

from benchmarks.soak.fleet_checks import (
    Features,
    audit_keys,
    judge,
    judge_memory,
    passed,
)
from benchmarks.soak.fleet_duplicates import Duplicates
from benchmarks.soak.fleet_engine import Engine
from benchmarks.soak.report import COUNTS
from benchmarks.soak.server_stats import ServerStats, scan_keys

__all__ = ["fleet_summary", "format_fleet_summary"]

_EXAMPLES = 10  #: diagnosed lookups kept per verdict, over all engines


def fleet_summary(
    engines: Sequence[Engine],
    dups: Duplicates,
    stats: ServerStats,
    monitor: redis.Redis,
    features: Features,
    engine_ttl_ms: int | None,
    embedded: bool,
    run: dict[str, Any],
) -> dict[str, Any]:
    """Everything counted, the keys left audited now, and every check judged."""
    rows = scan_keys(monitor, [e.engine_id for e in engines], everything=embedded)
    gone_at = {e.engine_id: e.gone_at for e in engines if e.gone_at is not None}
    audit = audit_keys(rows, gone_at, time.monotonic(), engine_ttl_ms)
    memory = judge_memory([s["used_memory"] for s in stats.series])
    counts = _counts(engines, dups)
    checks = judge(counts, audit, memory, features, dups.rank is not None)
    seconds = run["seconds"]
    lookups = run["after"]["lookups"] - run["before"]["lookups"]
    cpu_s = run["after"]["cpu_s"] - run["before"]["cpu_s"]
    stopped = Counter(e.signal for e in engines)
    return {
        "features": {"ownership": features.ownership, "engine_ttl": features.engine_ttl},
        "engine_ttl_ms": engine_ttl_ms,
        "engines": {
            "slots": len({e.slot for e in engines}),
            "started": len(engines),
            "stopped_term": stopped["term"],
            "stopped_kill": stopped["kill"],
            "stopped_at_end": stopped["end"],
            "faulty": sorted({e.slot for e in engines if e.faulty}),
            "churn_planned": len(run["plan"]),
        },
        "duration_s": round(seconds, 1),
        "lookups_per_s": round(lookups / seconds, 1),
        "redis_cpu_s": round(cpu_s, 3),
        "redis_cpu_share": round(cpu_s / seconds, 3),
        "redis_cpu_us_per_lookup": round(cpu_s * 1e6 / lookups, 1) if lookups else None,
        "lookups_per_s_per_redis_core": round(lookups / cpu_s) if lookups and cpu_s else None,
        **counts,
        "faults": dict(sorted(sum((Counter(e.log.counts()) for e in engines), Counter()).items())),
        "term_exit_codes": dict(
            Counter(c for e in engines if e.signal != "kill" for c in e.exit_codes)
        ),
        "keys": {k: v for k, v in audit.items() if k != "by_gone_engine"},
        "keys_by_gone_engine": audit["by_gone_engine"],
        "memory": memory,
        "memory_series": stats.series,
        "duplicates": dups.report(),
        "checks": checks,
        "passed": passed(checks),
        "diagnosis": _diagnosis(engines),
        "engine_log": [e.record() for e in engines],
    }


def _counts(engines: Sequence[Engine], dups: Duplicates) -> dict[str, int]:
    total: Counter[str] = Counter()
    for engine in engines:
        total.update({k: engine.traffic.counts[k] for k in COUNTS})
    out = {k: total[k] for k in COUNTS}
    out["unexpected_exits"] = sum(len(e.unexpected_exits) for e in engines)
    dup = dups.traffic.counts if dups.traffic is not None else Counter()
    # Its answers other than 0; a client that raised instead of answering counts once.
    out["duplicate_answers"] = dup["wrong"] + (1 if dups.refused else 0)
    out["hangs"] += dup["hangs"]
    return out


def _diagnosis(engines: Sequence[Engine]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for engine in engines:
        for verdict, examples in engine.log.examples.items():
            kept = out.setdefault(verdict, [])
            room = _EXAMPLES - len(kept)
            kept += [{"engine": engine.engine_id, **e} for e in examples[:room]]
    return out


def format_fleet_summary(s: dict[str, Any]) -> str:
    """The summary for a person: the fleet, the figures, memory over time, the checks."""
    e = s["engines"]
    keys = s["keys"]
    mem = s["memory"]
    series = " ".join(f"{m['t_s']:g}s:{m['used_memory'] / 2**20:.1f}" for m in s["memory_series"])
    lines = [
        f"fleet soak: {e['slots']} engines at a time, {e['started']} started, stopped "
        f"{e['stopped_term']} by SIGTERM and {e['stopped_kill']} by SIGKILL, "
        f"{e['stopped_at_end']} at the end; faults on slots {e['faulty']}: "
        + (", ".join(f"{k} {v}" for k, v in s["faults"].items()) or "none"),
        f"{s['duration_s']} s, {s['lookups']} lookups ({s['lookups_per_s']}/s): {s['right']} "
        f"right, {s['zero']} zero; wrong {s['wrong']}, hangs {s['hangs']}, lost hits "
        f"{s['lost_hits']} (of {s['quiet_hits']} judged), unexpected rank exits "
        f"{s['unexpected_exits']}",
        f"Redis CPU {s['redis_cpu_s']} s ({s['redis_cpu_share']:.0%} of a core): "
        f"{s['redis_cpu_us_per_lookup']} us per lookup, "
        f"{s['lookups_per_s_per_redis_core']} lookups/s per Redis core",
        f"used_memory MiB over time: {series}",
        f"memory: {json.dumps(mem, sort_keys=True)}",
        f"keys at the end: {keys['keys']}; without a TTL {len(keys['no_ttl'])} (streams "
        f"without one: {len(keys['streams_without_ttl'])}); of gone engines "
        f"{keys['gone_keys']} in {keys['gone_engines_with_keys']} engines, max PTTL "
        f"{keys['gone_max_pttl_ms']} ms; overdue {len(keys['overdue'])} "
        f"(engine TTL {s['engine_ttl_ms']} ms)",
        f"duplicates: {json.dumps(s['duplicates'], sort_keys=True)}",
    ]
    for name, check in s["checks"].items():
        state = "enforced" if check["enforced"] else f"not enforced: {check['why']}"
        lines.append(f"check {name}: {check['value']} ({state})")
    for verdict, examples in s["diagnosis"].items():
        lines += [f"{verdict}: {json.dumps(x, sort_keys=True)}" for x in examples]
    lines.append("PASSED" if s["passed"] else "FAILED")
    return "\n".join(lines)
