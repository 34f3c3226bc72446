"""What a rank does with each message, report and timer: the lifecycle's steps, carried out.

:class:`~workers.pipeline.lifecycle.Lifecycle` decides, per lookup id, what happens
next (start, queue, drop, release); the :class:`Dispatcher` carries that out on the
engine and hands reports to its :class:`~workers.pipeline.reporter.Reporter`:

* a request or abort from the read loop -> the lifecycle's decision -> release the
  engine's old generation and/or start the new one (``async_lookup_and_prefetch``);
* the engine's report (any thread) -> checked -> the reporter;
* the report's answer from Redis -> held (pins kept, or the prefix a partial answer at
  the deadline promised) or released;
* the sweeper's clock -> the watchdog's 0 for an engine that never reported, and
  releases of pins past their TTL.

A worker always answers: an engine that raises or reports nonsense
reports 0, and one that never reports is answered 0 at its deadline plus
``worker_watchdog_grace_ms`` and released.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable

import redis

from broker_lookup.config import LookupConfig
from broker_lookup.engine import LookupEngine
from broker_lookup.histogram import LATENCY_BUCKETS
from broker_lookup.printable import shown
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest, Request
from broker_lookup.protocol.scripts import report_answer
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.transport.lease import Lease
from workers.pipeline.lifecycle import Job, Lifecycle, Step
from workers.pipeline.reporter import Report, Reporter

__all__ = ["Dispatcher"]

logger = logging.getLogger(__name__)

#: Report answers after which the rank holds the generation's pins.
_KEEP = ("complete", "recorded", "duplicate")
#: Report answers that say nothing of what the scheduler was answered: after one, a job
#: whose progress may have reached Redis keeps that prefix (a partial answer may stand on it).
_UNSURE = ("error", "overflow", "fenced")


class Dispatcher:
    """Carries out one rank's lifecycle steps on its engine, and sends its reports.

    Args:
        engine: the rank's engine.
        lifecycle: the one owner of every lookup id's lifecycle on this rank.
        config: the rank's config (pin TTL, watchdog grace, report limits).
        keys: the engine's key space.
        rank: this rank.
        factory: connections for the reporter's own thread.
        clock: the monotonic clock (a test's own, to step time by hand).
        lease: the rank's lease, whose token fences every report (None: unfenced).
    """

    def __init__(
        self,
        engine: LookupEngine,
        lifecycle: Lifecycle,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        clock: Callable[[], float] = time.monotonic,
        lease: Lease | None = None,
    ) -> None:
        self._clock = clock
        self._engine = engine
        self._lifecycle = lifecycle
        self._rank = rank
        self._pin_ttl_s = config.worker_pin_ttl_ms / 1000
        self._grace_ms = config.worker_watchdog_grace_ms
        #: Progress is only worth a Redis write where the deadline may answer with it.
        self._progress_on = config.partial_answers
        #: Sends the reports (its thread is started and stopped by the server).
        self._lease = lease
        self.reporter = Reporter(config, keys, rank, factory, self.settle, lease)
        self._lock = threading.Lock()  # counts and the engine histogram: every thread
        self._counts: dict[str, int] = {}
        #: Engine time from start to report, per LATENCY_BUCKETS bucket (+ overflow).
        self.engine_seconds = [0] * (len(LATENCY_BUCKETS) + 1)
        self.engine_seconds_sum = 0.0
        self._warn = RateLimitedLog(logger)
        self._watchdog_log = RateLimitedLog(logger)
        #: Told each lookup handed to the engine (id, chunk hashes): the rank's
        #: reservations release a prompt's reservation once its own lookup reports.
        self.on_start: Callable[[str, list[int]], None] | None = None

    # -- from the read loop ---------------------------------------------------------

    def handle(self, msg: Request, remaining_ms: float) -> None:
        """Serve one entry; ``remaining_ms`` is how long it stays worth answering."""
        now = self._clock()
        if isinstance(msg, Abort):
            step = self._lifecycle.on_abort(msg.lookup_id, msg.gen, now)
            self._apply(msg.lookup_id, step, "aborts")
            return
        if isinstance(msg, Keep):
            decision, step = self._lifecycle.on_keep(msg.lookup_id, msg.gen, msg.tokens, now)
            self._apply(msg.lookup_id, step, "keep_" + decision)
            return
        if self._rank not in msg.expected:
            self.count("not_expected")
            return
        if remaining_ms <= 0:
            self.count("expired")
            return
        # Local and monotonic from here on; capped so no wire value outlives the pin TTL.
        deadline = now + min(remaining_ms / 1000, self._pin_ttl_s)
        decision, step = self._lifecycle.on_request(msg, now, deadline)
        self._apply(msg.lookup_id, step, decision)

    def serve(self, messages: list[tuple[Request, float]]) -> list[Report]:
        """Each ``(entry, remaining_ms)`` of a batch through :meth:`handle`, in the
        reporter's window: the reports made meanwhile (the read loop sends them with the
        batch's XACK). If one raises, they are queued instead."""
        handle = self.handle
        with self.reporter.riding() as reports:
            for msg, remaining_ms in messages:
                handle(msg, remaining_ms)
        return reports

    # -- from the engine (any thread) -------------------------------------------------

    def report(self, lookup_id: str, hits: object) -> None:
        """The engine finished ``lookup_id`` with ``hits`` tokens loaded: sent, if wanted."""
        now = self._clock()
        outcome, job, step = self._lifecycle.on_report(lookup_id, now)
        if job is None:
            # late: what the engine pinned after the watchdog's release is released now
            self._apply(lookup_id, step, "report_" + outcome)
            if outcome == "unknown":
                self._warn(
                    logging.WARNING,
                    "rank %d: report for %s which is not running; ignored",
                    self._rank,
                    shown(lookup_id),
                )
            return
        self._observe(now - job.started)
        if outcome == "skipped":  # aborted or superseded: nobody wants the answer
            self._apply(lookup_id, step, "report_skipped_aborted")
            return
        if outcome == "kept":  # answered at the deadline: held, nothing to send
            self.count("report_after_keep")
            return
        if type(hits) is not int or not 0 <= hits <= job.tokens:
            hits = self._invalid_hits(job, hits)
        self.reporter.put(Report(job.lookup_id, job.gen, hits))

    def progress(self, lookup_id: str, tokens: object) -> None:
        """The engine confirmed ``tokens`` of ``lookup_id``'s prefix loaded and pinned (any
        thread). Only remembered here: the sweeper sends what grew, so a lookup that ends
        before the next sweep costs no Redis write for its progress."""
        if not self._progress_on:
            return
        if type(tokens) is not int or tokens <= 0:
            self.count("progress_invalid")
            return
        self._lifecycle.on_progress(lookup_id, tokens, self._clock())

    # -- from the reporter -----------------------------------------------------------

    def settle(self, report: Report, answer: str) -> None:
        """Redis answered ``report``: its generation's pins held, or released (the reporter)."""
        if report.progress:  # nothing to decide: the lookup runs on
            if not (answer == "fenced" and self._resend(report)):
                self.count("progress_" + answer)
            return
        name, decided = report_answer(answer)
        if name == "fenced" and self._resend(report):
            return
        now = self._clock()
        # After the deadline answered (settled): the promised prefix, at most what we hold.
        kept = None if decided is None else min(decided, report.hits)
        if kept is None and name in _UNSURE:
            # The deadline may have answered the progress sent: keep it, as a keep would.
            kept = self._lifecycle.progress_sent(report.lookup_id, report.gen)
        step = self._lifecycle.on_settled(report.lookup_id, report.gen, name in _KEEP, now, kept)
        self._apply(report.lookup_id, step, "report_" + name)

    def _resend(self, report: Report) -> bool:
        """Send a report fenced by a lapse again, under the token held then: True if it
        was queued. Not where another process took the rank over (its answer stands)."""
        lease = self._lease
        if lease is None or lease.holder is not None or not self.reporter.resend(report):
            return False
        self.count("reports_resent")
        return True

    # -- from the sweeper's clock ----------------------------------------------------

    def sweep(self, now: float) -> None:
        """The watchdog, then pins past their TTL (monotonic ``now``)."""
        for kind, job, step in self._lifecycle.due(now):
            if kind == "watchdog":  # kept_expired: its answer was decided, nothing to report
                self._on_watchdog(job)
            self._apply(job.lookup_id, step)
        for lookup_id in self._lifecycle.expired_holds(now):
            self._release(lookup_id)
        for job in self._lifecycle.take_progress():
            self.reporter.put(Report(job.lookup_id, job.gen, job.progress, progress=True))

    def _on_watchdog(self, job: Job) -> None:
        """The engine never reported ``job`` (LMCache D9): answer 0 for it ourselves."""
        self._watchdog_log(
            logging.ERROR,
            "rank %d: engine did not report %s (gen %d) by its deadline + %d ms; "
            "reporting 0 and releasing its memory",
            self._rank,
            shown(job.lookup_id),
            job.gen,
            self._grace_ms,
        )
        if not (job.aborted or job.superseded):  # else nobody waits for the answer
            self.reporter.put(Report(job.lookup_id, job.gen, 0))

    # -- at shutdown -----------------------------------------------------------------

    def release_all(self) -> None:
        """Release every generation the engine holds, and what it pinned after a watchdog
        release (the threads are stopped)."""
        for lookup_id in self._lifecycle.release_all(self._clock()):
            self._release(lookup_id)

    # -- the engine --------------------------------------------------------------------

    def _apply(self, lookup_id: str, step: Step, counted: str | None = None) -> None:
        """Carry out a lifecycle step: release the engine's generation, then start the next.

        ``counted`` (the decision that led here) and the step's own counters are added
        under one acquisition of the lock: this runs several times per lookup.
        """
        release = step.release
        start = step.start
        if step.keep is not None:
            self._keep(lookup_id, step.keep)
        with self._lock:
            counts = self._counts
            if counted is not None:
                counts[counted] = counts.get(counted, 0) + 1
            if release:
                counts["released"] = counts.get("released", 0) + 1
            if start is not None:
                counts["requests"] = counts.get("requests", 0) + 1
        if release:
            self._cleanup(lookup_id)
        if start is not None:
            self._start(start)

    def _start(self, req: LookupRequest) -> None:
        """Hand ``req`` to the engine (counted as a request by the caller)."""
        if self.on_start is not None:
            self.on_start(req.lookup_id, req.hashes)
        try:
            self._engine.async_lookup_and_prefetch(
                req.lookup_id,
                req.hashes,
                req.offsets,
                pin=True,
                request_configs=req.request_configs,
            )
        except Exception as exc:  # any engine failure: the rule is that a worker always answers
            self._engine_failed(req, exc)

    def _engine_failed(self, req: LookupRequest, exc: Exception) -> None:
        """The engine raised ``exc`` when it was handed ``req``: counted, logged, 0 reported."""
        self.count("engine_errors")
        logger.error(
            "rank %d: engine failed to start %s; reporting 0",
            self._rank,
            shown(req.lookup_id),
            exc_info=exc,
        )
        self.report(req.lookup_id, 0)

    def _keep(self, lookup_id: str, tokens: int) -> None:
        """The engine keeps ``tokens`` of ``lookup_id``'s prefix pinned, releases the rest."""
        keep = getattr(self._engine, "keep_memory_objs", None)
        if not callable(keep):  # optional: such an engine holds all it loaded until release
            self.count("keep_unsupported")
            return
        try:
            keep(lookup_id, tokens)
        except Exception:
            self.count("engine_errors")
            logger.exception("rank %d: engine failed to keep %s", self._rank, shown(lookup_id))

    def _release(self, lookup_id: str) -> None:
        self.count("released")
        self._cleanup(lookup_id)

    def _cleanup(self, lookup_id: str) -> None:
        """The engine's release of ``lookup_id`` (counted as released by the caller)."""
        try:
            self._engine.cleanup_memory_objs(lookup_id)
        except Exception:  # engine bug: count and log, the loop must go on
            self.count("engine_errors")
            logger.exception("rank %d: engine failed to release %s", self._rank, shown(lookup_id))

    def _invalid_hits(self, job: Job, hits: object) -> int:
        """0 for ``hits`` outside ``0..job.tokens``: counted and logged."""
        self.count("engine_invalid_hits")
        logger.error(
            "rank %d: engine reported %r hits for %s (%d tokens); reporting 0",
            self._rank,
            hits,
            shown(job.lookup_id),
            job.tokens,
        )
        return 0

    # -- observability -----------------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``what`` (any thread)."""
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + n

    def counts(self) -> dict[str, int]:
        """A copy of the counters."""
        with self._lock:
            return dict(self._counts)

    def sizes(self) -> dict[str, int]:
        """Size of every map of the lifecycle (running, held, waiting, memos, timers)."""
        return self._lifecycle.sizes()

    def engine_pins(self) -> int | None:
        """Chunks the engine holds pinned, if it says (``stats()["pinned_chunks"]``, as
        ReferenceEngine's): for the heartbeat, so an operator sees what pins cost."""
        stats = getattr(self._engine, "stats", None)
        if not callable(stats):
            return None
        try:
            value = stats().get("pinned_chunks")
        except Exception:  # an engine's stats must never stop the heartbeat
            return None
        return value if type(value) is int else None

    def _observe(self, seconds: float) -> None:
        with self._lock:
            self.engine_seconds[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.engine_seconds_sum += seconds
