"""How a rank's reports reach Redis: ``report.lua``, with a batch's XACK or from a queue.

A report made while the read loop serves a batch (an engine that answers inside
``async_lookup_and_prefetch``: a miss, a memory hit) rides with that batch's XACK
(and the loop's next read) in one write on the loop's link: no hand-off to another
thread. A report made at any other time (LMCache's engine calls
``send_response_to_scheduler`` from its storage event loop; the watchdog) is queued
for this module's thread, which pipelines whatever waits over its own link, so a slow
or unreachable Redis never stalls the engine (LMCache D14). Both ways are one
transport: :meth:`Reporter._calls` builds the batch's calls, and
:meth:`ScriptSet.run <broker_lookup.transport.script_runner.ScriptSet.run>` writes
them on a :class:`~broker_lookup.transport.link.Link` (the loop's, with the XACK and
the next read ahead and behind them; the thread's, alone). The queue is bounded: a report that does
not fit is answered ``overflow`` at once, so its lookup is released instead of queued
without limit while Redis is away.

Every report's answer (the script's, or ``error`` or ``overflow``) goes to ``settle``.

A lapse never costs a promise: a report answered ``fenced`` while no other process took
the rank over is queued again (:meth:`Reporter.resend`), and this thread sends it under
the token the beat learns at its next renewal (it waits for that renewal, within
:data:`FENCED_WAIT_S`, rather than send it again under the token just fenced). Any
batch waits likewise, while the lease lapsed, for the beat to renew it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, NamedTuple

import redis
from redis.exceptions import RedisError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import (
    BatchItem,
    Call,
    Fence,
    progress_call,
    report_answers,
    report_batch_call,
    report_call,
)
from broker_lookup.transport.batcher import Batcher
from broker_lookup.transport.lease import Lease
from broker_lookup.transport.link import Link
from broker_lookup.transport.script_runner import ScriptSet

__all__ = ["Report", "Reporter", "Served", "Settle"]

logger = logging.getLogger(__name__)

#: Reports that may wait for Redis at once; beyond, a report is answered ``overflow``.
MAX_QUEUED = 10_000
#: Most reports the reporter's thread sends in one round trip.
MAX_BATCH = 256
#: Most reports one ``report.lua`` call carries: the server runs a script to its end before
#: anything else, so a turn's reports (a read of batch entries may hand a rank thousands)
#: go in calls of this many, and no engine on the server waits on one long call.
SCRIPT_BATCH_MAX = 128
#: The longest the idle reporter thread sleeps without a bell. It has nothing to do on
#: an idle wake-up (no probe, unlike the client's sender), and every report rings the
#: bell, so this only bounds a wake-up lost to a bug: long, because each idle wake-up
#: of the 100 ms default cost an idle rank about 1 ms of CPU a second.
IDLE_TICK_S = 2.0
#: How many times a report answered ``fenced`` is sent again under a newer token.
MAX_RESENDS = 3
#: The longest the reporter's thread waits for the lease before a batch: sending while it
#: is not held (a lapse the beat is renewing) only gets the batch fenced.
FENCED_WAIT_S = 2.0


class Report(NamedTuple):
    """One rank's answer for one generation of a lookup, or its progress so far."""

    lookup_id: str
    gen: int
    hits: int  #: tokens loaded and pinned: the final count, or so far when ``progress``
    progress: bool = False  #: ``progress.lua`` (a prefix confirmed so far), not the report
    resends: int = 0  #: times it was sent again after a ``fenced`` answer


class Served(NamedTuple):
    """What the read loop sends once it served a batch: all in one write."""

    reports: list[Report]  #: made while the batch was served
    ack_ids: list[bytes]  #: every entry of the batch
    dead: list[Command]  #: XADDs dead-lettering the entries that could not be served


#: Called with each report and its answer: the script's, or ``error`` or ``overflow``.
Settle = Callable[[Report, str], None]


class _Window:
    """:meth:`Reporter.riding`'s context manager: a class, not a ``@contextmanager``
    generator, because the read loop enters one per turn (the generator costs four
    calls more each time)."""

    __slots__ = ("_reporter",)

    def __init__(self, reporter: Reporter) -> None:
        self._reporter = reporter

    def __enter__(self) -> list[Report]:
        return self._reporter._open_window()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._reporter._close_window(failed=exc is not None)


class Reporter(Batcher[Report]):
    """Sends reports: with the serving batch's XACK, or pipelined from its own thread."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        settle: Settle,
        lease: Lease | None = None,
    ) -> None:
        super().__init__(
            f"rank {rank} reporter",
            factory,
            ScriptSet(),
            config.redis_retries,
            MAX_BATCH,
            MAX_QUEUED,
            idle_tick_s=IDLE_TICK_S,
        )
        self._config = config
        self._keys = keys
        self._rank = rank
        self._stream = keys.requests
        self._group = keys.group(rank)
        self._settle = settle
        #: The rank's lease: every report carries its fence (None: unfenced, for tests).
        self._lease = lease
        self._lock = threading.Lock()
        self._riding: list[Report] | None = None  # open while the read loop serves a batch
        self._window = _Window(self)
        #: Reports that did not fit in the queue.
        self.overflows = 0
        self._fenced_after = 0  # the lease's renewals when the last fenced answer came

    def put(self, report: Report) -> None:
        """Send ``report`` (any thread): with the batch being served (the read loop sends
        it with :meth:`send_with_ack`), else queued for this reporter's thread
        (:meth:`_send_batch`)."""
        with self._lock:
            if self._riding is not None:
                self._riding.append(report)
                return
        if not self._put(report):
            self._overflow(report)

    def resend(self, report: Report) -> bool:
        """Queue ``report`` again after a ``fenced`` answer, for this reporter's thread to
        send under the token held then; False (nothing queued) after MAX_RESENDS."""
        if report.resends >= MAX_RESENDS:
            return False
        if self._lease is not None:
            self._fenced_after = self._lease.renewals
        self._enqueue(report._replace(resends=report.resends + 1))
        return True

    def riding(self) -> _Window:
        """On the read loop, around serving one batch: collects the reports made meanwhile.

        ``with reporter.riding() as reports``: the list is complete once the block ends;
        pass it to :meth:`send_with_ack`. If the block raises, the batch is not acked, so
        its reports are queued instead.
        """
        return self._window

    def send_with_ack(
        self,
        link: Link,
        client: redis.Redis,
        batch: Served,
        read: Command | None = None,
    ) -> None:
        """Send ``batch``'s dead letters, XACK and reports, then ``read``, in one write.

        ``read``'s reply stays on ``link`` for the loop. ``client`` (the loop's) reloads
        the scripts if the server lost them. If Redis fails, the reports go to the queue
        (this reporter's thread retries them) and the error propagates, untranslated
        (the loop translates its whole turn at once): the entries stay pending and are
        read again, then deduped.
        """
        reports = batch.reports
        ahead: list[Command] = list(batch.dead)
        if batch.ack_ids:
            ahead.append(("XACK", self._stream, self._group, *batch.ack_ids))
        try:
            calls, plan = self._calls(reports)
            results = self._scripts.run(link, client, calls, ahead, read)
        except (BrokerLookupError, RedisError):
            for report in reports:
                self._enqueue(report)
            raise
        settle = self._settle
        for report, result in zip(reports, _spread(results, plan), strict=True):
            settle(report, result.decode() if type(result) is bytes else self._answer(result))

    # -- the queued path (this reporter's thread) -----------------------------------

    def _enqueue(self, report: Report) -> None:
        if not self._put(report):
            self._overflow(report)

    def _overflow(self, report: Report) -> None:
        """The queue is full: answer ``report`` at once, so its lookup is released."""
        self.overflows += 1
        self._settle(report, "overflow")

    def _open_window(self) -> list[Report]:
        riding: list[Report] = []
        with self._lock:
            self._riding = riding
        return riding

    def _close_window(self, failed: bool) -> None:
        with self._lock:
            riding, self._riding = self._riding, None
        if failed and riding:
            for report in riding:
                self._enqueue(report)
            riding.clear()

    def _send_batch(self, link: Link, client: redis.Redis, batch: list[Report]) -> None:
        self._await_lease(batch)
        results: list[Any] | None = None
        plan: list[tuple[int, int]] = []
        for attempt in self._attempts(len(batch)):
            with attempt, translate_redis_errors("sending reports"):
                # Built per attempt: each carries the fence of the moment it is sent.
                calls, plan = self._calls(batch)
                results = self._scripts.run(link, client, calls)
        answers = (
            ["error"] * len(batch)
            if results is None
            else [self._answer(r) for r in _spread(results, plan)]
        )
        for report, answer in zip(batch, answers, strict=True):
            self._settle(report, answer)

    def _await_lease(self, batch: list[Report]) -> None:
        """Before a batch is sent: where nobody else took the rank, wait for the beat's
        next renewal if the batch holds a report fenced, and for the lease if it lapsed
        (the calls take the token of the moment they are made)."""
        lease = self._lease
        if lease is None or lease.holder is not None:
            return
        deadline = time.monotonic() + min(FENCED_WAIT_S, max(0.0, self._stop_by - time.monotonic()))
        if any(r.resends for r in batch):
            lease.wait_renewed(self._fenced_after, max(0.0, deadline - time.monotonic()))
        if not lease.held():
            lease.wait_held(max(0.0, deadline - time.monotonic()))

    # -- the script -------------------------------------------------------------------

    def _calls(self, reports: list[Report]) -> tuple[list[Call], list[tuple[int, int]]]:
        """The script calls that send ``reports`` (the one place a batch's calls are built,
        for both paths), and where each report's answer is: (the call, its place in that
        call's answers, -1 for a call of its own). Two or more final reports go in
        ``report.lua`` batches of at most :data:`SCRIPT_BATCH_MAX` (the fence read once a
        call); progress reports each in a ``progress.lua`` call of
        their own."""
        # The fence of the moment the reports are sent: a token this process holds now.
        fence = self._lease.fence if self._lease is not None else None
        finals = [r for r in reports if not r.progress]
        if len(finals) < 2:
            calls = [self._call(r, fence) for r in reports]
            return calls, [(i, -1) for i in range(len(reports))]
        most = SCRIPT_BATCH_MAX
        calls = [self._batch_call(finals[i : i + most], fence) for i in range(0, len(finals), most)]
        plan: list[tuple[int, int]] = []
        place = 0
        for report in reports:
            if report.progress:
                plan.append((len(calls), -1))
                calls.append(self._call(report, fence))
            else:
                plan.append(divmod(place, most))
                place += 1
        return calls, plan

    def _batch_call(self, finals: list[Report], fence: Fence | None) -> Call:
        return report_batch_call(
            self._keys,
            [BatchItem(r.lookup_id, r.gen, r.hits) for r in finals],
            rank=self._rank,
            done_maxlen=self._config.done_maxlen,
            engine_ttl_ms=self._config.engine_ttl_ms,
            fence=fence,
        )

    def _call(self, report: Report, fence: Fence | None) -> Call:
        if report.progress:
            return progress_call(
                self._keys,
                report.lookup_id,
                rank=self._rank,
                gen=report.gen,
                tokens=report.hits,
                fence=fence,
            )
        return report_call(
            self._keys,
            report.lookup_id,
            rank=self._rank,
            gen=report.gen,
            hits=report.hits,
            done_maxlen=self._config.done_maxlen,
            engine_ttl_ms=self._config.engine_ttl_ms,
            fence=fence,
        )

    def _answer(self, result: object) -> str:
        if type(result) is bytes:
            return result.decode()
        if isinstance(result, str):
            return result
        self.errors += 1
        logger.error("rank %d: report script failed: %r", self._rank, result)
        return "error"


def _spread(results: list[Any], plan: list[tuple[int, int]]) -> list[Any]:
    """Each report's answer from its calls' ``results`` (:meth:`Reporter._calls`'s plan):
    a batch call's list split, a failed batch's error given to each of its reports."""
    counts: dict[int, int] = {}
    for call, place in plan:
        if place >= 0:
            counts[call] = counts.get(call, 0) + 1
    lists = {call: report_answers(results[call], n) for call, n in counts.items()}
    return [results[call] if place < 0 else lists[call][place] for call, place in plan]
