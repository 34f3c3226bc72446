"""Concurrent engines for ``python -m benchmarks.bench``: one driver process per engine.

Each engine is what one vLLM scheduler would be: its own engine id, its own process with
one :class:`RedisAsyncLookupClient`, its own ranks. All drivers share one Redis. The
bench starts every driver, waits until all are ready, says ``go`` to each, and adds up
their throughputs. Run as ``python -m benchmarks.bench.engines`` it is one driver.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import redis

from benchmarks.bench.children import Child, emit, stop_all
from benchmarks.bench.measure import BenchOptions, Prompts, closed_loop, cpu_seconds_of
from benchmarks.bench.ours import client_for, engine_id, rank_host
from broker_lookup.processes import ExitCode, python_module

__all__ = ["concurrency", "main", "ranks_per_engine"]

_GO_TIMEOUT_S = 120.0


def ranks_per_engine(opts: BenchOptions, engines: int) -> int:
    """4 ranks per engine up to 4 engines (16 rank processes), else 1 (2 cores!); quick: 1."""
    return 1 if opts.quick or engines > 4 else 4


def _driver_argv(opts: BenchOptions, url: str, eid: str, world: int, window: int) -> list[str]:
    return python_module(
        "benchmarks.bench.engines",
        [
            *("--redis-url", url, "--engine-id", eid, "--world-size", str(world)),
            *("--window", str(window), "--duration", str(opts.duration_s)),
            *("--tokens", str(opts.tokens), "--poll-us", str(opts.poll_us)),
        ],
    )


def _aggregate(results: list[dict[str, Any]], cpu: dict[str, float]) -> dict[str, Any]:
    completed = sum(r["completed"] for r in results)
    per_1000 = 1000 / max(1, completed)
    return {
        "lookups_per_s": sum(r["lookups_per_s"] for r in results),
        "completed": completed,
        "per_engine_lookups_per_s": [round(r["lookups_per_s"], 1) for r in results],
        "p50_ms_max": max(r["latency"]["p50_ms"] for r in results),
        "p99_ms_max": max(r["latency"]["p99_ms"] for r in results),
        "cpu_per_1000": {
            "clients": sum(r["cpu_s"] for r in results) * per_1000,
            "ranks": cpu["ranks"] * per_1000,
            "redis": cpu["redis"] * per_1000,
        },
    }


def _redis_cpu(server: redis.Redis) -> float:
    info: Any = server.info("cpu")
    return float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0))


def concurrency(opts: BenchOptions, url: str, run_id: str, engines: int) -> dict[str, Any]:
    """Aggregate throughput of ``engines`` drivers sharing ``opts.window`` lookups in flight."""
    world = ranks_per_engine(opts, engines)
    window = max(1, opts.window // engines)
    ids = [engine_id(run_id, f"e{engines}x{i}") for i in range(engines)]
    drivers: list[Child] = []
    server = redis.Redis.from_url(url)
    try:
        with rank_host(opts, url, dict.fromkeys(ids, world)) as pids:
            env = dict(os.environ)
            for eid in ids:
                argv = _driver_argv(opts, url, eid, world, window)
                drivers.append(Child(f"driver {eid}", argv, env))
            for d in drivers:
                d.expect("ready", opts.startup_timeout_s)
            rank_pids = [p for by_rank in pids.values() for p in by_rank.values()]
            start = {"ranks": cpu_seconds_of(rank_pids), "redis": _redis_cpu(server)}
            for d in drivers:
                d.send("go")
            results = [json.loads(d.expect("result", _GO_TIMEOUT_S)) for d in drivers]
            cpu = {
                "ranks": cpu_seconds_of(rank_pids) - start["ranks"],
                "redis": _redis_cpu(server) - start["redis"],
            }
    finally:
        stop_all(drivers)
        server.close()
    out = _aggregate(results, cpu)
    out.update(engines=engines, ranks_per_engine=world, window_per_engine=window)
    return out


def main(argv: list[str] | None = None) -> int:
    """One driver: connect, say ready, wait for ``go``, run the closed loop, print the result."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.engines")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--window", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--poll-us", type=float, default=50.0)
    args = p.parse_args(argv)
    client = client_for(args.redis_url, args.engine_id, args.world_size)
    try:
        emit("ready", args.engine_id)
        if sys.stdin.readline().strip() != "go":
            return ExitCode.FAILED
        cpu0 = time.process_time()
        run = closed_loop(
            client, Prompts(args.tokens), args.window, args.duration, args.poll_us / 1e6, "c"
        )
        run["cpu_s"] = time.process_time() - cpu0
        emit("result", json.dumps(run))
        return ExitCode.OK
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
