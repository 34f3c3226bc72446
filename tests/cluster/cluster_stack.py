"""Engines (a client and worker ranks each) on one Redis URL, and lookup traffic to judge.

Every client and server gets its connections from ``make_factory(config, name)``, the way
production code does, so these tests exercise the ``redis+cluster://`` and
``redis+sentinel://`` factories end to end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from helpers import wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.connection import make_factory
from workers.server import RedisAsyncLookupServer

#: Short timers, but a heartbeat TTL that survives a busy shared 2-core machine.
FAST: dict[str, Any] = {
    "lookup_timeout_ms": 1500,
    "block_ms": 50,
    "heartbeat_interval_ms": 200,
    "heartbeat_ttl_ms": 2000,
    "chunk_size": 4,
    "key_grace_ms": 2000,
    "socket_timeout_ms": 2000,
}
TOKENS = list(range(64))  # 16 chunks of 4


@dataclass
class Unit:
    """One engine: its client, its ranks, and the answer every lookup must get."""

    engine_id: str
    client: RedisAsyncLookupClient
    servers: list[RedisAsyncLookupServer]
    expected: int

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Every rank reads its group and the client sees every rank's heartbeat."""
        wait_until(lambda: all(s.ready for s in self.servers), timeout, message="ranks ready")
        wait_until(lambda: not self.client.stats().dead_ranks, timeout, message="client sees ranks")


@dataclass
class Stack:
    """Builds :class:`Unit` s on ``url`` and closes all of them (clients first)."""

    url: str
    overrides: dict[str, Any] = field(default_factory=dict)
    units: list[Unit] = field(default_factory=list)

    @property
    def config(self) -> LookupConfig:
        return LookupConfig(redis_url=self.url, **{**FAST, **self.overrides})

    def unit(self, engine_id: str, hits: int, world_size: int = 1) -> Unit:
        cfg = self.config
        servers = []
        for rank in range(world_size):
            meta = LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=rank)
            factory = make_factory(cfg, f"bl-test-worker-{engine_id}-{rank}")
            servers.append(
                RedisAsyncLookupServer(
                    StubEngine("instant", hits=hits), meta, cfg, connection_factory=factory
                )
            )
        meta = LookupMetadata(engine_id=engine_id, world_size=world_size)
        factory = make_factory(cfg, f"bl-test-client-{engine_id}")
        client = RedisAsyncLookupClient(cfg, meta, connection_factory=factory)
        unit = Unit(engine_id, client, servers, min(hits, len(TOKENS)))
        self.units.append(unit)
        return unit

    def close(self) -> float:
        """Close everything; returns how long it took (shutdown must be bounded)."""
        started = time.monotonic()
        for u in self.units:
            u.client.close()
        for u in self.units:
            for s in u.servers:
                s.close()
        self.units.clear()
        return time.monotonic() - started


@dataclass
class Outcome:
    lookup_id: str
    started: float  #: time.monotonic() when lookup() was called
    result: int


class Traffic:
    """Starts one lookup every ``interval_s`` on ``unit`` from a thread, until stopped."""

    def __init__(self, unit: Unit, prefix: str, interval_s: float = 0.005) -> None:
        self.unit = unit
        self.prefix = prefix
        self.interval_s = interval_s
        self.started: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"traffic-{prefix}", daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "lookup() blocked the traffic thread"

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            lookup_id = f"{self.prefix}-{n}"
            n += 1
            started = time.monotonic()
            self.unit.client.lookup(TOKENS, lookup_id)
            self.started.append((lookup_id, started))
            self._stop.wait(self.interval_s)

    def outcomes(self, timeout: float = 10.0) -> list[Outcome]:
        """Every lookup's answer, once none is in flight any more (never longer than timeout)."""
        client = self.unit.client
        wait_until(
            lambda: all(client.lookup_cache(i) is not None for i, _ in self.started),
            timeout,
            message=f"every lookup of {self.prefix} to end",
        )
        return [Outcome(i, t, int(client.lookup_cache(i) or 0)) for i, t in self.started]


def verdicts(outcomes: list[Outcome], expected: int) -> Counter[str]:
    """Counts of ``right`` (the engine's answer), ``zero`` (gave up) and ``wrong``."""
    return Counter(
        "right" if o.result == expected else "zero" if o.result == 0 else "wrong" for o in outcomes
    )


def run_batch(unit: Unit, prefix: str, count: int, timeout: float = 10.0) -> list[int]:
    """``count`` lookups started at once; their answers."""
    ids = [f"{prefix}-{n}" for n in range(count)]
    for lookup_id in ids:
        unit.client.lookup(TOKENS, lookup_id)
    wait_until(
        lambda: all(unit.client.lookup_cache(i) is not None for i in ids),
        timeout,
        message=f"batch {prefix} to finish",
    )
    return [int(unit.client.lookup_cache(i) or 0) for i in ids]
