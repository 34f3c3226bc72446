"""The one owner of each lookup id's lifecycle on a rank: pure logic, no Redis, no engine.

States of the generation of an id that the engine holds (one owner per id, one generation
at a time; a release only ever frees the generation it belongs to)::

    request --> running --engine reports--> reporting --kept--> held --abort, pin TTL,
                  |   \\                         \\                      new gen, close--> released
                  |    \\--aborted / superseded---\\--not kept, aborted, newer gen waits--> released
                  \\--watchdog: no report by deadline + grace (the server reports 0)-----> released

Engines that report progress (the prefix confirmed loaded and pinned so far) leave it
on the running job; the sweeper takes what grew and sends it (``progress.lua``). A
lookup answered at its deadline with a partial prefix is a promise: every rank keeps
that prefix pinned until the scheduler is done with it or the pin TTL runs out. The
client sends a keep: the engine keeps that prefix and releases the rest
(``keep_memory_objs``); a running generation is no longer watched by the watchdog (its
answer is decided) but by the pin TTL from the keep, and is held once the engine
reports, without sending that report. A report that reaches Redis after the deadline
answered (``settled:<n>``) holds the smaller of ``n`` and its own count the same way,
whether or not the keep was read yet. A report whose answer says nothing of the
deadline's (``error``, ``overflow``, or ``fenced`` past its re-sends) holds the progress
it sent, which may have reached Redis and been answered: a lapse never costs a promise.

The engine never holds two generations of one id: a newer generation that arrives
while one is running or reporting waits in a single slot per id (a still newer one
replaces it; the replaced one is superseded), and starts when the engine's generation
is released, unless its own deadline passed meanwhile. Every transition to
``released`` happens once per generation and is the only time the server calls
``cleanup_memory_objs(id)``: the engine keys memory by the plain id, so a release is
only ever issued while the generation it belongs to is the one the engine holds.

The engine reports by plain id too, so a report is attributed to the generation
running now. After the watchdog released a generation, a report that comes while no
generation of that id runs is late: it is not sent, but the id is released once more,
because an engine that pins when its prefetch finishes (LMCache's) pinned after the
watchdog's release; :meth:`Lifecycle.release_all` (close) releases such ids too. If a
newer generation already runs, the two cannot be told apart (LMCache's engine contract
has no generation), and the report counts for the newer one.

When the sweeper runs is planned here too (:meth:`Lifecycle.plan_sweep`): at the
earliest timer, hold, memo expiry or progress to send, or at once for holds beyond
``capacity``. A timer, hold or progress due before the sweeper's planned wake rings it
(memos only free memory: their expiry waits for the next sweep). So an idle rank's
sweeper sleeps instead of ticking, and a busy one sweeps no more often than before.

Bounds: ``held`` by the pin TTL and ``capacity``; ``running`` and ``reporting`` by
time (the watchdog, the pin TTL after a keep, and the pin TTL for a report that never
settles); ``waiting`` by
one per tracked id; the memos by ``capacity`` and time; the timer heap by time.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from broker_lookup.protocol.messages import LookupRequest
from workers.pipeline.memo import Memo

__all__ = ["NOTHING", "Job", "Lifecycle", "State", "Step"]

State = Literal["running", "reporting", "held"]
_STATES: tuple[State, ...] = ("running", "reporting", "held")


class Job(msgspec.Struct, gc=False):
    """The generation of a lookup id that the engine holds."""

    # gc=False: a held job lives for the pins' TTL (a minute by default), so a rank holds
    # tens of thousands of them at a few thousand lookups a second. Tracked, each would
    # count towards the collections of the engine's process (vLLM's worker) and be walked
    # by every full one. Its fields are scalars: it can't be part of a cycle.

    lookup_id: str
    gen: int
    tokens: int
    started: float  #: monotonic seconds, when it was handed to the engine
    deadline: float  #: monotonic seconds after which its answer is worthless
    state: State = "running"
    aborted: bool = False  #: release instead of holding once it reports
    superseded: bool = False  #: a newer generation waits: release instead of reporting
    #: prefix the engine confirmed loaded and pinned so far (engines that report progress)
    progress: int = 0
    progress_sent: int = 0  #: the largest progress handed to the reporter
    #: the prefix a partial answer at the deadline kept (a keep entry): the engine's own
    #: report is then not sent, only awaited, and the job is held with this prefix
    kept: int | None = None
    #: monotonic seconds after which a running job is given up on: its deadline + grace
    #: (the watchdog), or once a keep decided its answer, the pin TTL after the keep
    expires: float = math.inf


@dataclass(frozen=True, slots=True)
class Step:
    """What the server does to the engine next, outside any lock, in this order."""

    release: bool = False  #: ``cleanup_memory_objs(id)``: the engine's generation is done
    start: LookupRequest | None = None  #: then hand this generation to the engine
    #: ``keep_memory_objs(id, keep)``: keep that prefix pinned, release the rest
    keep: int | None = None


NOTHING = Step()


@dataclass(slots=True)
class _Waiting:
    req: LookupRequest
    deadline: float


class Lifecycle:
    """Decides, per lookup id, what the engine does with each request, report and abort.

    Args:
        capacity: Most held ids, and most (id, gen) pairs each memo remembers.
        pin_ttl_s: How long a reported generation's pins are held at most.
        memo_ttl_s: How long a seen or aborted (id, gen) is remembered.
        grace_s: How long past its deadline a running generation may stay unreported.
        progress_delay_s: How long progress waits before it is sent, so that a lookup
            which ends meanwhile costs no write for it.
    """

    def __init__(
        self,
        capacity: int,
        pin_ttl_s: float,
        memo_ttl_s: float,
        grace_s: float,
        progress_delay_s: float = 0.05,
    ) -> None:
        self._lock = threading.Lock()
        self._capacity = capacity
        self._pin_ttl_s = pin_ttl_s
        self._memo_ttl_s = memo_ttl_s
        self._grace_s = grace_s
        self._jobs: dict[str, Job] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._held: OrderedDict[str, float] = OrderedDict()  # id -> until; TTL order
        self._progressed: dict[str, Job] = {}  # running jobs with progress not yet taken
        self._timers: list[tuple[float, int, str, int, State]] = []  # lazily deleted
        # Reporting ids -> when their report is given up on, oldest first. Every report
        # gets the same pin TTL, so they arrive in time order (to within the microseconds
        # between threads' clock reads) and need no heap; an id leaves when its job stops
        # reporting, so this holds only the reports Redis has not answered yet.
        self._unsettled: OrderedDict[str, float] = OrderedDict()
        self._seq = itertools.count()
        self._seen: Memo[tuple[str, int]] = Memo(capacity)
        self._aborted: Memo[tuple[str, int]] = Memo(capacity)
        self._late: Memo[str] = Memo(capacity)  # ids the watchdog released
        # A plain dict, every state present: a Counter's item update costs five times as
        # much, and the lifecycle updates it several times per lookup.
        self._states: dict[str, int] = dict.fromkeys(_STATES, 0)
        self._events: Counter[str] = Counter()
        self._progress_delay_s = progress_delay_s
        self._progress_due = math.inf  # when the oldest progress not yet taken is sent
        # The sweeper's plan: when it wakes next, and the soonest it may sweep. Until it
        # first plans it is awake (it plans before it sleeps), so nothing rings it.
        self._wake_at = -math.inf
        self._soonest = -math.inf
        self._ring: Callable[[], None] | None = None

    # -- the three inputs -----------------------------------------------------------

    def on_request(self, req: LookupRequest, now: float, deadline: float) -> tuple[str, Step]:
        """A valid, in-time request; ``deadline`` is its monotonic deadline on this rank.

        Returns the decision (``start``, ``release_then_start``, ``queued``, ``duplicate``,
        ``aborted``, ``superseded``) and the engine step.
        """
        key = (req.lookup_id, req.gen)
        with self._lock:
            if key in self._seen:
                return "duplicate", NOTHING
            self._seen.add(key, now + self._memo_ttl_s)
            if key in self._aborted:
                del self._aborted[key]
                return "aborted", NOTHING
            job = self._jobs.get(req.lookup_id)
            if job is None and req.gen >= 0:  # nothing runs, so nothing waits: start it
                return "start", self._begin(req, now, deadline)
            waiting = self._waiting.get(req.lookup_id)
            newest = max(job.gen if job else -1, waiting.req.gen if waiting else -1)
            if req.gen <= newest:
                return "superseded", NOTHING  # an older attempt, read after a newer one
            if job is None:
                return "start", self._begin(req, now, deadline)
            if job.state == "held":
                self._drop(job)
                return "release_then_start", Step(True, self._begin(req, now, deadline).start)
            job.superseded = True
            if waiting is not None:
                self._events["superseded"] += 1
            self._waiting[req.lookup_id] = _Waiting(req, deadline)
            return "queued", NOTHING

    def on_report(self, lookup_id: str, now: float) -> tuple[str, Job | None, Step]:
        """The engine reported ``lookup_id``.

        ``report``: the server sends the hits for the returned job (now ``reporting``) and
        calls :meth:`on_settled` with the answer. ``skipped``: aborted or superseded, do
        the step. ``kept``: a keep decided its answer; held, nothing to send. ``late``:
        the watchdog released that id; nothing is sent, and the step releases what the
        engine pinned since (unless a newer generation holds the id). ``unknown``: nothing
        runs for that id; ignore it.
        """
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is None or job.state != "running":
                if not self._late.discard(lookup_id):
                    return "unknown", None, NOTHING
                return "late", None, (Step(release=True) if job is None else NOTHING)
            if job.aborted or job.superseded:
                return "skipped", job, self._finish(job, now)
            if job.kept is not None:  # answered at the deadline: hold the kept prefix
                self._hold(job, now)
                return "kept", job, NOTHING
            self._move(job, "reporting")
            self._await_settle(job, now + self._pin_ttl_s)
            return "report", job, NOTHING

    def on_settled(
        self, lookup_id: str, gen: int, keep: bool, now: float, kept: int | None = None
    ) -> Step:
        """The report of (``lookup_id``, ``gen``) was written (``keep``: hold the pins) or not.

        ``kept``: the report came after the deadline answered the lookup that many tokens
        (the smaller of the answer and the report): that prefix is held as a keep would
        hold it (the step trims the engine to it), as the scheduler was promised it.
        """
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is None or job.gen != gen or job.state != "reporting":
                return NOTHING  # already released (watchdog, close) or a detached report
            if job.aborted or lookup_id in self._waiting or not (keep or kept):
                return self._finish(job, now)
            self._hold(job, now)
            if kept is None:
                return NOTHING
            job.kept = kept if job.kept is None else min(job.kept, kept)
            return Step(keep=job.kept)

    def progress_sent(self, lookup_id: str, gen: int) -> int | None:
        """The prefix of (``lookup_id``, ``gen``)'s progress handed to the reporter, which
        may have reached Redis (and a partial answer at the deadline with it); None if
        none was or that generation is not being reported."""
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is None or job.gen != gen or job.state != "reporting":
                return None
            return job.progress_sent or None

    def on_progress(self, lookup_id: str, tokens: int, now: float) -> bool:
        """The engine confirmed ``tokens`` of ``lookup_id``'s prefix loaded and pinned.

        True if that is news worth sending (the generation runs and ``tokens`` is above
        what it confirmed before, within its prompt); :meth:`take_progress` then hands it out.
        """
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is None or job.state != "running" or not job.progress < tokens <= job.tokens:
                return False
            job.progress = tokens
            if not self._progressed:
                # Sent once it is this old: a lookup that ends sooner costs no write.
                self._progress_due = now + self._progress_delay_s
                self._sooner(self._progress_due)
            self._progressed[lookup_id] = job
            return True

    def take_progress(self) -> list[Job]:
        """Running jobs whose progress grew since they were last taken (each then marked
        sent). The map is swapped under the lock; the scan runs outside it."""
        with self._lock:
            taken, self._progressed = self._progressed, {}
        out: list[Job] = []
        for job in taken.values():
            if job.state == "running" and job.progress > job.progress_sent and job.kept is None:
                job.progress_sent = job.progress
                out.append(job)
        return out

    def on_keep(self, lookup_id: str, gen: int, tokens: int, now: float) -> tuple[str, Step]:
        """The lookup (``lookup_id``, ``gen``) was answered ``tokens`` at its deadline.

        ``kept``: the engine keeps that prefix and releases the rest (the step); a running
        generation is held once the engine reports, and is no longer the watchdog's: if
        the engine never reports, it is released a pin TTL after this keep. ``unknown``:
        this rank holds no such generation (released, superseded, aborted, or never
        started): nothing to keep.
        """
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is None or job.gen != gen or job.aborted or job.superseded:
                return "unknown", NOTHING
            if job.state == "running" and job.kept is None:
                self._timer(now + self._pin_ttl_s, job)
            job.kept = tokens if job.kept is None else min(job.kept, tokens)
            return "kept", Step(keep=job.kept)

    def on_abort(self, lookup_id: str, gen: int, now: float) -> Step:
        """Cancel (``lookup_id``, ``gen``) in whatever state it is, or before it arrives."""
        with self._lock:
            job = self._jobs.get(lookup_id)
            if job is not None and job.gen == gen:
                if job.state == "held":
                    return self._finish(job, now)
                job.aborted = True  # released once it reports, or its report settles
                return NOTHING
            waiting = self._waiting.get(lookup_id)
            if waiting is not None and waiting.req.gen == gen:
                del self._waiting[lookup_id]
                return NOTHING
            if (lookup_id, gen) not in self._seen:
                self._aborted.add((lookup_id, gen), now + self._memo_ttl_s)
            return NOTHING

    # -- time -------------------------------------------------------------------------

    def plan_sweep(self, soonest: float, latest: float) -> float:
        """When the sweeper runs next (monotonic): the earliest timer, hold or memo expiry,
        progress to send, or at once for holds beyond ``capacity``, kept within
        [``soonest``, ``latest``]. Until then, what falls due sooner rings it
        (:meth:`ring_sweeper`)."""
        with self._lock:
            wake = min(max(self._next_due(), soonest), latest)
            self._wake_at = wake
            self._soonest = soonest
            return wake

    def ring_sweeper(self, ring: Callable[[], None]) -> None:
        """Call ``ring`` (any thread, lock held: it must only signal) when something falls
        due before the sweeper's planned wake."""
        self._ring = ring

    def due(self, now: float) -> list[tuple[str, Job, Step]]:
        """Generations whose time ran out, now released: ``watchdog`` (never reported by
        deadline + grace: the server reports 0), ``kept_expired`` (a keep decided its
        answer, and the engine did not report within the pin TTL after it: nothing to
        report) or ``unsettled`` (a report that never settled within the pin TTL)."""
        out: list[tuple[str, Job, Step]] = []
        with self._lock:
            while self._timers and self._timers[0][0] <= now:
                when, _, lookup_id, gen, state = heapq.heappop(self._timers)
                job = self._jobs.get(lookup_id)
                if job is None or job.gen != gen or job.state != state or when < job.expires:
                    continue  # it moved on before its time, or a keep moved its time on
                kind = "watchdog" if job.kept is None else "kept_expired"
                self._events[kind] += 1
                self._late.add(lookup_id, now + self._pin_ttl_s)
                out.append((kind, job, self._finish(job, now)))
            unsettled = self._unsettled
            while unsettled:
                lookup_id, when = next(iter(unsettled.items()))
                if when > now:
                    break
                job = self._jobs[lookup_id]  # reporting: the id leaves when it stops
                self._events["unsettled"] += 1
                out.append(("unsettled", job, self._finish(job, now)))
        return out

    def expired_holds(self, now: float) -> list[str]:
        """Held ids past the pin TTL or beyond ``capacity``, now released; also ages memos."""
        out: list[str] = []
        with self._lock:
            while self._held:
                lookup_id, until = next(iter(self._held.items()))
                if until > now and len(self._held) <= self._capacity:
                    break
                self._finish(self._jobs[lookup_id], now)  # held: nothing waits
                out.append(lookup_id)
            for memo in (self._seen, self._aborted, self._late):
                memo.expire(now)
        return out

    def release_all(self, now: float) -> list[str]:
        """Every id the engine may hold pins of (shutdown): its generation's, or what it
        pinned after the watchdog released it (no report since). Forgets every
        generation, but remembers the running ones as late: the engine may still report
        them after this, and that report releases what their prefetch pinned."""
        with self._lock:
            ids = list(self._jobs)
            ids += [lookup_id for lookup_id in self._late if lookup_id not in self._jobs]
            for job in self._jobs.values():
                if job.state == "running":
                    self._late.add(job.lookup_id, now + self._pin_ttl_s)
            for store in (self._jobs, self._waiting, self._held, self._progressed):
                store.clear()
            self._states = dict.fromkeys(_STATES, 0)
            self._timers.clear()
            self._unsettled.clear()
        return ids

    def events(self) -> dict[str, int]:
        """Counts of what was decided here: superseded, expired_waiting, watchdog,
        kept_expired, unsettled."""
        with self._lock:
            return dict(self._events)

    def sizes(self) -> dict[str, int]:
        """Size of every map, for heartbeats, metrics and the bounded-memory tests."""
        with self._lock:
            return {
                **{s: self._states[s] for s in _STATES},
                "waiting": len(self._waiting),
                "seen": len(self._seen),
                "aborted": len(self._aborted),
                "late": len(self._late),
                "timers": len(self._timers),
                "progressed": len(self._progressed),
            }

    # -- transitions (lock held) --------------------------------------------------------

    def _begin(self, req: LookupRequest, now: float, deadline: float) -> Step:
        job = Job(req.lookup_id, req.gen, req.tokens, now, deadline)
        self._jobs[req.lookup_id] = job
        self._states["running"] += 1
        self._timer(deadline + self._grace_s, job)
        return Step(start=req)

    def _finish(self, job: Job, now: float) -> Step:
        """Release the engine's generation of ``job``'s id; start the waiting one in time."""
        self._drop(job)
        waiting = self._waiting.pop(job.lookup_id, None)
        if waiting is None:
            return Step(release=True)
        if waiting.deadline <= now:
            self._events["expired_waiting"] += 1
            return Step(release=True)
        return Step(True, self._begin(waiting.req, now, waiting.deadline).start)

    def _drop(self, job: Job) -> None:
        del self._jobs[job.lookup_id]
        if self._progressed.get(job.lookup_id) is job:
            del self._progressed[job.lookup_id]
        self._states[job.state] -= 1
        if job.state == "held":
            del self._held[job.lookup_id]
        elif job.state == "reporting":
            del self._unsettled[job.lookup_id]

    def _hold(self, job: Job, now: float) -> None:
        self._move(job, "held")
        until = now + self._pin_ttl_s
        self._held[job.lookup_id] = until
        if until < self._wake_at:
            self._sooner(until)
        elif len(self._held) > self._capacity:
            self._sooner(-math.inf)  # over capacity: the oldest goes at the next sweep

    def _move(self, job: Job, state: State) -> None:
        if job.state == "reporting":  # settled: its report is no longer awaited
            del self._unsettled[job.lookup_id]
        self._states[job.state] -= 1
        self._states[state] += 1
        job.state = state

    def _await_settle(self, job: Job, when: float) -> None:
        self._unsettled[job.lookup_id] = when
        if when < self._wake_at:
            self._sooner(when)

    def _timer(self, when: float, job: Job) -> None:
        """Give ``job`` up at ``when`` (an earlier timer of it is then stale)."""
        job.expires = when
        heapq.heappush(self._timers, (when, next(self._seq), job.lookup_id, job.gen, job.state))
        if when < self._wake_at:
            self._sooner(when)

    def _sooner(self, when: float) -> None:
        """Something falls due at ``when``, before the sweeper's planned wake: bring the
        wake forward (never before the soonest sweep allowed) and ring it."""
        when = max(when, self._soonest)
        if when < self._wake_at:
            self._wake_at = when
            if self._ring is not None:
                self._ring()

    def _next_due(self) -> float:
        """When the sweep has work next: -inf for now, inf for never."""
        if len(self._held) > self._capacity:
            return -math.inf
        due = self._timers[0][0] if self._timers else math.inf
        if self._unsettled:
            due = min(due, next(iter(self._unsettled.values())))
        if self._progressed:
            due = min(due, self._progress_due)
        if self._held:
            due = min(due, next(iter(self._held.values())))
        memos = (self._seen, self._aborted, self._late)
        return min(due, *(memo.next_expiry() for memo in memos))
