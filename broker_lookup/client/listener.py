"""The client's listener thread: completions, timeouts, rank liveness, reconciliation.

It blocks in ``XREAD BLOCK`` on ``bl:{E}:done`` (its own connection, whose socket
timeout is BLOCK plus the breaker's threshold, so a stalled server costs at most that)
and publishes results into the lookup table. Between reads it sweeps: in-flight
lookups past their deadline end as 0 and are cancelled even if nobody polls them
(LMCache D11); ranks without a heartbeat fail their lookups at once (D8); lookups
whose completion event was missed (a reconnect, a flushed stream) are reconciled
from their hash, once Redis confirmed their submit (a lookup still queued behind a
burst is never taken for vanished). The scheduler's own liveness (its lease, the
engine keys' refresh, its metrics snapshot and fingerprint) is not the listener's: the
client's :class:`~broker_lookup.transport.beat.Beat` does it, on its own thread, so a
blocking read or a burst of completions never lapses it.

Its commands go over the one :class:`~broker_lookup.transport.link.Link` its thread
holds: a lean connection (raw replies, no redis-py callbacks), or on Redis Cluster
redis-py's pipeline, which routes them by slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup.client.breaker import Breaker
from broker_lookup.client.insights import RankInsights
from broker_lookup.client.table import LookupTable, Outcome
from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    REDIS_ERRORS,
    AuthFailed,
    BrokerLookupError,
    raise_translated,
    translate_redis_errors,
)
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import decode_completions
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.threads import LoopThread
from broker_lookup.transport.link import Link, open_link, stream_entries

__all__ = ["Listener"]

logger = logging.getLogger(__name__)

_RECONCILE_BATCH = 500
_EVICT_EVERY_S = 5.0


class Listener(LoopThread):
    """Owns the blocking read connection and all timing decisions of the client."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        table: LookupTable,
        factory: Callable[[], redis.Redis],
        expected: tuple[int, ...],
        breaker: Breaker,
        insights: RankInsights | None = None,
    ) -> None:
        super().__init__("client listener", "listener")
        self._config = config
        self._keys = keys
        self._table = table
        self._factory = factory
        self._expected = expected
        self._breaker = breaker
        self._last_id: bytes | str = b"0-0"
        #: Ranks of ``expected`` without a heartbeat; read by lookup() without a lock.
        self.dead: frozenset[int] = frozenset(expected)
        #: False until the first successful heartbeat read (ranks dead then are logged
        #: too): until then :attr:`dead` is a guess, and lookups are ``unavailable``, not
        #: ``dead_rank`` (Redis unreachable or refusing our password says nothing of ranks).
        self.checked = False
        self.errors = 0
        #: done-stream entries that did not decode whole (what did decode still completed)
        self.bad_entries = 0
        self._warn = RateLimitedLog(logger)
        self.connected = False
        self._next = {"hb": 0.0, "reconcile": 0.0, "evict": 0.0}
        self._heartbeat_keys = [self._keys.heartbeat(r) for r in expected]
        self._mget: Command = ("MGET", *self._heartbeat_keys)
        #: Per-rank latency and disagreement (``rank_insights``); None when it is off.
        self.insights = insights

    def prime(self, client: redis.Redis) -> None:
        """Learn liveness and the stream position now, before :meth:`start`."""
        link = open_link(client)
        try:
            self._position(client)
            self.check_heartbeats(link)
        except AuthFailed as exc:
            logger.error("%s; lookups answer 0 until Redis accepts us", exc)
        except BrokerLookupError as exc:
            logger.warning("broker unavailable at start (%s); lookups answer 0 until it is", exc)
        finally:
            link.close()

    def _position(self, client: redis.Redis) -> None:
        with translate_redis_errors("reading the completion stream position"):
            last: Any = client.xrevrange(self._keys.done, count=1)
        if last:
            self._last_id = last[0][0]

    def _run(self) -> None:
        client = self._factory()
        link = open_link(client)
        try:
            while not self._stop.is_set():
                try:
                    with self._breaker.track("listener", self._config.block_ms / 1000, tolerate=1):
                        self._read(link)
                        self._sweep(link)
                    self.connected = True
                except (BrokerLookupError, redis.RedisError) as exc:
                    self._on_error(exc)
                except Exception:  # a bug: counted and logged, never a silent dead thread
                    self.guard()
        finally:
            link.close()
            client.close()

    def _on_error(self, exc: Exception) -> None:
        self.errors += 1
        first = self.connected  # the first error after a success is retried at once
        self.connected = False
        self._warn(logging.WARNING, "listener: Redis error #%d: %s (retrying)", self.errors, exc)
        # Timeouts still fire while Redis is away: they need no I/O to decide (a partial
        # answer asked for then fails in the sender, and answers 0).
        now = time.monotonic()
        for lookup_id, entry in self._table.overdue(now):
            self._table.on_deadline(lookup_id, entry, now)
        if not first:
            self._stop.wait(0.2)

    def _read(self, link: Link) -> None:
        try:
            # A plain call, not a piggy-backed read: nothing rides with it.
            resp = _raise_error(link.call([self._xread_command()])[0])
        except REDIS_ERRORS as exc:  # no context manager entered per read
            raise_translated(exc, "reading completions")
        insights = self.insights
        table = self._table
        for entry_id, fields in stream_entries(resp):
            self._last_id = entry_id
            # One entry completes every lookup a rank's report batch completed.
            events, problem = decode_completions(fields or {})
            if problem is not None:
                self.bad_entries += 1
                self._warn(
                    logging.ERROR,
                    "bad completion entry %r (%d so far): %s; its lookups that did not "
                    "decode are reconciled from their hashes",
                    entry_id,
                    self.bad_entries,
                    problem,
                )
            for ev in events:
                if ev.last is not None and insights is not None:
                    # Only our own lookups (other clients of the engine share the stream),
                    # read before finish takes the entry out of flight.
                    entry = table.inflight.get(ev.lookup_id)
                    if entry is not None and entry.gen == ev.gen:
                        insights.record(ev, entry.tokens, entry.weight)
                table.finish(ev.lookup_id, ev.gen, ev.result, "hit" if ev.result > 0 else "miss")

    def _xread_command(self) -> Command:
        return (
            "XREAD",
            "COUNT",
            1000,
            "BLOCK",
            self._config.block_ms,
            "STREAMS",
            self._keys.done,
            self._last_id,
        )

    def _sweep(self, link: Link) -> None:
        now = time.monotonic()
        for lookup_id, entry in self._table.overdue(now):
            self._table.on_deadline(lookup_id, entry, now)
        if now >= self._next["hb"]:
            self._next["hb"] = now + self._config.heartbeat_interval_ms / 2000
            self.check_heartbeats(link)
        if now >= self._next["reconcile"]:
            self._next["reconcile"] = now + 0.1
            self._reconcile(link, now)
        if now >= self._next["evict"]:
            self._next["evict"] = now + _EVICT_EVERY_S
            self._table.evict_finished(now)

    def check_heartbeats(self, link: Link) -> None:
        """Refresh :attr:`dead`; fail the in-flight lookups of ranks that just died."""
        values: list[Any] = []
        if self._heartbeat_keys:
            with translate_redis_errors("reading heartbeats"):
                values = _raise_error(link.call([self._mget])[0])
        dead = frozenset(r for r, v in zip(self._expected, values, strict=True) if v is None)
        # The first read reports every dead rank, so one that never started is logged.
        newly = dead - self.dead if self.checked else dead
        self.checked = True
        for rank in sorted(newly):
            logger.error(
                "rank %d of engine %s has no heartbeat (%s): its lookups answer 0 "
                "at once until it is back",
                rank,
                self._keys.engine_id,
                self._keys.heartbeat(rank),
            )
        for rank in sorted(self.dead - dead):
            logger.info("rank %d of engine %s is alive", rank, self._keys.engine_id)
        self.dead = dead
        if newly:
            for lookup_id, entry in self._table.waiting_on(newly):
                self._table.expire(lookup_id, entry, "dead_rank")

    def _reconcile(self, link: Link, now: float) -> None:
        due = self._table.due_for_reconcile(now, _RECONCILE_BATCH)
        if not due:
            return
        with translate_redis_errors("reconciling lookups"):
            rows = self._status_rows([lookup_id for lookup_id, _ in due], link)
        for (lookup_id, entry), row in zip(due, rows, strict=True):
            status = lookup_hash.decode(dict(zip(lookup_hash.STATUS_FIELDS, row, strict=True)))
            if not status.exists:
                # Redis confirmed the submit, so the key existed: it was flushed, the
                # server restarted empty, or the key was evicted.
                logger.warning(
                    "lookup %.200r gen %d vanished from Redis; answering 0", lookup_id, entry.gen
                )
                self._table.expire(lookup_id, entry, "error")
                continue
            value = status.done_for(entry.gen)
            if value is not None:
                # A partial answer read here first: the sender still sends its keep.
                outcome: Outcome = "partial" if status.partial else "hit" if value > 0 else "miss"
                self._table.finish(lookup_id, entry.gen, value, outcome)

    def _status_rows(self, lookup_ids: list[str], link: Link) -> list[Any]:
        """HMGET of each lookup's status fields, in one round trip."""
        fields = lookup_hash.STATUS_FIELDS
        rows = link.call([("HMGET", self._keys.lookup(i), *fields) for i in lookup_ids])
        return [_raise_error(row) for row in rows]


def _raise_error(reply: Any) -> Any:
    """A raw reply, or raise it if Redis answered an error."""
    if isinstance(reply, Exception):
        raise reply
    return reply
