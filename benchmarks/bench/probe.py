"""The pending-count and memory probe of ``python -m benchmarks.bench``.

Against ranks that never answer (``benchmarks.bench.our_ranks``'s ``mute`` engines), it
leaves
``n`` lookups in flight and measures what each costs: ``lookup_cache`` with 1 vs ``n``
pending, ``lookup()`` for the first vs the last 100, and Redis ``used_memory`` per lookup
once every rank has read every request, and what its keys hold (``MEMORY USAGE``
of the lookup hashes and of the request stream's growth), which other traffic on a
shared server cannot blur.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.bench.measure import BenchError, Prompts, median_us
from broker_lookup.client import RedisAsyncLookupClient

__all__ = ["call_cost_us", "pending_probe"]

_CALLS = 5_000
_REPEAT = 9
_DRAIN_TIMEOUT_S = 30.0


def call_cost_us(fn: Callable[[str], object], arg: str, calls: int = _CALLS) -> float:
    """Mean cost of ``fn(arg)`` in a tight loop, in µs: the best of a few repeats (the
    least disturbed by other processes on a busy machine)."""
    runs = []
    for _ in range(_REPEAT):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(arg)
        runs.append((time.perf_counter_ns() - t0) / calls)
    return min(runs) / 1e3


def _used_memory(server: redis.Redis) -> int:
    info: Any = server.info("memory")
    return int(info["used_memory"])


def _key_bytes(server: redis.Redis, keys: list[str]) -> int:
    """Exact MEMORY USAGE (all samples) summed over ``keys``."""
    total = 0
    for start in range(0, len(keys), 500):
        pipe = server.pipeline(transaction=False)
        for key in keys[start : start + 500]:
            pipe.memory_usage(key, samples=0)
        total += sum(int(v or 0) for v in pipe.execute())
    return total


def _all_read(client: RedisAsyncLookupClient, server: redis.Redis) -> bool:
    if client.stats().queued:
        return False
    stream = client.keys.requests
    info: Any = server.xinfo_stream(stream)
    last = info["last-generated-id"]
    groups: Any = server.xinfo_groups(stream)
    return bool(groups) and all(
        g["last-delivered-id"] == last and int(g["pending"]) == 0 for g in groups
    )


def _wait_all_read(client: RedisAsyncLookupClient, server: redis.Redis) -> None:
    deadline = time.monotonic() + _DRAIN_TIMEOUT_S
    while not _all_read(client, server):
        if time.monotonic() > deadline:
            raise BenchError("the ranks did not read every request in time")
        time.sleep(0.02)


def pending_probe(
    client: RedisAsyncLookupClient, prompts: Prompts, n: int, server: redis.Redis
) -> dict[str, Any]:
    """Leave ``n`` lookups in flight on ``client`` (ranks must be mute); return the costs."""
    lc = client.lookup_cache
    out: dict[str, Any] = {"pending": n, "lookup_cache_unknown_us": call_cost_us(lc, "no-such")}
    _wait_all_read(client, server)
    before = _used_memory(server)
    stream_before = _key_bytes(server, [client.keys.requests])
    calls: list[int] = []
    for i in range(n):
        lookup_id = f"pending-{i}"
        prompt = prompts.get(i)
        t0 = time.perf_counter_ns()
        client.lookup(prompt, lookup_id)
        calls.append(time.perf_counter_ns() - t0)
        if i == 0:
            out["lookup_cache_pending_1_us"] = call_cost_us(lc, lookup_id)
    out["lookup_cache_pending_n_us"] = call_cost_us(lc, "pending-0")
    out["lookup_cache_pending_n_newest_us"] = call_cost_us(lc, f"pending-{n - 1}")
    out["lookup_call_first_100_us"] = median_us(calls[:100])
    out["lookup_call_last_100_us"] = median_us(calls[-100:])
    _wait_all_read(client, server)
    after = _used_memory(server)
    out["redis_used_memory_delta"] = after - before
    out["redis_bytes_per_lookup"] = (after - before) / n
    hashes = _key_bytes(server, [client.keys.lookup(f"pending-{i}") for i in range(n)])
    stream = _key_bytes(server, [client.keys.requests]) - stream_before
    out["lookup_hash_bytes"] = hashes / n
    out["stream_entry_bytes"] = stream / n
    out["key_bytes_per_lookup"] = (hashes + stream) / n
    stats = client.stats()
    out["still_pending"] = stats.inflight
    return out
