"""The client's in-memory lookup table: the only state the scheduler's hot path reads.

One lock guards every transition; reads on the hot path take no lock (a dict read
and an attribute read are atomic in CPython) and never touch Redis. Every entry
leaves the table: on ``clear_lookup_status``/``cancel_lookup``, or after
``result_retention_ms`` if the caller never clears it, and the table is capped.
"""

from __future__ import annotations

import bisect
import heapq
import threading
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["LATENCY_BUCKETS", "Entry", "LookupTable", "Outcome"]

Outcome = Literal["hit", "miss", "timeout", "cancelled", "dead_rank", "error"]
OUTCOMES: tuple[Outcome, ...] = ("hit", "miss", "timeout", "cancelled", "dead_rank", "error")

#: Upper bounds (seconds) of the end-to-end latency histogram.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Entry:
    """One generation of one lookup, as the scheduler sees it."""

    __slots__ = (
        "deadline",
        "event",
        "expected",
        "finished",
        "gen",
        "outcome",
        "result",
        "started",
        "tokens",
    )

    def __init__(
        self,
        gen: int,
        started: float,
        deadline: float,
        tokens: int,
        expected: tuple[int, ...],
        with_event: bool,
    ) -> None:
        self.gen = gen
        self.started = started
        self.deadline = deadline
        self.tokens = tokens
        self.expected = expected
        self.result: int | None = None
        self.outcome: Outcome | None = None
        self.finished = 0.0
        self.event = threading.Event() if with_event else None


#: Called (outside the lock) with (lookup_id, gen) for every generation that must be
#: cancelled in Redis so workers release its pins.
CancelSink = Callable[[str, int], None]


class LookupTable:
    """Entries by lookup id, plus the subset still in flight, plus counters."""

    def __init__(self, cancel: CancelSink, max_pending: int, retention_s: float) -> None:
        self.entries: dict[str, Entry] = {}
        self.inflight: dict[str, Entry] = {}
        #: (deadline, gen, lookup_id) of every generation sent; finished ones are skipped
        #: when popped, so a sweep costs O(expired), not O(in flight).
        self._deadlines: list[tuple[float, int, str]] = []
        self._cancel = cancel
        self._max_pending = max_pending
        self._retention_s = retention_s
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.hit_tokens = 0
        self.stale_events = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def add(self, lookup_id: str, entry: Entry, finished: Outcome | None = None) -> bool:
        """Register a new generation; False if the table is full (caller answers 0).

        ``finished`` registers it as already answered 0 (e.g. a rank is dead): it is
        never sent, so there is nothing to cancel in Redis.
        """
        with self._lock:
            old = self.entries.get(lookup_id)
            if old is None and len(self.entries) >= self._max_pending:
                return False
            self.entries[lookup_id] = entry
            self.inflight[lookup_id] = entry
            if finished is not None:
                self._finish_locked(lookup_id, entry, 0, finished)
            else:
                heapq.heappush(self._deadlines, (entry.deadline, entry.gen, lookup_id))
        if old is not None and old.result is None:
            self._cancel(lookup_id, old.gen)
        return True

    def finish(self, lookup_id: str, gen: int, result: int, outcome: Outcome) -> bool:
        """Complete ``gen`` of ``lookup_id`` unless it already finished; True if it did now."""
        with self._lock:
            entry = self.inflight.get(lookup_id)
            if entry is None or entry.gen != gen:
                self.stale_events += 1
                return False
            self._finish_locked(lookup_id, entry, result, outcome)
        return True

    def expire(self, lookup_id: str, entry: Entry, outcome: Outcome = "timeout") -> int:
        """End ``entry`` with 0 (timeout, dead rank, error) and cancel it; return its result."""
        with self._lock:
            if entry.result is not None:
                return entry.result
            self._finish_locked(lookup_id, entry, 0, outcome)
        self._cancel(lookup_id, entry.gen)
        return 0

    def _finish_locked(self, lookup_id: str, entry: Entry, result: int, outcome: Outcome) -> None:
        now = time.monotonic()
        entry.result = result
        entry.outcome = outcome
        entry.finished = now
        if self.inflight.get(lookup_id) is entry:
            del self.inflight[lookup_id]
        self.counts[outcome] += 1
        self.hit_tokens += result
        latency = now - entry.started
        self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, latency)] += 1
        self.latency_sum += latency
        if entry.event is not None:
            entry.event.set()

    def pop(self, lookup_id: str, outcome: Outcome | None) -> None:
        """Forget ``lookup_id``; cancel it in Redis if still in flight or if asked to."""
        with self._lock:
            entry = self.entries.pop(lookup_id, None)
            if entry is None:
                return
            pending = entry.result is None
            if pending:
                self._finish_locked(lookup_id, entry, 0, outcome or "cancelled")
        if pending or outcome == "cancelled":
            self._cancel(lookup_id, entry.gen)

    def overdue(self, now: float) -> list[tuple[str, Entry]]:
        """In-flight entries past their deadline."""
        out: list[tuple[str, Entry]] = []
        heap = self._deadlines
        with self._lock:
            while heap and heap[0][0] <= now:
                _, gen, lookup_id = heapq.heappop(heap)
                entry = self.inflight.get(lookup_id)
                if entry is not None and entry.gen == gen:
                    out.append((lookup_id, entry))
        return out

    def waiting_on(self, ranks: frozenset[int]) -> list[tuple[str, Entry]]:
        """In-flight entries that expect any of ``ranks``."""
        with self._lock:
            return [(k, e) for k, e in self.inflight.items() if ranks.intersection(e.expected)]

    def older_than(self, now: float, age_s: float, limit: int) -> list[tuple[str, Entry]]:
        """Up to ``limit`` in-flight entries started more than ``age_s`` ago."""
        with self._lock:
            found = [(k, e) for k, e in self.inflight.items() if now - e.started > age_s]
        return found[:limit]

    def evict_finished(self, now: float) -> int:
        """Drop finished entries nobody cleared within the retention; return how many."""
        cutoff = now - self._retention_s
        with self._lock:
            stale = [
                k for k, e in self.entries.items() if e.result is not None and e.finished < cutoff
            ]
            for k in stale:
                del self.entries[k]
        return len(stale)

    def drain_inflight(self) -> list[tuple[str, Entry]]:
        """End every in-flight entry as cancelled (shutdown); return them for cancelling."""
        with self._lock:
            items = list(self.inflight.items())
            for k, e in items:
                self._finish_locked(k, e, 0, "cancelled")
        return items
