"""The client's in-memory lookup table: the only state the scheduler's hot path reads.

One lock guards every transition; reads on the hot path take no lock (a dict read
and an attribute read are atomic in CPython) and never touch Redis. Every entry
leaves the table: on ``clear_lookup_status``/``cancel_lookup``, or after
``result_retention_ms`` if the caller never clears it, and the table is capped.
Nothing under the lock is O(entries): timeouts, reconciliation and eviction each pop
from their own time-ordered queue and stop at the first item not yet due.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Literal, get_args

import msgspec

from broker_lookup.histogram import Histogram

__all__ = ["Entry", "LookupTable", "Outcome"]

Outcome = Literal[
    "hit",
    "miss",
    "partial",
    "timeout",
    "cancelled",
    "dead_rank",
    "error",
    "unavailable",
    "rejected",
    "duplicate_scheduler",
]
#: ``partial``: answered at the deadline with the prefix every rank confirmed loaded
#: (``partial_answers``); ``unavailable``: answered 0 at once because the circuit breaker
#: was open (Redis failing or stalled); ``rejected``: a request the protocol cannot carry
#: (see client.admit); ``duplicate_scheduler``: answered 0 because another scheduler holds
#: this engine id's lease.
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


class Entry(msgspec.Struct, gc=False, eq=False):
    """One generation of one lookup, as the scheduler sees it.

    ``Entry(gen, started, deadline, tokens, expected, event=...)``; ``event`` is set when
    the generation is answered, for a caller that waits on it (None: nobody waits).
    """

    # gc=False: an entry lives as long as its lookup, in the table and the sender's
    # queue. Tracked, each would count towards the collections of the scheduler's process
    # (vLLM's, whose large heap every full one walks: with 1,000 in flight they came
    # every few thousand lookups, at ~0.2 s each). It refers to no object that refers
    # back to it. eq=False: entries compare and hash by identity.

    gen: int
    started: float
    deadline: float
    tokens: int
    expected: tuple[int, ...]
    event: threading.Event | None = None
    result: int | None = None
    outcome: Outcome | None = None
    finished: float = 0.0
    #: Set by the sender just before its submit goes out (then checked against
    #: ``result``; the table sets ``result`` then checks ``sent``): a generation
    #: that was never sent needs no cancel.
    sent: bool = False
    #: Past its deadline, its partial answer asked for (``partial_answers``).
    settling: bool = False
    #: The lookups its rank insights stand for (the sender's sampler; 0: untimed).
    weight: int = 0


#: Called (outside the lock) with (lookup_id, gen) for every generation that must be
#: cancelled in Redis so workers release its pins.
CancelSink = Callable[[str, int], None]
#: Called (outside the lock) with (lookup_id, entry, answer) of a sent generation whose
#: deadline passed: ``answer`` True asks Redis for its partial answer (``partial_answers``);
#: False cancels it, the client having answered 0 (Redis names the ranks that were late).
DeadlineSink = Callable[[str, "Entry", bool], None]

#: How long after a successful submit a lookup is first reconciled from its hash, and
#: how often after that while it is still in flight.
RECONCILE_AFTER_S = 0.5


class LookupTable:
    """Entries by lookup id, plus the subset still in flight, plus counters."""

    def __init__(
        self,
        cancel: CancelSink,
        max_pending: int,
        retention_s: float,
        *,
        deadline: DeadlineSink | None = None,
        partial: bool = False,
        wait_s: float = 0.0,
    ) -> None:
        self.entries: dict[str, Entry] = {}
        self.inflight: dict[str, Entry] = {}
        #: (deadline, gen, lookup_id) of every generation sent; finished ones are skipped
        #: when popped, so a sweep costs O(expired), not O(in flight).
        self._deadlines: list[tuple[float, int, str]] = []
        #: (due, lookup_id, entry) of submits Redis confirmed, oldest first: reconciled
        #: from their hash when due (a completion event lost in a reconnect or a flush).
        self._confirmed: deque[tuple[float, str, Entry]] = deque()
        #: Finished entries still in the table, in finishing order: evicted after the
        #: retention. Keyed by id, so a clear removes its item and the size stays within
        #: the table's.
        self._finished: OrderedDict[str, tuple[float, Entry]] = OrderedDict()
        #: Generation of recently cleared ids that reached Redis, so a cancel_lookup
        #: after clear_lookup_status still tells the ranks to release their pins.
        self._cleared: OrderedDict[str, int] = OrderedDict()
        self._cancel = cancel
        self._deadline = deadline
        #: The sink that asks for partial answers (None: the deadline answers 0 at once).
        self._ask_partial = deadline if partial else None
        self._wait_s = wait_s
        self._max_pending = max_pending
        self._retention_s = retention_s
        self._lock = threading.Lock()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.hit_tokens = 0
        self.stale_events = 0
        #: End-to-end latency, lookup() to the answer (observed under the lock).
        self.latency = Histogram()

    def add(self, lookup_id: str, entry: Entry, finished: Outcome | None = None) -> bool:
        """Register a new generation; False if the table is full (caller answers 0).

        ``finished`` registers it as already answered 0 (e.g. a rank is dead): it is
        never sent, so there is nothing to cancel in Redis.
        """
        with self._lock:
            old = self.entries.get(lookup_id)
            if old is None and len(self.entries) >= self._max_pending:
                return False
            superseded = old is not None and old.result is None
            if old is not None and superseded:
                self._finish_locked(lookup_id, old, 0, "cancelled")
            self.entries[lookup_id] = entry
            self.inflight[lookup_id] = entry
            if finished is not None:
                self._finish_locked(lookup_id, entry, 0, finished)
            else:
                heapq.heappush(self._deadlines, (entry.deadline, entry.gen, lookup_id))
        if superseded and old is not None and old.sent:
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
        """End ``entry`` with 0 (timeout, dead rank, error) and cancel it; return its result.

        A timeout is cancelled through the deadline sink when there is one, so Redis
        names the ranks that had not reported (the stragglers) as it cancels.
        """
        with self._lock:
            if entry.result is not None:
                return entry.result
            self._finish_locked(lookup_id, entry, 0, outcome)
        if not entry.sent:  # never sent: nothing in Redis to cancel
            return 0
        if outcome == "timeout" and self._deadline is not None:
            self._deadline(lookup_id, entry, False)
        else:
            self._cancel(lookup_id, entry.gen)
        return 0

    def on_deadline(self, lookup_id: str, entry: Entry, now: float) -> int | None:
        """``entry``'s deadline passed: its answer now, or None while Redis is asked for its
        partial answer (``partial_answers``: at most ``wait_s`` more, then 0).

        Without partial answers, or for a generation never sent, this is :meth:`expire`.
        """
        ask_partial = self._ask_partial
        if ask_partial is None or not entry.sent:
            return self.expire(lookup_id, entry)
        with self._lock:
            if entry.result is not None:
                return entry.result
            ask = not entry.settling
            if ask:
                entry.settling = True
                # The sweep answers 0 once the wait is over, if Redis never answered.
                waited = (entry.deadline + self._wait_s, entry.gen, lookup_id)
                heapq.heappush(self._deadlines, waited)
        if ask:
            ask_partial(lookup_id, entry, True)
            return None
        if now < entry.deadline + self._wait_s:
            return None
        return self.expire(lookup_id, entry)

    def _finish_locked(self, lookup_id: str, entry: Entry, result: int, outcome: Outcome) -> None:
        now = time.monotonic()
        # ``finished`` before ``result``: lookup_cache reads them without the lock and
        # judges a result's age by ``finished`` as soon as it sees the result.
        entry.finished = now
        entry.outcome = outcome
        entry.result = result
        if self.inflight.get(lookup_id) is entry:
            del self.inflight[lookup_id]
        self.counts[outcome] += 1
        self.hit_tokens += result
        self.latency.observe(now - entry.started)
        self._finished[lookup_id] = (now, entry)
        self._finished.move_to_end(lookup_id)
        if entry.event is not None:
            entry.event.set()

    def pop(self, lookup_id: str, outcome: Outcome | None) -> None:
        """Forget ``lookup_id``; cancel it in Redis if still in flight or if asked to.

        ``outcome`` None is ``clear_lookup_status``: a finished generation that reached
        Redis is remembered (bounded), so a later ``cancel_lookup`` still releases it.
        """
        gen: int | None = None
        with self._lock:
            entry = self.entries.pop(lookup_id, None)
            if entry is None:
                if outcome == "cancelled":
                    gen = self._cleared.pop(lookup_id, None)
            else:
                if entry.result is None:
                    self._finish_locked(lookup_id, entry, 0, outcome or "cancelled")
                    gen = entry.gen
                elif outcome == "cancelled":
                    gen = entry.gen
                elif entry.sent:
                    self._remember_cleared_locked(lookup_id, entry.gen)
                if not entry.sent:
                    gen = None
                self._finished.pop(lookup_id, None)
        if gen is not None:
            self._cancel(lookup_id, gen)

    def _remember_cleared_locked(self, lookup_id: str, gen: int) -> None:
        self._cleared[lookup_id] = gen
        self._cleared.move_to_end(lookup_id)
        if len(self._cleared) > self._max_pending:
            self._cleared.popitem(last=False)

    def confirmed(self, lookup_id: str, entry: Entry, now: float) -> None:
        """Redis accepted ``entry``'s submit (sender thread): reconcile it when due."""
        self._confirmed.append((now + RECONCILE_AFTER_S, lookup_id, entry))

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
        """In-flight entries that expect any of ``ranks`` (when a rank dies: rare).

        The snapshot is one C-level copy under the GIL, not under the table's lock, so
        ``lookup()`` never waits for this scan.
        """
        items = list(self.inflight.items())
        return [(k, e) for k, e in items if ranks.intersection(e.expected)]

    def due_for_reconcile(self, now: float, limit: int) -> list[tuple[str, Entry]]:
        """Up to ``limit`` confirmed, still in-flight entries whose reconcile is due.

        Each comes back once per ``RECONCILE_AFTER_S`` while it stays in flight;
        finished or superseded ones drop out as they come due: O(due), no scan.
        """
        out: list[tuple[str, Entry]] = []
        queue = self._confirmed
        while queue and len(out) < limit and queue[0][0] <= now:
            _, lookup_id, entry = queue.popleft()
            if entry.result is None and self.inflight.get(lookup_id) is entry:
                out.append((lookup_id, entry))
                queue.append((now + RECONCILE_AFTER_S, lookup_id, entry))
        return out

    def evict_finished(self, now: float) -> int:
        """Drop finished entries nobody cleared within the retention; return how many."""
        cutoff = now - self._retention_s
        evicted = 0
        with self._lock:
            finished = self._finished
            while finished:
                lookup_id, (at, entry) = next(iter(finished.items()))
                if at >= cutoff:
                    break
                del finished[lookup_id]
                if self.entries.get(lookup_id) is entry:
                    del self.entries[lookup_id]
                    evicted += 1
        return evicted

    def drain_inflight(self) -> list[tuple[str, Entry]]:
        """End every in-flight entry as cancelled (shutdown); return the sent ones to cancel."""
        with self._lock:
            items = list(self.inflight.items())
            for k, e in items:
                self._finish_locked(k, e, 0, "cancelled")
        return [(k, e) for k, e in items if e.sent]
