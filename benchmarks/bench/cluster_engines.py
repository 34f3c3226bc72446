"""The engine processes of ``python -m benchmarks.bench --cluster``: forked, driven over a pipe.

Each process is one engine as a vLLM deployment has it: a :class:`RedisAsyncLookupClient`
(the scheduler) and one worker rank (built through
``LookupClientFactory.create_lookup_server``, with an instant
:class:`~broker_lookup.stub_engine.StubEngine`, so the engine costs nothing). The bench
forks them all, waits until each says ``ready`` (its rank heartbeats and the client sees it
alive), sends ``go`` to every one at once, and collects ``(completions, seconds)``
while it reads each server's CPU time before and after.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any

import redis

from broker_lookup.errors import BrokerLookupError
from broker_lookup.processes import die_with_parent
from broker_lookup.stub_engine import StubEngine

__all__ = ["TOKENS", "run_engines"]

#: Tokens per lookup: one chunk of the default chunk_size (the lookup path, not hashing).
TOKENS = 256
_WARM_SHARE = 0.2  # completions of the first 20% of a run are not counted
_READY_TIMEOUT_S = 60.0


def _closed_loop(client: Any, window: int, duration_s: float) -> tuple[int, float]:
    """Keep ``window`` lookups in flight; (completions counted, seconds they span)."""
    prompt = list(range(TOKENS))
    issued = 0
    inflight: set[str] = set()
    done_at: list[float] = []
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        while len(inflight) < window:
            lookup_id = f"l{issued}"
            issued += 1
            client.lookup(prompt, lookup_id)
            inflight.add(lookup_id)
        for lookup_id in [i for i in inflight if client.lookup_cache(i) is not None]:
            if client.lookup_cache(lookup_id) == TOKENS:
                done_at.append(time.monotonic())
            client.clear_lookup_status(lookup_id)
            inflight.discard(lookup_id)
        time.sleep(0.0002)
    counted_from = end - duration_s * (1 - _WARM_SHARE)
    return sum(1 for t in done_at if t >= counted_from), duration_s * (1 - _WARM_SHARE)


def _engine_main(url: str, engine_id: str, window: int, duration_s: float, pipe: Any) -> None:
    """One engine process: a rank and a client; ready, wait for go, run, send the result."""
    from broker_lookup.client import RedisAsyncLookupClient
    from broker_lookup.client.factory import LookupClientFactory
    from broker_lookup.config import LookupConfig, LookupMetadata

    die_with_parent()  # forked without exec: an engine must not outlive the bench
    config = LookupConfig(redis_url=url, lookup_timeout_ms=30_000)
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    engine = StubEngine("instant", record=False)  # a full hit at once, on the consumer thread
    server = LookupClientFactory.create_lookup_server(engine, meta, config)
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not server.stats().last_heartbeat and time.monotonic() < deadline:
        time.sleep(0.02)  # the client would log the rank dead if it started first
    client = RedisAsyncLookupClient(config, meta)
    try:
        while client.stats().dead_ranks or not server.ready:
            if time.monotonic() > deadline:
                raise BrokerLookupError(f"engine {engine_id}: rank not alive")
            time.sleep(0.02)
        pipe.send("ready")
        pipe.recv()  # go
        pipe.send(_closed_loop(client, window, duration_s))
    except BaseException as exc:
        pipe.send(f"error: {exc!r}")
    finally:
        client.close()
        server.close()


def _busy(nodes: list[redis.Redis]) -> list[float]:
    """CPU seconds each server process has used so far."""
    infos: list[Any] = [node.info("cpu") for node in nodes]
    return [float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos]


def run_engines(
    url: str, ids: list[str], window: int, duration_s: float, nodes: list[redis.Redis]
) -> tuple[list[Any], list[float]]:
    """Fork one process per engine id; (their results, each server's CPU share meanwhile)."""
    # fork: the engine processes start in milliseconds instead of re-importing torch.
    ctx = multiprocessing.get_context("fork")
    pipes: list[Connection] = []
    procs: list[multiprocessing.process.BaseProcess] = []
    for eid in ids:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_engine_main, args=(url, eid, window, duration_s, child))
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    try:
        _expect_all(pipes, "ready", _READY_TIMEOUT_S)
        before = _busy(nodes)
        t0 = time.monotonic()
        for p in pipes:
            p.send("go")
        results = _expect_all(pipes, None, duration_s + _READY_TIMEOUT_S)
        wall = time.monotonic() - t0
        return results, [(b - a) / wall for a, b in zip(before, _busy(nodes), strict=True)]
    finally:
        for process in procs:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def _expect_all(pipes: list[Connection], want: str | None, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    got = []
    for p in pipes:
        if not p.poll(max(0.0, deadline - time.monotonic())):
            raise BrokerLookupError(f"an engine process did not answer within {timeout_s:g}s")
        msg = p.recv()
        if isinstance(msg, str) and msg.startswith("error"):
            raise BrokerLookupError(f"an engine process failed: {msg}")
        if want is not None and msg != want:
            raise BrokerLookupError(f"an engine process said {msg!r}, not {want!r}")
        got.append(msg)
    return got
