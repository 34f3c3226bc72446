"""The client's sender thread: turns queued submits and cancels into pipelined scripts.

``lookup()`` and ``cancel_lookup()`` only append to a deque and set an event; this
thread drains everything queued per wake-up into one pipeline, so a burst of N
lookups costs one round trip, not N. The queue is bounded (``max_pending``), every
round trip is tracked by the circuit breaker, and every script is idempotent per
(lookup id, generation), so re-sending a batch whose reply was lost changes nothing.

A lookup's way out, in order: :meth:`Sender.submit` queues it (the caller's thread);
the :class:`~broker_lookup.transport.batcher.Batcher` loop hands a batch to
:meth:`Sender._send_batch`, which builds each script call next to its Lua
(:func:`~broker_lookup.protocol.scripts.submit_call`, ``cancel_call``), runs them in
one retried round trip, and settles each lookup in the table. The round trip goes over
the transport's :class:`~broker_lookup.transport.lean.LeanLink` (hiredis-packed EVALSHAs
on one pooled connection, raw replies) wherever :func:`~broker_lookup.transport.lean.open_link`
gives one, else through redis-py's pipeline (Redis Cluster: routing by slot is its client's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import redis

from broker_lookup.client.breaker import Breaker
from broker_lookup.client.insights import RankInsights
from broker_lookup.client.table import Entry, LookupTable
from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, BrokerUnavailable, translate_redis_errors
from broker_lookup.ops.ratelimit import RateLimitedLog
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest
from broker_lookup.protocol.scripts import (
    Call,
    ScriptSet,
    cancel_call,
    deadline_call,
    keep_call,
    submit_call,
)
from broker_lookup.transport.batcher import Batcher
from broker_lookup.transport.lean import Command, LeanLink, open_link

__all__ = ["Sender"]

logger = logging.getLogger(__name__)

_MAX_BATCH = 512
_PING: Command = ("PING",)


class Submit(NamedTuple):
    """A lookup to register in Redis: the table's entry and the request to broadcast.

    A NamedTuple, not a frozen dataclass: one is made per ``lookup()``, on the caller's
    thread, and a frozen dataclass sets each field through ``object.__setattr__``.
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
        self._expected = ""
        self._next_probe = 0.0
        #: The lean connection, made on the thread's first round trip (None: redis-py's).
        self._link: LeanLink | None = None
        self._link_checked = False
        self.batches = 0
        self.lost_cancels = 0
        self.lost_keeps = 0
        self.dropped = 0
        self._warn_lost = RateLimitedLog(logger)  # an outage loses them by the thousand

    def start(self, expected: str = "") -> None:
        """Start the thread; ``expected`` is the comma-separated rank list of every lookup."""
        self._expected = expected
        super().start()

    def submit(self, entry: Entry, request: LookupRequest) -> bool:
        """Queue a lookup (hot path: an append and an event set); False if the queue is full."""
        if self._put(Submit(entry, request)):
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

    def _run(self) -> None:
        try:
            super()._run()
        finally:
            if self._link is not None:
                self._link.close()

    def _lean(self, client: redis.Redis) -> LeanLink | None:
        if not self._link_checked:
            self._link_checked = True
            link = open_link(client)
            self._link = link if isinstance(link, LeanLink) else None
        return self._link

    def _run_calls(self, client: redis.Redis, calls: Sequence[Call]) -> list[Any]:
        link = self._lean(client)
        if link is None:
            return super()._run_calls(client, calls)
        return self._scripts.run_link(link, client, calls)

    def _ping(self, client: redis.Redis) -> None:
        link = self._lean(client)
        if link is None:
            client.ping()
        else:
            link.call([_PING])

    def _idle(self, client: redis.Redis) -> None:
        self._breaker.poll()
        # While the breaker is open because of us, nothing is queued to tell us when
        # Redis is back: probe it, twice a second.
        if not self._breaker.failing("sender") or self._queue:
            return
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + 0.5
        try:
            with self._breaker.track("sender"), translate_redis_errors("probing Redis"):
                self._ping(client)
        except BrokerLookupError:
            pass  # still down: the breaker stays open; probes are not counted as errors

    def _send_batch(self, client: redis.Redis, batch: list[Item]) -> None:
        """One round trip for ``batch``: build the calls, run them, settle each item."""
        pairs = [(item, call) for item in batch if (call := self._call_for(item)) is not None]
        if not pairs:
            return
        results = self._round_trip(client, [call for _, call in pairs])
        self.batches += 1
        now = time.monotonic()
        for (item, _), res in zip(pairs, results, strict=True):
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

    def _call_for(self, item: Item) -> Call | None:
        """The script call for ``item``; None for a lookup that finished before it was sent."""
        cfg = self._config
        if isinstance(item, Abort):
            return cancel_call(self._keys, item, maxlen=cfg.stream_maxlen)
        if isinstance(item, Keep):
            return keep_call(self._keys, item, maxlen=cfg.stream_maxlen)
        if isinstance(item, Deadline):
            if item.answer and item.entry.result is not None:
                return None  # answered meanwhile (a late completion, a cancel)
            abort = Abort(lookup_id=item.lookup_id, gen=item.entry.gen)
            ttl = cfg.key_grace_ms or 1
            return deadline_call(
                self._keys, abort, maxlen=cfg.stream_maxlen, ttl_ms=ttl, answer=item.answer
            )
        entry = item.entry
        entry.sent = True  # before reading result: see Entry.sent
        if entry.result is not None:
            return None  # finished before it was sent (timeout, cancel, superseded)
        if self._insights is not None and not entry.weight:  # a re-send keeps its weight
            entry.weight = self._insights.sampler.take(time.monotonic())
        return submit_call(
            self._keys,
            item.request,
            expected=self._expected,
            created_ms=int(time.time() * 1000),
            ttl_ms=item.request.budget_ms + cfg.wait_ms + cfg.key_grace_ms,
            maxlen=cfg.stream_maxlen,
            insights=entry.weight > 0,
        )

    def _round_trip(self, client: redis.Redis, calls: list[Call]) -> list[Any]:
        """Each call's result, or for all of them the error that made Redis unavailable."""
        try:
            with self._breaker.track("sender"):
                results = self._run_with_retries(client, calls)
                if results is None:
                    raise BrokerUnavailable("Redis unavailable after retries")
                return results
        except BrokerUnavailable as exc:
            return [exc] * len(calls)

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
