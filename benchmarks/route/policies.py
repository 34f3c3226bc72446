"""The routing policies ``python -m benchmarks.route`` compares.

* :class:`FleetQuery`: ask every engine's ranks (``FleetClient.query``), route to the one
  holding the longest prefix, with ``reserve_ms`` pinning it there until the engine's
  own lookup arrives.
* :class:`EventIndex`: the design of vLLM production-stack's KV-aware router, llm-d's
  precise prefix-cache scorer and Dynamo's KV router: an index of which engine holds
  which chunk, fed by the engines' stored / evicted / cleared events, each applied
  ``lag`` after the engine emitted it (their transport, batching and the index's own
  processing), holding no pins.
* :class:`RoundRobin`: no cache awareness.

A policy answers ``route(request, now)`` with the engine and the tokens it expects there
(0: no expectation, round robin's turn). Engines holding nothing of the prompt fall back
to round robin's turn in all of them.
"""

from __future__ import annotations

import time
from collections import deque

from benchmarks.route.fleet import Event
from benchmarks.route.trace import Request
from broker_lookup import FleetClient

__all__ = ["EventIndex", "FleetQuery", "Policy", "RoundRobin"]


class RoundRobin:
    """Each engine in turn."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._turn = 0

    def route(self, request: Request, now: float) -> tuple[int, int]:
        """The next engine, expecting nothing."""
        self._turn = (self._turn + 1) % self.n
        return self._turn, 0

    def emitted(self, now: float, events: list[Event]) -> None:
        """Round robin reads no events."""


class EventIndex(RoundRobin):
    """Chunks per engine as the events, ``lag_s`` late, say (see the module docstring)."""

    def __init__(self, n: int, lag_s: float) -> None:
        super().__init__(n)
        self.lag_s = lag_s
        self._queue: deque[tuple[float, Event]] = deque()
        self._held: list[set[int]] = [set() for _ in range(n)]

    def emitted(self, now: float, events: list[Event]) -> None:
        """Events the engines emitted at ``now``: applied from ``now + lag``."""
        self._queue.extend((now + self.lag_s, e) for e in events)

    def route(self, request: Request, now: float) -> tuple[int, int]:
        """The engine the index says holds the longest prefix, and that prefix."""
        while self._queue and self._queue[0][0] <= now:
            _, (i, kind, h) = self._queue.popleft()
            if kind == "stored":
                self._held[i].add(h)
            elif kind == "evicted":
                self._held[i].discard(h)
            else:
                self._held[i].clear()
        best, tokens = -1, 0
        for i, held in enumerate(self._held):
            got = 0
            for h, n in zip(request.hashes, request.offsets, strict=True):
                if h not in held:
                    break
                got += n
            if got > tokens:
                best, tokens = i, got
        if best < 0:
            return super().route(request, now)
        return best, tokens


class FleetQuery(RoundRobin):
    """The fleet query over every engine, reserving on the best with ``reserve_ms``."""

    def __init__(self, fleet: FleetClient, ids: list[str], reserve_ms: int) -> None:
        super().__init__(len(ids))
        self.fleet, self.ids, self.reserve_ms = fleet, ids, reserve_ms
        self._index = {eid: i for i, eid in enumerate(ids)}
        self.latency_ns: list[int] = []
        self.reserved_short = 0  #: routes whose reservation pinned less than was found
        self.short: set[int] = set()  #: ... their requests' indexes
        self.failed = 0  #: queries answered unavailable or with a problem

    def route(self, request: Request, now: float) -> tuple[int, int]:
        """The engine holding the longest prefix now, and that prefix."""
        t0 = time.perf_counter_ns()
        answer = self.fleet.query(
            hashes=request.hashes,
            offsets=request.offsets,
            engines=self.ids,
            reserve_ms=self.reserve_ms,
        )
        self.latency_ns.append(time.perf_counter_ns() - t0)
        if answer.problem is not None:
            self.failed += 1
        best = answer.best()
        if best is None:
            return super().route(request, now)
        if self.reserve_ms and best.reserved < best.tokens:
            self.reserved_short += 1
            self.short.add(request.index)
        return self._index[best.engine_id], best.tokens


#: Every policy is a round robin that may know better.
Policy = RoundRobin
