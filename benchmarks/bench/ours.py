"""``python -m benchmarks.bench``: the measurements of our client, worker ranks and broker.

Ranks are real processes (``python -m benchmarks.bench.our_ranks``, one process per rank,
forked
from one host per phase); the client runs in this process, as a scheduler's would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from benchmarks.bench.children import start_rank_host, stop_all
from benchmarks.bench.measure import (
    BenchError,
    BenchOptions,
    Prompts,
    closed_loop,
    cpu_seconds_of,
    idle_cpu,
    sequential_latency,
)
from benchmarks.bench.probe import pending_probe
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.config.model import ENGINE_TTL_MAX_MS
from broker_lookup.processes import python_module
from broker_lookup.protocol.keys import KeySpace

__all__ = [
    "CpuMeter",
    "client_for",
    "engine_id",
    "latency_and_probes",
    "rank_host",
    "wait_heartbeats",
]

#: Long enough that no lookup of a probe times out while it is measured.
_PATIENT_MS = 600_000


def engine_id(run_id: str, name: str) -> str:
    """Engine id of one part of one run: runs never share keys."""
    return f"bench-{run_id}-{name}"


class CpuMeter:
    """CPU seconds of this process, its calling thread, rank processes and the Redis server."""

    def __init__(self, rank_pids: list[int], server: redis.Redis) -> None:
        self._pids = rank_pids
        self._server = server
        self._start = self.snapshot()

    def snapshot(self) -> dict[str, float]:
        """Cumulative CPU seconds now."""
        info: Any = self._server.info("cpu")
        return {
            "client_process": time.process_time(),
            "caller_thread": time.thread_time(),
            "ranks": cpu_seconds_of(self._pids),
            "redis": float(info.get("used_cpu_user", 0)) + float(info.get("used_cpu_sys", 0)),
        }

    def per_1000(self, lookups: int) -> dict[str, float]:
        """CPU seconds per 1,000 lookups since construction, per side."""
        now = self.snapshot()
        out = {k: (now[k] - self._start[k]) * 1000 / max(1, lookups) for k in now}
        out["client_threads"] = out["client_process"] - out["caller_thread"]
        return out


def wait_heartbeats(server: redis.Redis, ranks: dict[str, list[int]], timeout_s: float) -> None:
    """Wait until every rank of every engine has a heartbeat key."""
    keys = [KeySpace(e).heartbeat(r) for e, rs in ranks.items() for r in rs]
    deadline = time.monotonic() + timeout_s
    while server.exists(*keys) < len(keys):
        if time.monotonic() > deadline:
            raise BenchError(f"ranks without a heartbeat after {timeout_s:.0f}s")
        time.sleep(0.02)


@contextmanager
def rank_host(
    opts: BenchOptions,
    url: str,
    engines: dict[str, int],
    mute: frozenset[str] = frozenset(),
    module: str = "benchmarks.bench.our_ranks",
    host_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> Iterator[dict[str, dict[int, int]]]:
    """Serve ``engines`` (id -> world size) from one rank host; yield the rank pids.

    ``module`` is the host (``our_ranks``, or ``floor`` for the protocol's floor): it
    takes ``--redis-url`` and ``--engine`` (and ``host_args``), and its ranks keep a
    heartbeat key. ``env``: the host's environment (default: this process's).
    """
    argv = python_module(module, ["--redis-url", url, *host_args])
    for eid, world in engines.items():
        argv += ["--engine", f"{eid}:{world}" + (":mute" if eid in mute else "")]
    host, pids = start_rank_host(
        "rank host",
        argv,
        dict(os.environ) if env is None else env,
        sum(engines.values()),
        opts.startup_timeout_s,
    )
    try:
        server = redis.Redis.from_url(url)
        try:
            wait_heartbeats(server, {e: list(p) for e, p in pids.items()}, 30.0)
        finally:
            server.close()
        yield pids
    finally:
        stop_all([host])


def client_for(url: str, eid: str, world: int, **fields: Any) -> RedisAsyncLookupClient:
    """Our async client for one engine; every rank must already be alive."""
    client = RedisAsyncLookupClient(
        LookupConfig(redis_url=url, **fields), LookupMetadata(engine_id=eid, world_size=world)
    )
    dead = client.stats().dead_ranks
    if dead:
        client.close()
        raise BenchError(f"engine {eid}: ranks {dead} have no heartbeat")
    return client


def _world_run(
    opts: BenchOptions, url: str, eid: str, world: int, pids: list[int], server: redis.Redis
) -> dict[str, Any]:
    prompts = Prompts(opts.tokens)
    client = client_for(url, eid, world)
    try:
        meter = CpuMeter(pids, server)
        run = sequential_latency(client, prompts, opts.lookups, opts.warmup, opts.poll_s, "lat")
        run["cpu_per_1000"] = meter.per_1000(opts.lookups + opts.warmup)
        if world == opts.throughput_world:
            meter = CpuMeter(pids, server)
            tput = closed_loop(client, prompts, opts.window, opts.duration_s, opts.poll_s, "tp")
            tput["cpu_per_1000"] = meter.per_1000(tput["completed"])
            tput["world"] = world
            run["throughput"] = tput
        run["client_stats"] = client.stats().outcomes
        return run
    finally:
        client.close()


def _idle(opts: BenchOptions, url: str, eid: str, rank_pids: list[int]) -> dict[str, float]:
    """Every rank process and one client, with no lookup (see :func:`idle_cpu`)."""
    client = client_for(url, eid, opts.worlds[0])
    try:
        time.sleep(0.5)  # past the client's start-up
        return idle_cpu(rank_pids, opts.idle_s)
    finally:
        client.close()


def latency_and_probes(opts: BenchOptions, url: str, run_id: str) -> dict[str, Any]:
    """Latency per world size, throughput at ``throughput_world``, the pending/memory probe."""
    engines = {engine_id(run_id, f"w{w}"): w for w in opts.worlds}
    mute_id = engine_id(run_id, "mute")
    engines[mute_id] = 1
    out: dict[str, Any] = {"latency": {}}
    server = redis.Redis.from_url(url)
    try:
        with rank_host(opts, url, engines, frozenset({mute_id})) as pids:
            # First, while no key of an earlier run expires and blurs used_memory.
            client = client_for(
                url,
                mute_id,
                1,
                lookup_timeout_ms=_PATIENT_MS,
                worker_pin_ttl_ms=2 * _PATIENT_MS,
                engine_ttl_ms=ENGINE_TTL_MAX_MS,  # outlives the patient lookups' hashes
            )
            try:
                out["pending"] = pending_probe(client, Prompts(opts.tokens), opts.pending, server)
            finally:
                client.close()
            every_rank = [pid for ranks in pids.values() for pid in ranks.values()]
            out["idle"] = _idle(opts, url, engine_id(run_id, f"w{opts.worlds[0]}"), every_rank)
            for w in opts.worlds:
                eid = engine_id(run_id, f"w{w}")
                run = _world_run(opts, url, eid, w, list(pids[eid].values()), server)
                if "throughput" in run:
                    out["throughput"] = run.pop("throughput")
                out["latency"][str(w)] = run
    finally:
        server.close()
    return out
