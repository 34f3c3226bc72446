"""The table of ``python -m benchmarks.route``."""

from __future__ import annotations

from typing import Any

__all__ = ["render"]


def render(result: dict[str, Any]) -> str:
    """The arms and the query's cost as plain-text tables."""
    s = result["settings"]
    lines = [
        f"{s['engines']} engines of {s['capacity']} chunks ({s['requests']} requests an arm, "
        f"{s['in_flight']} in flight, {s['rate']:g}/s, {s['restarts']} restarts, seed "
        f"{s['seed']}); load average {result['load_average'][0][0]:.1f} -> "
        f"{result['load_average'][1][0]:.1f} on {result['cpus']} CPUs, {result['seconds']} s",
        f"  {'policy':<30}{'reused tok/req':>15}{'expected':>10}{'routed exp.':>12}"
        f"{'false hits':>11}{'rate':>9}{'restart*':>9}{'rate w/o':>9}{'short':>6}{'other':>6}",
    ]
    for name, arm in result["arms"].items():
        lines.append(
            f"  {name:<30}{arm['tokens_reused_per_request']:>15.1f}"
            f"{arm['expected_per_request']:>10.1f}{arm['routed_expecting']:>12}"
            f"{arm['false_hits']:>11}{100 * arm['false_hit_rate']:>8.2f}%"
            f"{arm['false_hits_restart']:>9}{100 * arm['false_hit_rate_no_restart']:>8.2f}%"
            f"{arm['false_hits_reserved_short']:>6}{arm['false_hits_unexplained']:>6}"
        )
    lines.append(
        "  * restart: the engine restarted between the route and its own lookup (counted: the"
        " lookup found fewer; inherent: its cache and reservations died with it); short: the"
        " reservation pinned less than the query found; other: neither"
    )
    lines.append(
        f"  {'query over':<12}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'Redis µs/query':>16}"
        f"{'gross':>8}{'in cmds':>9}  commands per query"
    )
    for q in result["query_cost"]:
        lat = q["latency"]
        top = ", ".join(f"{k} {v:g}" for k, v in list(q["commands_per_query"].items())[:5])
        lines.append(
            f"  {str(q['engines']) + ' engines':<12}{lat['p50_ms']:>8.2f}{lat['p99_ms']:>8.2f}"
            f"{lat['max_ms']:>8.2f}{q['redis_cpu_us_per_query']:>16.0f}"
            f"{q['redis_cpu_us_per_query_gross']:>8.0f}"
            f"{q['commandstats_us_per_query']:>9.0f}  {top}"
        )
    return "\n".join(lines)
