"""Per-lookup bookkeeping of one rank: pure logic, no Redis, no engine calls.

States of a lookup id on a rank::

    (unknown) --request--> running --report kept--> held --abort / pin TTL / new gen--> released
                              |  \\--report dropped (cancelled, stale)--> released
                              \\--abort--> running(aborted) --report--> released
    a request for an id already running waits in ``waiting`` until the running one
    reports, so the engine never sees two generations of one id at once.

Every map is bounded: ``seen`` and ``aborted`` by capacity and TTL, ``held`` by the
pin TTL, ``running`` and ``waiting`` by the deadline of what they hold.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

from broker_lookup.messages import LookupRequest

__all__ = ["Job", "Tracker"]

Decision = Literal["start", "release_then_start", "duplicate", "aborted", "queued"]


@dataclass(slots=True)
class Job:
    """A generation dispatched to the engine and not yet reported."""

    gen: int
    tokens: int
    started: float
    aborted: bool = False
    superseded: bool = field(default=False)


class _Memo:
    """A bounded set of (id, gen) with expiry, oldest first."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[tuple[str, int], float] = OrderedDict()
        self._capacity = capacity

    def add(self, key: tuple[str, int], expires: float) -> None:
        self._items[key] = expires
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._items

    def discard(self, key: tuple[str, int]) -> None:
        self._items.pop(key, None)

    def expire(self, now: float) -> None:
        while self._items:
            key, expires = next(iter(self._items.items()))
            if expires > now:
                break
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)


class Tracker:
    """Decides what a rank does with each request, abort and report."""

    def __init__(self, dedupe_capacity: int, pin_ttl_s: float, memo_ttl_s: float) -> None:
        self._lock = threading.Lock()
        self.running: dict[str, Job] = {}
        self.waiting: dict[str, LookupRequest] = {}
        self.held: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._seen = _Memo(dedupe_capacity)
        self._aborted = _Memo(dedupe_capacity)
        self._pin_ttl_s = pin_ttl_s
        self._memo_ttl_s = memo_ttl_s

    def on_request(self, req: LookupRequest, now: float) -> Decision:
        """What to do with a decoded, valid, in-time request."""
        key = (req.lookup_id, req.gen)
        with self._lock:
            if key in self._seen:
                return "duplicate"
            self._seen.add(key, now + self._memo_ttl_s)
            if key in self._aborted:
                self._aborted.discard(key)
                return "aborted"
            job = self.running.get(req.lookup_id)
            if job is not None:
                job.superseded = True
                self.waiting[req.lookup_id] = req
                return "queued"
            self.running[req.lookup_id] = Job(req.gen, req.tokens, now)
            if self.held.pop(req.lookup_id, None) is not None:
                return "release_then_start"
            return "start"

    def on_abort(self, lookup_id: str, gen: int, now: float) -> bool:
        """Record an abort; True if the engine must release ``lookup_id`` now."""
        with self._lock:
            job = self.running.get(lookup_id)
            if job is not None and job.gen == gen:
                job.aborted = True  # released when the prefetch reports
                return False
            waiting = self.waiting.get(lookup_id)
            if waiting is not None and waiting.gen == gen:
                del self.waiting[lookup_id]
                return False
            held = self.held.get(lookup_id)
            if held is not None and held[0] == gen:
                del self.held[lookup_id]
                return True
            if job is None or job.gen < gen:
                self._aborted.add((lookup_id, gen), now + self._memo_ttl_s)
            return False

    def take_running(self, lookup_id: str) -> Job | None:
        """The job a report belongs to (removed from ``running``), or None if unknown."""
        with self._lock:
            return self.running.pop(lookup_id, None)

    def settle(
        self, lookup_id: str, job: Job, keep: bool, now: float
    ) -> tuple[bool, LookupRequest | None]:
        """After a report: hold the pins (``keep``) or not; also return a request to start.

        An abort that arrived while the report was in flight wins: the pins are not kept.
        """
        with self._lock:
            if keep and (lookup_id, job.gen) in self._aborted:
                self._aborted.discard((lookup_id, job.gen))
                keep = False
            if keep:
                self.held[lookup_id] = (job.gen, now + self._pin_ttl_s)
                self.held.move_to_end(lookup_id)
            nxt = self.waiting.pop(lookup_id, None)
            if nxt is not None:
                self.running[lookup_id] = Job(nxt.gen, nxt.tokens, now)
                self.held.pop(lookup_id, None)
            return keep and nxt is None, nxt

    def expired_holds(self, now: float) -> list[str]:
        """Ids whose pins outlived ``worker_pin_ttl_ms``; they are removed from ``held``."""
        out: list[str] = []
        with self._lock:
            while self.held:
                lookup_id, (_, until) = next(iter(self.held.items()))
                if until > now:
                    break
                del self.held[lookup_id]
                out.append(lookup_id)
            self._seen.expire(now)
            self._aborted.expire(now)
        return out

    def release_all(self) -> list[str]:
        """Every id holding or about to hold engine memory (shutdown)."""
        with self._lock:
            ids = list(self.held) + list(self.running)
            self.held.clear()
            self.running.clear()
            self.waiting.clear()
        return ids

    def sizes(self) -> dict[str, int]:
        """Sizes of every map, for heartbeats and the bounded-memory tests."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "held": len(self.held),
            "seen": len(self._seen),
            "aborted": len(self._aborted),
        }
