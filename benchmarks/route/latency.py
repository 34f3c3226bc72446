"""The fleet query's own cost in ``python -m benchmarks.route``: latency and Redis CPU.

``n`` engines of one rank each, real processes (``benchmarks.bench.our_ranks``: a stub
engine answering at once, so the figure is the query's path, not an engine's), asked one
query at a time over all of them. Redis's CPU per query is the ``used_cpu`` delta over
the queries less the idle ranks' own (heartbeats, blocked reads) over as long a time
measured right after; the commands per query, and the µs the server timed inside them,
come from ``INFO commandstats`` deltas.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from benchmarks.bench.measure import BenchOptions, Prompts, summarize_ns
from benchmarks.bench.ours import engine_id, rank_host
from broker_lookup import FleetClient, LookupConfig

__all__ = ["query_cost"]

_IDLE_MAX_S = 5.0


def _redis_cpu(server: redis.Redis) -> float:
    info: Any = server.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _calls(server: redis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and µs so far per command."""
    info: Any = server.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()}


def query_cost(url: str, run_id: str, n: int, queries: int, warmup: int) -> dict[str, Any]:
    """``queries`` fleet queries over ``n`` engines: p50/p99 and Redis's cost per query."""
    ids = [engine_id(run_id, f"q{n}-{i}") for i in range(n)]
    opts = BenchOptions.defaults(False)
    prompt = Prompts(4096, seed=3).get(0)
    server = redis.Redis.from_url(url)
    fleet = FleetClient(LookupConfig(redis_url=url), deadline_ms=100)
    try:
        with rank_host(opts, url, dict.fromkeys(ids, 1)):
            for _ in range(warmup):
                fleet.query(prompt, engines=ids)
            cpu0, calls0, t0 = _redis_cpu(server), _calls(server), time.monotonic()
            samples, short = [], 0
            for _ in range(queries):
                a = time.perf_counter_ns()
                answer = fleet.query(prompt, engines=ids)
                samples.append(time.perf_counter_ns() - a)
                short += any(len(e.answered) < len(e.expected) for e in answer.engines)
            spent, wall = _redis_cpu(server) - cpu0, time.monotonic() - t0
            calls1 = _calls(server)
            idle_s = min(wall, _IDLE_MAX_S)
            cpu1 = _redis_cpu(server)
            time.sleep(idle_s)
            idle = (_redis_cpu(server) - cpu1) * wall / idle_s
    finally:
        fleet.close()
        server.close()
    commands, command_us = {}, 0
    for k, (calls, usec) in calls1.items():
        before = calls0.get(k, (0, 0))
        if calls > before[0] and k != "info":
            commands[k] = round((calls - before[0]) / queries, 2)
            command_us += usec - before[1]
    return {
        "engines": n,
        "queries": queries,
        "latency": summarize_ns(samples),
        "queries_with_a_rank_late": short,
        "redis_cpu_us_per_query": max(0.0, spent - idle) * 1e6 / queries,
        "redis_cpu_us_per_query_gross": spent * 1e6 / queries,
        "commandstats_us_per_query": command_us / queries,
        "commands_per_query": dict(sorted(commands.items(), key=lambda kv: -kv[1])),
    }
