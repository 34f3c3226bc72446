"""``python -m benchmarks.bench --features-cost``: the optional features' cost per lookup.

Each round runs the same one-in-flight loop as the latency figure
(:func:`measure.sequential_latency`), then the throughput figure's closed loop with
``window`` lookups in flight (:func:`measure.closed_loop`), through the same ranks, with
the client's features off (:data:`OFF`: no rank insights, a flat deadline, no partial
answers) or on (:data:`ON`: the defaults, plus partial answers). Rounds go in ABBA order
(off, on, on, off), so a drift of the machine's load during the run falls on both sides
alike. Each side's figure is the mean over its two rounds: e2e p50/p99 and CPU per lookup
with one in flight (the scheduler process, Redis, where the scripts' extra
``TIME``/``HSET`` run, and one rank), then the rate and CPU per lookup (Redis, and all
processes together) with ``window`` in flight, where the per-lookup costs of the
features add up instead of hiding behind the wake-ups. The ratio on / off is the cost.

>>> out = features_cost(BenchOptions.defaults(quick=True), url, "r1")   # doctest: +SKIP
>>> out["ratio"]["e2e_p50_ms"]                                         # doctest: +SKIP
1.01
"""

from __future__ import annotations

import statistics
from typing import Any

import redis

from benchmarks.bench.measure import (
    BenchError,
    BenchOptions,
    Prompts,
    closed_loop,
    sequential_latency,
)
from benchmarks.bench.ours import CpuMeter, client_for, engine_id, rank_host

__all__ = ["FIGURES", "OFF", "ON", "features_cost", "render_features_cost"]

#: The figures compared, as (key, label).
FIGURES = (
    ("e2e_p50_ms", "e2e p50 ms"),
    ("e2e_p99_ms", "e2e p99 ms"),
    ("scheduler_cpu_us", "scheduler CPU µs/lookup"),
    ("redis_cpu_us", "Redis CPU µs/lookup"),
    ("rank_cpu_us_per_rank", "rank CPU µs/lookup/rank"),
    ("inflight_lookups_per_s", "in flight: lookups/s"),
    ("inflight_redis_cpu_us", "in flight: Redis CPU µs/lookup"),
    ("inflight_total_cpu_us", "in flight: all CPU µs/lookup"),
)
_ORDER = (False, True, True, False)  #: ABBA
#: CPU meters that make "all CPU" with many in flight: the client's process, ranks, Redis.
_ALL_CPU = ("client_process", "ranks", "redis")
#: The client's config with every issue-13 feature off, and with all of them on.
OFF: dict[str, Any] = {
    "rank_insights": False,
    "lookup_timeout_per_1k_tokens_ms": 0,
    "partial_answers": False,
}
ON: dict[str, Any] = {
    "rank_insights": True,
    "lookup_timeout_per_1k_tokens_ms": 10,
    "partial_answers": True,
}


def _round(
    opts: BenchOptions, url: str, eid: str, world: int, pids: list[int], on: bool, n: int, tag: str
) -> dict[str, Any]:
    server = redis.Redis.from_url(url)
    client = client_for(url, eid, world, **(ON if on else OFF))
    try:
        prompts = Prompts(opts.tokens)
        meter = CpuMeter(pids, server)
        run = sequential_latency(client, prompts, n, opts.warmup, opts.poll_s, tag)
        run["cpu_per_1000"] = meter.per_1000(n + opts.warmup)
        meter = CpuMeter(pids, server)
        tput = closed_loop(client, prompts, opts.window, opts.duration_s, opts.poll_s, tag + "-tp")
        run["inflight"] = {**tput, "cpu_per_1000": meter.per_1000(tput["completed"])}
        insights = client.stats().rank_insights
        run["recorded"] = insights.recorded if insights is not None else 0
        return run
    finally:
        client.close()
        server.close()


def _side(rounds: list[dict[str, Any]], world: int) -> dict[str, Any]:
    def cpu(key: str, run: str | None = None) -> float:
        # per_1000 is seconds per 1,000 lookups = ms per lookup; x1000: µs per lookup.
        return statistics.fmean((r[run] if run else r)["cpu_per_1000"][key] for r in rounds) * 1000

    return {
        "e2e_p50_ms": statistics.fmean(r["e2e"]["p50_ms"] for r in rounds),
        "e2e_p99_ms": statistics.fmean(r["e2e"]["p99_ms"] for r in rounds),
        "scheduler_cpu_us": cpu("client_process"),
        "redis_cpu_us": cpu("redis"),
        "rank_cpu_us_per_rank": cpu("ranks") / world,
        "inflight_lookups_per_s": statistics.fmean(r["inflight"]["lookups_per_s"] for r in rounds),
        "inflight_redis_cpu_us": cpu("redis", "inflight"),
        "inflight_total_cpu_us": sum(cpu(k, "inflight") for k in _ALL_CPU),
        "lookups": sum(r["e2e"]["n"] for r in rounds),
        "recorded": sum(r["recorded"] for r in rounds),
    }


def features_cost(opts: BenchOptions, url: str, run_id: str, world: int = 2) -> dict[str, Any]:
    """Both sides' figures and their ratio (on / off); ``opts.lookups`` lookups a side.

    Raises:
        BenchError: a rank failed to start, a lookup never finished, or the side with
            insights on recorded none (the figure would compare nothing).
    """
    eid = engine_id(run_id, f"features-w{world}")
    per_round = max(1, opts.lookups // 2)
    rounds: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with rank_host(opts, url, {eid: world}) as pids:
        rank_pids = list(pids[eid].values())
        for i, flag in enumerate(_ORDER):
            tag = f"ins{i}-{'on' if flag else 'off'}"
            rounds[flag].append(_round(opts, url, eid, world, rank_pids, flag, per_round, tag))
    sides = {"off": _side(rounds[False], world), "on": _side(rounds[True], world)}
    if not sides["on"]["recorded"] or sides["off"]["recorded"]:
        raise BenchError(
            f"rank_insights recorded {sides['on']['recorded']} lookups on and "
            f"{sides['off']['recorded']} off"
        )
    off = sides["off"]
    ratio = {k: (sides["on"][k] / off[k] if off[k] else None) for k, _ in FIGURES}
    return {
        "world": world,
        "lookups_per_side": off["lookups"],
        "window": opts.window,
        **sides,
        "ratio": ratio,
    }


def render_features_cost(result: dict[str, Any]) -> str:
    """The table ``--features-cost`` prints."""
    lines = [
        "cost of rank insights + size-aware deadlines + partial answers "
        f"(world {result['world']}, {result['lookups_per_side']} lookups a side one in "
        f"flight, then {result['window']} in flight; rounds off/on/on/off)",
        f"  {'':<32}{'off':>9}{'on':>9}{'on/off':>9}",
    ]
    for key, label in FIGURES:
        ratio = result["ratio"][key]
        shown = "-" if ratio is None else f"{ratio:.2f}"
        lines.append(f"  {label:<32}{result['off'][key]:>9.2f}{result['on'][key]:>9.2f}{shown:>9}")
    return "\n".join(lines)
