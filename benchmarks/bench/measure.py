"""Measurement loops of ``python -m benchmarks.bench``, shared by our client and LMCache's.

Every loop drives a client through LMCache's scheduler contract only (``lookup_cache``
then ``lookup``, then ``lookup_cache`` until it gives an int, then
``clear_lookup_status``), so one loop measures both implementations.

Polling model (what a scheduler does): ``lookup_cache(id)`` first (-1: unknown; LMCache
registers the id here), then ``lookup()``; then, until ``lookup_cache`` returns an int
>= 0: sleep ``poll_s`` (``time.sleep(0)`` when 0, which still releases the GIL), poll
again. The clock runs from just before ``lookup()`` to the poll that returns the int.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from broker_lookup.errors import BrokerLookupError

__all__ = [
    "BenchError",
    "BenchOptions",
    "LookupClientLike",
    "Prompts",
    "closed_loop",
    "cpu_seconds_of",
    "idle_cpu",
    "sequential_latency",
    "summarize_ns",
]

#: Share of a throughput run (after the fill) not counted: the backlog the fill leaves.
WARM_SHARE = 0.2
#: One lookup that takes longer than this means the setup is broken, not slow.
STUCK_S = 30.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(BrokerLookupError, RuntimeError):
    """The benchmark could not run (a child failed to start, a lookup never finished)."""


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """What ``python -m benchmarks.bench`` measures, and how much (:meth:`defaults`: per mode)."""

    redis_url: str | None = None  #: None: an embedded Valkey
    quick: bool = False
    worlds: tuple[int, ...] = (1, 2, 4, 8)  #: world sizes of the latency runs
    lookups: int = 2000  #: measured lookups per latency run
    lmcache_slow_lookups: int = 300  #: per run for LMCache at its default 10 ms backoff
    warmup: int = 50  #: unmeasured lookups first
    tokens: int = 1024  #: prompt length
    poll_us: float = 50.0  #: sleep between polls (0: time.sleep(0))
    throughput_world: int = 4
    window: int = 1000  #: lookups in flight in the throughput runs (in all, over engines)
    duration_s: float = 5.0  #: length of each throughput run
    engines: tuple[int, ...] = (1, 4, 16)  #: concurrent engines (one client process each)
    pending: int = 1000  #: lookups left in flight for the memory and pending-count probes
    idle_s: float = 5.0  #: how long the idle processes' CPU is measured, with no lookup
    hash_sizes: tuple[int, ...] = (1024, 8192, 32768, 131072)
    vs_lmcache: bool = False
    startup_timeout_s: float = 180.0

    @classmethod
    def defaults(cls, quick: bool, **overrides: Any) -> BenchOptions:
        """Full-run defaults, or the small CI smoke run with ``quick``."""
        if quick:
            small: dict[str, Any] = {
                "worlds": (1, 2),
                "lookups": 200,
                "lmcache_slow_lookups": 50,
                "warmup": 10,
                "throughput_world": 2,
                "window": 200,
                "duration_s": 1.0,
                "engines": (1, 2),
                "pending": 200,
                "idle_s": 1.0,
                "hash_sizes": (1024, 8192),
            }
            overrides = {**small, **overrides}
        return cls(quick=quick, **overrides)

    @property
    def poll_s(self) -> float:
        """Seconds between polls."""
        return self.poll_us / 1e6


class LookupClientLike(Protocol):
    """What the loops need: LMCache's async lookup client contract."""

    def lookup(
        self, token_ids: list[int], lookup_id: str, request_configs: dict[str, Any] | None = None
    ) -> int | None: ...

    def lookup_cache(self, lookup_id: str) -> int | None: ...

    def clear_lookup_status(self, lookup_id: str) -> None: ...


class Prompts:
    """Distinct prompts of ``n_tokens`` seeded pseudo-random ids: prompt ``i`` starts with ``i``,
    so no two share a chunk hash."""

    def __init__(self, n_tokens: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.n_tokens = n_tokens
        self._base = [rng.randrange(128_000) for _ in range(n_tokens)]

    def get(self, i: int) -> list[int]:
        """Prompt number ``i`` (a fresh list)."""
        prompt = self._base.copy()
        prompt[0] = i
        return prompt


def summarize_ns(samples: Iterable[int]) -> dict[str, float]:
    """p50/p99/max/mean in milliseconds of nanosecond samples (nearest rank)."""
    data = sorted(samples)
    if not data:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "mean_ms": 0.0}

    def pick(q: float) -> float:
        return data[min(len(data) - 1, int(q * len(data)))] / 1e6

    return {
        "n": len(data),
        "p50_ms": pick(0.50),
        "p99_ms": pick(0.99),
        "max_ms": data[-1] / 1e6,
        "mean_ms": statistics.fmean(data) / 1e6,
    }


def median_us(samples_ns: list[int]) -> float:
    """Median in microseconds (0 when empty)."""
    return statistics.median(samples_ns) / 1e3 if samples_ns else 0.0


def _stat_seconds(pid: int) -> float | None:
    """utime + stime of a whole process from ``/proc/<pid>/stat`` (clock ticks: 10 ms)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime (fields 14, 15)


def _schedstat_seconds(pid: int) -> float | None:
    """Run time of a process's live threads in ns precision (``/proc/<pid>/task/*/schedstat``).

    Ticks are too coarse for what one lookup costs a rank (tens of µs: a 400-lookup run
    is a few ticks). A thread that exited takes its time with it, which the bench's
    processes (long-lived threads only) do not do while they are measured.
    """
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited between the listing and the read
    return total / 1e9


_PRECISE = os.path.exists("/proc/self/task") and os.path.exists("/proc/self/schedstat")


def cpu_seconds_of(pids: Iterable[int]) -> float:
    """CPU seconds of live processes (0 for a gone one): every thread's run time from
    schedstat where the kernel has it, else utime + stime from ``/proc/<pid>/stat``."""
    read = _schedstat_seconds if _PRECISE else _stat_seconds
    return sum(read(pid) or 0.0 for pid in pids)


def idle_cpu(rank_pids: list[int], seconds: float) -> dict[str, float]:
    """What idle processes cost, in ms of CPU a second, over ``seconds`` with no lookup:
    each rank process (the average of ``rank_pids``) and this one, whose calling thread
    sleeps, so what it spends is the client's threads (the scheduler process's share)."""
    process, ranks = time.process_time(), cpu_seconds_of(rank_pids)
    time.sleep(seconds)
    k = 1000 / seconds
    return {
        "rank_ms_per_s": (cpu_seconds_of(rank_pids) - ranks) * k / max(1, len(rank_pids)),
        "scheduler_ms_per_s": (time.process_time() - process) * k,
        "rank_processes": len(rank_pids),
    }


def _pause(poll_s: float) -> None:
    time.sleep(poll_s)  # sleep(0) too: it yields the GIL to the client's threads


def _wait_result(
    client: LookupClientLike, lookup_id: str, poll_s: float, t0: int, poll_ns: list[int]
) -> int:
    clock = time.perf_counter_ns
    while True:
        _pause(poll_s)
        a = clock()
        result = client.lookup_cache(lookup_id)
        poll_ns.append(clock() - a)
        if result is not None and result >= 0:
            return result
        if (a - t0) / 1e9 > STUCK_S:
            raise BenchError(f"lookup {lookup_id} unanswered after {STUCK_S:.0f}s")


def sequential_latency(
    client: LookupClientLike, prompts: Prompts, n: int, warmup: int, poll_s: float, prefix: str
) -> dict[str, Any]:
    """One lookup in flight at a time: end-to-end latency and the caller's per-call costs."""
    clock = time.perf_counter_ns
    e2e: list[int] = []
    calls: list[int] = []
    polls: list[int] = []
    results: dict[int, int] = {}
    for i in range(warmup + n):
        lookup_id = f"{prefix}-{i}"
        prompt = prompts.get(i)
        client.lookup_cache(lookup_id)  # -1, as vLLM's adapter asks first
        t0 = clock()
        result = client.lookup(prompt, lookup_id)
        t1 = clock()
        if result is None or result < 0:
            result = _wait_result(client, lookup_id, poll_s, t0, polls if i >= warmup else [])
        t2 = clock()
        client.clear_lookup_status(lookup_id)
        if i >= warmup:
            e2e.append(t2 - t0)
            calls.append(t1 - t0)
            results[result] = results.get(result, 0) + 1
    return {
        "e2e": summarize_ns(e2e),
        "lookup_call_us": median_us(calls),
        "lookup_cache_pending_us": median_us(polls),
        "polls_per_lookup": len(polls) / max(1, n),
        "results": {str(k): v for k, v in sorted(results.items())},
    }


class _ClosedLoop:
    """State of one :func:`closed_loop` run."""

    def __init__(self, client: LookupClientLike, prompts: Prompts, prefix: str) -> None:
        self.client = client
        self.prompts = prompts
        self.prefix = prefix
        self.inflight: dict[str, int] = {}
        self.latencies: list[int] = []
        self.results: Counter[int] = Counter()  #: each completed lookup's answer
        self.finished: list[int] = []
        self.issued = 0

    def issue(self) -> None:
        lookup_id = f"{self.prefix}-{self.issued}"
        prompt = self.prompts.get(self.issued)
        self.issued += 1
        self.client.lookup_cache(lookup_id)
        self.inflight[lookup_id] = time.perf_counter_ns()
        result = self.client.lookup(prompt, lookup_id)
        if result is not None and result >= 0:  # answered at once
            self.complete(lookup_id, result)

    def complete(self, lookup_id: str, result: int) -> None:
        now = time.perf_counter_ns()
        self.results[result] += 1
        self.latencies.append(now - self.inflight.pop(lookup_id))
        self.finished.append(now)
        self.client.clear_lookup_status(lookup_id)

    def poll_all(self) -> None:
        lookup_cache = self.client.lookup_cache
        for lookup_id in list(self.inflight):
            result = lookup_cache(lookup_id)
            if result is not None and result >= 0:
                self.complete(lookup_id, result)
                self.issue()

    def forget_rest(self) -> None:
        for lookup_id in self.inflight:  # ours also cancels them in Redis
            self.client.clear_lookup_status(lookup_id)


def closed_loop(
    client: LookupClientLike,
    prompts: Prompts,
    window: int,
    duration_s: float,
    poll_s: float,
    prefix: str,
) -> dict[str, Any]:
    """Fill ``window`` lookups, then keep that many in flight for ``duration_s``.

    Each pass polls every in-flight lookup once, replaces each finished one with a new
    one, then sleeps ``poll_s``. The rate counts the completions of the last
    ``1 - WARM_SHARE`` of the run, past the fill and the backlog it leaves.
    """
    clock = time.perf_counter_ns
    loop = _ClosedLoop(client, prompts, prefix)
    start = clock()
    while len(loop.inflight) < window:
        loop.issue()
    filled = clock()
    end = filled + int(duration_s * 1e9)
    while clock() < end:
        loop.poll_all()
        _pause(poll_s)
    stop = clock()
    loop.forget_rest()
    counted_from = filled + int(WARM_SHARE * (stop - filled))
    steady = sum(1 for t in loop.finished if t >= counted_from)
    return {
        "window": window,
        "fill_s": (filled - start) / 1e9,
        "elapsed_s": (stop - start) / 1e9,
        "completed": len(loop.latencies),
        "issued": loop.issued,
        "lookups_per_s": steady * 1e9 / max(1, stop - counted_from),
        "latency": summarize_ns(loop.latencies),
        "results": {str(k): v for k, v in sorted(loop.results.items())},
    }
