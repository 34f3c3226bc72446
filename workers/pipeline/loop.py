"""The rank's read loop, one thread: read -> decide -> engine -> report -> ack.

Each turn takes one batch (:class:`~workers.pipeline.reader.Reader`), hands each entry
to the :class:`~workers.pipeline.dispatch.Dispatcher` (the lifecycle decides, the engine
starts), and writes the reports made meanwhile, the batch's XACK and the next
XREADGROUP BLOCK at once: one round trip per batch, on a
:class:`~broker_lookup.transport.link.LeanLink` (raw commands on one redis-py
connection; a ``ClientLink`` over redis-py's pipeline for Redis Cluster). The next
turn starts by taking that read's reply. A turn whose heartbeat is due sends no read
with its acks: it keeps the group and the heartbeat first. Reports the engine makes
later, on its own threads, go through the reporter's thread instead.

One owner per rank: the loop reads the group only while it holds the rank's lease.
Its first turn claims it; the heartbeat is its renewal (one ``claim.lua`` call writes
both). While another process holds the rank, or once this one's lease lapsed by its
own clock (a pause, a partition), the loop does not read: it retries the claim every
heartbeat interval and takes over only once the other lease expired.

Errors: a missing group (NOGROUP) is re-created at once; any other Redis error is
counted and backed off; after either, the own pending entries are read again, so
nothing read stays unserved (a lost reply to the acks or to the read drops the
connection: what it delivered is still pending, and re-reported idempotently).
Anything else is a bug, counted and logged by the loop's guard, and the loop goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    REDIS_ERRORS,
    BrokerLookupError,
    BrokerResponseError,
    NoGroup,
    raise_translated,
    translate_redis_errors,
)
from broker_lookup.lmcache_version import running_lmcache_version
from broker_lookup.protocol.fingerprint import Publisher
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.threads import LoopThread
from broker_lookup.transport.lease import Lease, run_claim
from broker_lookup.transport.link import Link, open_link
from broker_lookup.transport.script_runner import ScriptSet
from workers.pipeline.clock import ServerClock
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.heartbeat import Heartbeat
from workers.pipeline.reader import Batch, Reader
from workers.pipeline.reporter import Reporter, Served

__all__ = ["RankLoop"]

#: How long the loop waits after a Redis error before it tries again.
ERROR_BACKOFF_S = 0.2
#: How often the group's pending count and lag are read (for stats and metrics).
GROUP_INFO_EVERY_S = 5.0


class RankLoop(LoopThread):
    """Owns the rank's blocking connection and the thread that serves its deliveries.

    Args:
        config: the rank's config.
        keys: the engine's key space.
        rank: this rank.
        factory: connections; the loop's own (it blocks in XREADGROUP).
        dispatcher: serves each entry read.
        reporter: sends the reports made while a batch is served, with its XACK.
        fingerprint: this rank's hashing fingerprint, published and checked each turn.
        world_size: ranks beyond it in an entry's ``expected`` make it invalid.
        lease: the rank's lease: claimed, renewed with the heartbeat, checked every turn.
        redis_retries: keep redis-py's own retries on the loop's connection.
        configured_engine_id: shown in the heartbeat where the engine id was derived from
            it (``LookupMetadata.configured_engine_id``).
        metrics: the rank's metrics snapshot, written with the beat while this process
            holds the lease (None: none).
    """

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        dispatcher: Dispatcher,
        reporter: Reporter,
        fingerprint: Publisher,
        *,
        lease: Lease,
        world_size: int | None = None,
        redis_retries: bool = True,
        configured_engine_id: str | None = None,
        metrics: MetricsPublisher | None = None,
    ) -> None:
        super().__init__(f"rank {rank} consumer", f"rank-{rank}")
        self._metrics = metrics
        self._factory = factory
        self._dispatcher = dispatcher
        self._reporter = reporter
        self._fingerprint = fingerprint
        self._redis_retries = redis_retries
        #: The server's clock, sampled with the heartbeat; judges request budgets.
        self.clock = ServerClock()
        self.reader = Reader(config, keys, rank, self.clock, world_size)
        self.heartbeat = Heartbeat(config, keys, rank, configured_engine_id)
        self.lease = lease
        self._scripts = ScriptSet()
        self._claim_context = f"claiming the lease of rank {rank} ({keys.owner(lease.role)})"
        #: Set while the group exists and the loop is reading.
        self.ready = threading.Event()
        self._next_group_info = 0.0
        self._retry_s = config.heartbeat_interval_ms / 1000
        self._serving = f"serving {keys.requests} as {keys.group(rank)}"

    def _run(self) -> None:
        client = self._factory()
        if not self._redis_retries:
            # A timed-out read surfaces at once (and is followed by a re-read of the
            # pending entries) instead of being retried blind, which would multiply the
            # socket timeout and could swallow a delivery.
            client.set_retry(Retry(NoBackoff(), 0))
        link = open_link(client)
        try:
            # A read sent with the last batch's acks is still served at a stop: what it
            # delivers is answered, not left pending until a restart replays it.
            while not self._stop.is_set() or link.reading:
                self._turn(link, client)
        finally:
            # The heartbeat goes with the lease's release (the server's, once the
            # reports are flushed: a released lease fences them).
            link.close()
            client.close()

    def _turn(self, link: Link, client: redis.Redis) -> None:
        try:
            if not link.reading:
                if not self._owned(link, client):
                    return
                if not self.ready.is_set():  # first turn, or after an error: the group may be gone
                    self.reader.ensure_group(link)
                    self.ready.set()
                self._group_info(link)
                link.call([], self.reader.read_command())
            try:
                # The reply's lists die here, before the batch is served: alive through
                # the serving's allocations, a big batch's would be promoted by the GC's
                # collections that those trigger, and walked by every full one after.
                batch = self.reader.parse(link.take_read())
                self._serve(link, client, batch)
            except REDIS_ERRORS as exc:  # one translation for the whole hot path
                raise_translated(exc, self._serving)
            self._fingerprint.tick()
        except NoGroup as exc:
            self.ready.clear()
            self.reader.on_nogroup(exc)
        except BrokerLookupError as exc:
            self.ready.clear()
            self.reader.on_error(exc)
            self._stop.wait(ERROR_BACKOFF_S)
        except Exception:  # a bug: counted and logged, never a silent dead thread
            self.reader.replay()
            self.guard()

    def _serve(self, link: Link, client: redis.Redis, batch: Batch) -> None:
        """Hand each entry to the dispatcher; then its reports, acks and next read, one write.

        The next read rides along unless the heartbeat is due (it and the lease's
        renewal go first, next turn), the lease lapsed or the loop stops; its reply is
        taken at the start of the next turn.
        """
        if not batch.ack_ids:
            return
        reports = self._dispatcher.serve(batch.messages)
        now = time.monotonic()
        # Not while the lease needs its renewal first (due, or lapsed by our clock).
        piggyback = not (self._stop.is_set() or self.heartbeat.due(now)) and self.lease.held(now)
        read = self.reader.read_command() if piggyback else None
        self._reporter.send_with_ack(link, client, Served(reports, batch.ack_ids, batch.dead), read)

    def _owned(self, link: Link, client: redis.Redis) -> bool:
        """Whether this process may read the rank's group now: it holds the lease, renewed
        (with the heartbeat) when due. If not, the loop waits one heartbeat interval."""
        now = time.monotonic()
        lease = self.lease
        if lease.held(now) and not self.heartbeat.due(now):
            return True
        lease.note_lapse(now)
        if self.clock.due(now):
            self.clock.sample(link)
        with translate_redis_errors(self._claim_context):
            reply = run_claim(
                self._scripts,
                client,
                link,
                lease.claim_call(self.heartbeat.body(self._beat_info())),
            )
            if isinstance(reply, ResponseError):
                raise reply
        try:
            held = lease.on_reply(reply, now)
        except ValueError as exc:
            raise BrokerResponseError(f"{self._claim_context}: {exc}") from None
        metrics = self._metrics
        # Only the holder's counters stand for the rank (one snapshot per role).
        snapshot = metrics.command(now) if metrics is not None and held else None
        self.heartbeat.refresh(link, [snapshot] if snapshot is not None else ())
        if lease.holder is None:  # ours (a slow reply leaves it lapsed: claimed again next)
            self.heartbeat.written()
            return held
        self.ready.clear()
        self._stop.wait(self._retry_s)
        return False

    def _group_info(self, link: Link) -> None:
        """The group's pending count and lag, every GROUP_INFO_EVERY_S."""
        now = time.monotonic()
        if now >= self._next_group_info:
            self._next_group_info = now + GROUP_INFO_EVERY_S
            self.reader.group_info(link)

    def _beat_info(self) -> dict[str, Any]:
        stats = self.reader.stats
        return {
            **self._dispatcher.sizes(),
            "engine_pinned_chunks": self._dispatcher.engine_pins(),
            "requests": self._dispatcher.counts().get("requests", 0),
            "replayed": stats["replayed"],  # deliveries read again: lost ones among them
            "redis_errors": stats["redis_errors"],
            "lmcache": running_lmcache_version(),  # None: a rank without LMCache
        }
