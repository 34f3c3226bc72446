"""The rank's read loop, one thread: read -> decide -> engine -> report -> ack.

Each turn takes one batch (:class:`~workers.pipeline.reader.Reader`), hands each entry
to the :class:`~workers.pipeline.dispatch.Dispatcher` (the lifecycle decides, the engine
starts), and writes the reports made meanwhile, the batch's XACK and the next
XREADGROUP BLOCK at once: one round trip per batch, on a
:class:`~broker_lookup.transport.link.LeanLink` (raw commands on one redis-py
connection; a ``ClientLink`` over redis-py's pipeline for Redis Cluster). The next
turn starts by taking that read's reply. Reports the engine makes later, on its own
threads, go through the reporter's thread instead.

One owner per rank: the loop reads the group only while this process holds the rank's
lease. It does not renew it: the rank's beat (:class:`~broker_lookup.transport.beat.Beat`,
its own thread and connection) does, with the heartbeat, so a slow batch, a slow engine
or a slow link never lapses it. The loop reads the lease's state before each read: while
another process holds the rank, or once this one's lease lapsed by its own clock (a
pause, a partition), it does not read, and waits for the beat's next renewal.

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
from redis.retry import Retry

from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    REDIS_ERRORS,
    BrokerLookupError,
    NoGroup,
    raise_translated,
)
from broker_lookup.lmcache_version import running_lmcache_version
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.threads import LoopThread
from broker_lookup.transport.lease import Lease
from broker_lookup.transport.link import Link, open_link
from workers.pipeline.clock import ServerClock
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.reader import Batch, Reader
from workers.pipeline.reporter import Reporter, Served

__all__ = ["RankLoop"]

#: How long the loop waits after a Redis error before it tries again.
ERROR_BACKOFF_S = 0.2
#: How often the group's pending count and lag are read (for stats and metrics).
GROUP_INFO_EVERY_S = 5.0
#: How often the engine's pinned chunks are asked for (shown in the heartbeat).
ENGINE_PINS_EVERY_S = 1.0


class RankLoop(LoopThread):
    """Owns the rank's blocking connection and the thread that serves its deliveries.

    Args:
        config: the rank's config.
        keys: the engine's key space.
        rank: this rank.
        factory: connections; the loop's own (it blocks in XREADGROUP).
        dispatcher: serves each entry read.
        reporter: sends the reports made while a batch is served, with its XACK.
        world_size: ranks beyond it in an entry's ``expected`` make it invalid.
        lease: the rank's lease, renewed by the rank's beat: read before every read.
        redis_retries: keep redis-py's own retries on the loop's connection.
    """

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        dispatcher: Dispatcher,
        reporter: Reporter,
        *,
        lease: Lease,
        world_size: int | None = None,
        redis_retries: bool = True,
    ) -> None:
        super().__init__(f"rank {rank} consumer", f"rank-{rank}")
        self._factory = factory
        self._dispatcher = dispatcher
        self._reporter = reporter
        self._redis_retries = redis_retries
        #: The server's clock, sampled between reads; judges request budgets.
        self.clock = ServerClock()
        self.reader = Reader(config, keys, rank, self.clock, world_size)
        self._world_size = world_size
        self.lease = lease
        #: Set while the group exists and the loop is reading.
        self.ready = threading.Event()
        #: Set once the loop first read its group, never cleared: the heartbeat waits for it.
        self.reading = threading.Event()
        #: Called once, when :attr:`reading` is first set (the server wakes its beat).
        self.on_reading: Callable[[], None] = lambda: None
        self._next_group_info = 0.0
        self._next_pins = 0.0
        self._engine_pins: int | None = None
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
            link.close()
            client.close()

    def _turn(self, link: Link, client: redis.Redis) -> None:
        try:
            if not link.reading:
                if not self._owned():
                    return
                if self.clock.due(time.monotonic()):
                    self.clock.sample(link)
                if not self.ready.is_set():  # first turn, or after an error: the group may be gone
                    self.reader.ensure_group(link)
                    self.ready.set()
                    if not self.reading.is_set():
                        self.reading.set()
                        self.on_reading()
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
            self._engine_pins_due()
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

        The next read rides along unless the lease is not held now or the loop stops; its
        reply is taken at the start of the next turn. It is always a read: whatever the
        turn cost, the lease is the beat's, and nothing here waits for it.
        """
        if not batch.ack_ids:
            return
        reports = self._dispatcher.serve(batch.messages)
        piggyback = not self._stop.is_set() and self.lease.held()
        read = self.reader.read_command() if piggyback else None
        self._reporter.send_with_ack(link, client, Served(reports, batch.ack_ids, batch.dead), read)

    def _owned(self) -> bool:
        """Whether this process may read the rank's group now: its lease is held (the
        beat renews it). If not, the loop waits for a renewal, one heartbeat interval at
        most."""
        lease = self.lease
        if lease.held():
            return True
        if lease.holder is not None:  # another process serves the rank: the group may change
            self.ready.clear()
        return lease.wait_held(self._retry_s)

    def _group_info(self, link: Link) -> None:
        """The group's pending count and lag, every GROUP_INFO_EVERY_S."""
        now = time.monotonic()
        if now >= self._next_group_info:
            self._next_group_info = now + GROUP_INFO_EVERY_S
            self.reader.group_info(link)

    def _engine_pins_due(self) -> None:
        """Ask the engine for its pinned chunks every ENGINE_PINS_EVERY_S, on this thread:
        the beat shows the last answer and never calls the engine itself."""
        now = time.monotonic()
        if now >= self._next_pins:
            self._next_pins = now + ENGINE_PINS_EVERY_S
            self._engine_pins = self._dispatcher.engine_pins()

    def beat_info(self) -> dict[str, Any]:
        """What the rank's heartbeat shows besides who it is: state only, no engine call
        (the beat's thread reads it)."""
        stats = self.reader.stats
        return {
            **self._dispatcher.sizes(),
            "engine_pinned_chunks": self._engine_pins,
            "requests": self._dispatcher.counts().get("requests", 0),
            "replayed": stats["replayed"],  # deliveries read again: lost ones among them
            "redis_errors": stats["redis_errors"],
            "lmcache": running_lmcache_version(),  # None: a rank without LMCache
            # The fleet query's expected ranks: a rank missing from them is a dead rank.
            "world_size": self._world_size,
        }
