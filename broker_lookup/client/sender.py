"""The client's sender thread: turns queued submits and cancels into pipelined scripts.

``lookup()`` and ``cancel_lookup()`` only append to a deque and set an event; this
thread drains everything queued per wake-up into one pipeline, so a burst of N
lookups costs one round trip, not N. The queue is bounded (``max_pending``), every
round trip is tracked by the circuit breaker, and every script is idempotent per
(lookup id, generation), so re-sending a batch whose reply was lost changes nothing.

A lookup's way out, in order: :meth:`Sender.submit` writes it on the caller's thread
where it can without waiting (below), else queues it; the
:class:`~broker_lookup.transport.batcher.Batcher` loop hands a batch to
:meth:`Sender._send_batch`, which builds the batch's script calls in one place
(:meth:`Sender._calls`: :meth:`Sender._due` says what still goes and marks a submit
sent, :meth:`Sender._call` builds each call next to its Lua, changing nothing), runs
them in one retried round trip (:meth:`ScriptSet.run
<broker_lookup.transport.script_runner.ScriptSet.run>` on the thread's
:class:`~broker_lookup.transport.link.Link`), and settles each lookup in the table.

**Submits the caller writes itself.** Handing a submit to this thread costs a wake-up
for the hand-off and one for the reply, each several times the write itself. So once a
round trip proved the connection (a plain TCP or unix socket), ``submit()`` writes the
submit on the caller's thread with a write that never waits
(:class:`~broker_lookup.client.caller_writes.CallerWrites`), and this thread reads its
reply later: every :data:`DIRECT_CHECK_S` while any is unread, or first thing in its
next round trip. The reply only confirms (or, an error, answers 0); the ranks and the
listener need nothing from it. The caller only *tries* the lock that orders the writes
(``CallerWrites.offer``), and anything it cannot write at once (the lock busy,
something queued, a full socket buffer) goes through the queue, and so does a burst (a submit
within :data:`DIRECT_GAP_S` of the last one while that one is unanswered), which stays
one pipelined batch. A torn write, a reset or a reply overdue by ``socket_timeout_ms``
drops the connection, and the unanswered submits go back to the head of the queue:
they are idempotent per (lookup id, generation), and one that finished meanwhile is
not sent again.
``submit_on_caller_thread`` False keeps every submit on this thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import redis

from broker_lookup.client.breaker import Breaker
from broker_lookup.client.caller_writes import CallerWrites
from broker_lookup.client.insights import RankInsights
from broker_lookup.client.table import Entry, LookupTable
from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, BrokerUnavailable, translate_redis_errors
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest
from broker_lookup.protocol.scripts import (
    Call,
    cancel_call,
    deadline_call,
    keep_call,
    submit_answers,
    submit_batches,
    submit_call,
)
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.transport.batcher import Batcher
from broker_lookup.transport.link import Link
from broker_lookup.transport.script_runner import ScriptSet, is_noscript

__all__ = ["Sender"]

logger = logging.getLogger(__name__)

_MAX_BATCH = 512
_PING: Command = ("PING",)
#: A submit this soon after the caller's last one, while that one is still unanswered,
#: takes the queue: a burst costs the thread one wake-up and Redis one pipelined batch,
#: where one write each would cost the caller a syscall each and split the ranks' reads
#: into smaller batches.
DIRECT_GAP_S = 0.0005
#: While submits the caller wrote are unanswered, the thread reads their replies this
#: often (and before its own next round trip).
DIRECT_CHECK_S = 0.005
#: It keeps that pace this long after the caller's last submit before it sleeps long
#: again, so a steady trickle of lookups never needs the bell.
DIRECT_LINGER_S = 0.05
#: The longest the thread sleeps with nothing queued or unanswered while Redis answers.
#: Then its tick has nothing to do but log the breaker's transitions, and every item
#: rings the bell; each idle wake-up costs the scheduler process about 0.15 ms of CPU.
#: While the breaker is open it keeps the Batcher's short tick: it probes, and logs the
#: closing, on time.
HEALTHY_IDLE_S = 1.0


class Submit(msgspec.Struct, frozen=True, gc=False, eq=False):
    """A lookup to register in Redis: the table's entry and the request to broadcast.

    Not tracked by the GC, as its entry and request (see ``table.Entry``): under load it
    waits in the queue for the lookup's round trip.
    """

    entry: Entry
    request: LookupRequest

    @property
    def lookup_id(self) -> str:
        """The caller's id."""
        return self.request.lookup_id


class Deadline(NamedTuple):
    """A sent lookup past its deadline (``deadline.lua``): ask Redis for its partial answer,
    or (``answer`` False: the client answered 0) cancel it. Either way Redis names the
    ranks that had not reported."""

    lookup_id: str
    entry: Entry
    answer: bool = True


#: What the sender's queue holds: a lookup to submit, a generation to cancel, a
#: deadline's partial answer to ask for, or a partial answer's prefix for ranks to keep.
Item = Submit | Abort | Deadline | Keep


class Sender(Batcher[Item]):
    """Owns the write connection; the only thread that submits and cancels."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        table: LookupTable,
        factory: Callable[[], redis.Redis],
        scripts: ScriptSet,
        breaker: Breaker,
        insights: RankInsights | None = None,
        expected: str = "",
    ) -> None:
        super().__init__(
            "client sender",
            factory,
            scripts,
            config.redis_retries,
            _MAX_BATCH,
            max_queue=config.max_pending,
        )
        self._config = config
        self._keys = keys
        self._table = table
        self._breaker = breaker
        #: Counts the ranks each deadline found unreported (None: rank_insights off).
        self._insights = insights
        #: The comma-separated rank list of every lookup.
        self._expected = expected
        self._next_probe = 0.0
        #: The submits the caller wrote itself on this thread's link; its lock orders every
        #: write there (the caller's and this thread's round trips) with the replies to read.
        self._writes: CallerWrites[Submit] = CallerWrites(
            config.max_pending, config.socket_timeout_ms
        )
        self.batches = 0
        self.lost_cancels = 0
        self.lost_keeps = 0
        self.dropped = 0
        self._warn_lost = RateLimitedLog(logger)  # an outage loses them by the thousand
        self._warn_rewired = RateLimitedLog(logger)

    @property
    def direct_submits(self) -> int:
        """Submits the caller wrote itself."""
        return self._writes.count

    # -- the caller's thread ------------------------------------------------------------

    def submit(self, entry: Entry, request: LookupRequest) -> bool:
        """Send a lookup: written on the caller's thread where it can be without waiting,
        else queued (an append and maybe a bell). False if the queue is full."""
        item = Submit(entry, request)
        # Behind something queued, or stopping, the queue keeps the order.
        if not self._queue and not self._stop.is_set():
            written = self._writes.offer(item, entry, self._direct_command, DIRECT_GAP_S)
            if written is not None:
                # A thread in its long idle sleep would read the reply up to a tick
                # late; a torn write it must drop at once.
                if not written or self._sleep_s > DIRECT_CHECK_S:
                    self._wake()
                return True
        if self._put(item):
            return True
        self.dropped += 1
        return False

    def cancel(self, lookup_id: str, gen: int) -> None:
        """Queue a cancel of one generation that was sent (dropped, counted, if full)."""
        if not self._put(Abort(lookup_id=lookup_id, gen=gen)):
            self._lost_cancel(lookup_id, gen, "the send queue is full")

    def deadline(self, lookup_id: str, entry: Entry, answer: bool) -> None:
        """Queue ``entry``'s deadline: its partial answer (``answer``), else its cancel.

        If the queue is full, a partial answer is 0 at once and a cancel is lost (counted).
        """
        if self._put(Deadline(lookup_id, entry, answer)):
            return
        if answer:
            self._table.expire(lookup_id, entry)
        else:
            self._lost_cancel(lookup_id, entry.gen, "the send queue is full")

    # -- this thread ----------------------------------------------------------------

    def _send_batch(self, link: Link, client: redis.Redis, batch: list[Item]) -> None:
        """One round trip for ``batch``: build the calls, run them, settle each item."""
        writes = self._writes
        with writes.wire:  # the insights sampler is the caller's too
            pairs = self._calls(batch)
        if not pairs:
            return
        # Consecutive submits ride one submit.lua batch: the server pays one script call
        # for them, not one each.
        packed = submit_batches([call for _, call in pairs], horizon_ms=self._config.key_ttl_ms)
        calls = [call for call, _ in packed]
        results: list[Any] | None = None
        try:
            with self._breaker.track("sender"):
                for attempt in self._attempts(len(calls)):
                    with attempt, writes.wire, translate_redis_errors("running Lua scripts"):
                        # The caller's submits went out first: their replies too.
                        self._read_written(wait=True)
                        self._check_attempt()
                        results = self._scripts.run(link, client, calls)
                if results is None:
                    raise BrokerUnavailable("Redis unavailable after retries")
        except BrokerUnavailable as exc:
            writes.open = False
            results = [exc] * len(calls)
        else:
            allowed = self._config.submit_on_caller_thread and not self._stop.is_set()
            writes.open_on(link, allowed)
        self.batches += 1
        now = time.monotonic()
        answers = submit_answers(results, [n for _, n in packed])
        for (item, _), res in zip(pairs, answers, strict=True):
            self._settle(item, res, now)

    def _tick(self) -> float:
        writes = self._writes
        if writes.owed or time.monotonic() - writes.last_at < DIRECT_LINGER_S:
            return DIRECT_CHECK_S
        if writes.torn or self._breaker.is_open():
            return super()._tick()
        return HEALTHY_IDLE_S

    def _idle(self, link: Link, client: redis.Redis) -> None:
        writes = self._writes
        if writes.owed or writes.torn:
            with writes.wire:
                self._read_written(wait=False)
        self._breaker.poll()
        # While the breaker is open because of us, nothing is queued to tell us when
        # Redis is back: probe it, twice a second.
        if not self._breaker.failing("sender") or self._queue or not self.may_attempt():
            return
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + 0.5
        try:
            with self._breaker.track("sender"), translate_redis_errors("probing Redis"):
                self._ping(link)
        except BrokerLookupError:
            pass  # still down: the breaker stays open; probes are not counted as errors

    def _closing(self, link: Link) -> None:
        # Under the lock the caller writes under: its socket is never closed (and its
        # descriptor never reused) beneath a write. The client's close follows.
        with self._writes.wire:
            self._writes.open = False
            # What has been answered is settled; the rest only confirmed lookups that
            # closing abandons anyway, so a stalled server cannot stall close().
            self._read_written(wait=False, final=True)
            link.close()

    def _read_written(self, wait: bool, final: bool = False) -> None:
        """Settle the caller's submits answered so far (all of them: ``wait``); a torn
        write, a transport error or an overdue reply drops the connection and queues the
        rest again (``final``: stopping, nothing will send them). Holds the wire."""
        answered, broken = self._writes.replies(wait)
        now = time.monotonic()
        again: list[Item] = []
        for item, reply in answered:
            if is_noscript(reply):
                again.append(item)  # did not run: the batch path reloads the scripts
            else:
                self._settle(item, reply, now)
        self._queue.extendleft(reversed(again))
        if broken is None:
            return
        # Written before anything now queued (the caller writes only while the queue is
        # empty): at the queue's head, the order on the wire is kept.
        items = self._writes.rewire()
        self.errors += 1
        if final:  # stopping: nothing will send them; their lookups answer 0 at close
            return
        self._queue.extendleft(reversed(items))
        self._warn_rewired(
            logging.WARNING,
            "client sender: reconnecting, %d submit(s) written without a reply will be "
            "sent again: %s",
            len(items),
            broken,
        )

    def _ping(self, link: Link) -> None:
        with self._writes.wire:
            self._read_written(wait=True)
            self._check_attempt()
            link.call([_PING])

    def _check_attempt(self) -> None:
        """Raise BrokerUnavailable if stopping has ended what this round trip may do: a
        wait for the caller's replies can outlast close()'s grace, whose end closes the
        connection under it, and the link would connect again."""
        if not self.may_attempt():
            raise BrokerUnavailable("the client is closing: no new round trip")

    def _settle(self, item: Item, res: Any, now: float) -> None:
        """One script's answer for ``item``, sent in a batch or by the caller itself."""
        if isinstance(res, Exception):
            self._failed(item, res)
        elif isinstance(item, Submit):
            self._table.confirmed(item.lookup_id, item.entry, now)
        elif isinstance(item, Deadline):
            self._answered(item, res)

    def _answered(self, item: Deadline, reply: Any) -> None:
        """``deadline.lua``'s answer for ``item``: settle the entry; ranks keep a partial one."""
        gen = item.entry.gen
        try:
            answer, how, late = int(reply[0]), _text(reply[1]), _text(reply[2])
        except (TypeError, ValueError, IndexError, UnicodeDecodeError):
            logger.error("deadline script answered %r for %.200r", reply, item.lookup_id)
            self._table.expire(item.lookup_id, item.entry)
            return
        if late and self._insights is not None:
            self._insights.record_late([int(r) for r in late.split(",") if r.isdigit()])
        if not item.answer:
            return  # a cancel: the client answered 0 already
        if how == "partial" and answer > 0:
            finished = self._table.finish(item.lookup_id, gen, answer, "partial")
            # The listener's reconciliation may have read the answer from the hash first;
            # the ranks must be told to keep it either way (an entry answered 0 instead
            # is being cancelled, and its cancel follows this keep on the stream).
            if finished or item.entry.result == answer:
                self._put(Keep(lookup_id=item.lookup_id, gen=gen, tokens=answer))
        elif how == "complete":
            self._table.finish(item.lookup_id, gen, answer, "hit" if answer > 0 else "miss")
        else:  # nothing confirmed on some rank: the script cancelled it already
            self._table.finish(item.lookup_id, gen, 0, "timeout")

    def _calls(self, batch: list[Item]) -> list[tuple[Item, Call]]:
        """The items of ``batch`` still to send, each with its script call: the one place
        where a batch's calls are built. Holds the wire (the sampler is the caller's too)."""
        return [(item, self._call(item)) for item in batch if self._due(item)]

    def _direct_command(self, item: Submit) -> Command | None:
        """The command the caller writes for ``item`` itself; None: nothing to send."""
        return self._scripts.command(self._call(item)) if self._due(item) else None

    def _due(self, item: Item) -> bool:
        """Whether ``item`` still goes out: False for a lookup finished before it was sent
        (timeout, cancel, superseded) or a deadline answered meanwhile. A submit that goes
        is marked sent here (before its result is read: see ``Entry.sent``) and, with
        rank insights on, sampled (a re-send keeps its weight)."""
        if isinstance(item, Deadline):
            return not (item.answer and item.entry.result is not None)
        if not isinstance(item, Submit):
            return True
        entry = item.entry
        entry.sent = True
        if entry.result is not None:
            return False
        if self._insights is not None and not entry.weight:
            entry.weight = self._insights.sampler.take(time.monotonic())
        return True

    def _call(self, item: Item) -> Call:
        """The script call for ``item`` (:meth:`_due` first); reads it, changes nothing."""
        cfg = self._config
        if isinstance(item, Abort):
            return cancel_call(
                self._keys, item, maxlen=cfg.stream_maxlen, engine_ttl_ms=cfg.engine_ttl_ms
            )
        if isinstance(item, Keep):
            return keep_call(
                self._keys, item, maxlen=cfg.stream_maxlen, engine_ttl_ms=cfg.engine_ttl_ms
            )
        if isinstance(item, Deadline):
            abort = Abort(lookup_id=item.lookup_id, gen=item.entry.gen)
            return deadline_call(
                self._keys,
                abort,
                maxlen=cfg.stream_maxlen,
                ttl_ms=cfg.key_grace_ms or 1,
                engine_ttl_ms=cfg.engine_ttl_ms,
                answer=item.answer,
            )
        return submit_call(
            self._keys,
            item.request,
            expected=self._expected,
            created_ms=int(time.time() * 1000),
            ttl_ms=item.request.budget_ms + cfg.wait_ms + cfg.key_grace_ms,
            maxlen=cfg.stream_maxlen,
            engine_ttl_ms=cfg.engine_ttl_ms,
            insights=item.entry.weight > 0,
        )

    def _failed(self, item: Item, exc: Exception) -> None:
        if isinstance(item, Submit):
            # Redis is unreachable or refused: answer 0 now instead of at the timeout.
            self._table.expire(item.lookup_id, item.entry, "error")
        elif isinstance(item, Deadline):
            if item.answer:
                self._table.expire(item.lookup_id, item.entry)  # 0, and its cancel is queued
            else:
                self._lost_cancel(item.lookup_id, item.entry.gen, str(exc))
        elif isinstance(item, Keep):
            self.lost_keeps += 1
            self._warn_lost(
                logging.WARNING,
                "%d keep(s) not delivered, latest %.200r gen %d: %s; their ranks hold what "
                "they loaded until it is released",
                self.lost_keeps,
                item.lookup_id,
                item.gen,
                exc,
            )
        else:
            self._lost_cancel(item.lookup_id, item.gen, str(exc))

    def _lost_cancel(self, lookup_id: str, gen: int, why: str) -> None:
        self.lost_cancels += 1
        self._warn_lost(
            logging.WARNING,
            "%d cancel(s) not delivered, latest %s gen %d: %s; keys expire by TTL and "
            "workers release pins after worker_pin_ttl_ms",
            self.lost_cancels,
            lookup_id[:200],
            gen,
            why,
        )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
