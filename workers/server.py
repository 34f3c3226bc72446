"""``RedisAsyncLookupServer``: one worker rank's side of the protocol.

LMCache's ``LMCacheAsyncLookupServer`` contract over Redis: it starts consuming on
construction, dispatches lookups to the engine's ``async_lookup_and_prefetch``, and
the engine reports through :meth:`send_response_to_scheduler`. This class wires the
rank's parts together; each is one step of the data path::

    Beat (its thread)       the lease's renewal with the heartbeat, the engine keys'
                            refresh, metrics snapshot, fingerprint: liveness, never
                            waiting on the engine or a batch
    RankLoop (its thread)   Reader.read: XREADGROUP, decode, dead letters -> a Batch
                            Dispatcher.handle: the Lifecycle decides, the engine starts
                            Reporter.send_with_ack: the reports made meanwhile + XACK
    engine (any thread)     send_response_to_scheduler -> Dispatcher.report -> Reporter
    Reporter (its thread)   report.lua for queued reports -> Dispatcher.settle
    Sweeper (its thread)    Dispatcher.sweep: the watchdog's 0s, pins past their TTL,
                            when the Lifecycle's plan says (no idle tick)

What happens to each lookup id is decided by one
:class:`~workers.pipeline.lifecycle.Lifecycle` (running -> reporting -> held ->
released, one generation at a time); the dispatcher only carries out its steps.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.engine import LookupEngine
from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace, rank_role
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.protocol.stats import RankStats
from broker_lookup.transport.beat import Beat, Heartbeat
from broker_lookup.transport.connection import ConnectionFactory, close_factory, make_factory
from broker_lookup.transport.fingerprint import Publisher
from broker_lookup.transport.lease import Lease
from broker_lookup.transport.script_runner import ScriptSet
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.lifecycle import Lifecycle
from workers.pipeline.loop import RankLoop
from workers.pipeline.prober import Prober
from workers.pipeline.reservations import Reservations
from workers.pipeline.sweeper import Sweeper

__all__ = ["RedisAsyncLookupServer"]

logger = logging.getLogger(__name__)

#: The least time between two sweeps (watchdog, pin TTL, memo expiry, progress): a busy
#: rank sweeps at this period, an idle one when something falls due.
SWEEP_EVERY_S = 0.05
#: The longest the sweeper sleeps with nothing due: what a lost ring could delay a
#: watchdog by (its grace is 2 s by default); memos expire at most this late.
SWEEP_IDLE_S = 1.0


class RedisAsyncLookupServer:
    """Serve one rank's lookups from Redis to ``engine``.

    >>> server = RedisAsyncLookupServer(engine, LookupMetadata(engine_id="e", world_size=2,
    ...                                 worker_id=1), config)   # doctest: +SKIP
    >>> server.close()                                           # doctest: +SKIP
    """

    def __init__(
        self,
        engine: LookupEngine,
        metadata: LookupMetadata,
        config: LookupConfig | None = None,
        *,
        connection_factory: ConnectionFactory | None = None,
    ) -> None:
        cfg = config if config is not None else LookupConfig.load()
        self.config = cfg
        self.metadata = metadata
        self.rank = metadata.worker_id
        self.keys = KeySpace(metadata.engine_id)
        self.engine = engine
        self._closed = False
        factories = _rank_factories(
            cfg, f"bl-worker-{metadata.engine_id}-{self.rank}", connection_factory
        )
        factory = factories.general
        self._own_factories = factories.owned
        #: The one owner of every lookup id's lifecycle on this rank.
        self.lifecycle = Lifecycle(
            cfg.worker_dedupe_capacity,
            cfg.worker_pin_ttl_ms / 1000,
            cfg.key_ttl_ms / 1000,
            cfg.worker_watchdog_grace_ms / 1000,
            progress_delay_s=SWEEP_EVERY_S,
        )
        #: Publishes this rank's hashing fingerprint from the beat, and checks.
        self.fingerprint = Publisher(
            self.keys,
            f"rank{self.rank}",
            ChunkedTokenHasher(cfg),
            factory,
            ttl_ms=cfg.engine_ttl_ms,
        )
        #: This process's lease on the rank: one owner per (engine, rank).
        self.lease = Lease(
            self.keys, rank_role(self.rank), f"rank {self.rank}", cfg.lease_ms, cfg.epochs_ttl_ms
        )
        self._factory = factory
        self._dispatcher = Dispatcher(
            engine, self.lifecycle, cfg, self.keys, self.rank, factory, lease=self.lease
        )
        self._reporter = self._dispatcher.reporter
        self._sweeper = Sweeper(
            f"rank {self.rank} sweeper",
            self._dispatcher.sweep,
            self.lifecycle.plan_sweep,
            SWEEP_EVERY_S,
            SWEEP_IDLE_S,
        )
        self.lifecycle.ring_sweeper(self._sweeper.ring)
        self._loop = RankLoop(
            cfg,
            self.keys,
            self.rank,
            factories.read,
            self._dispatcher,
            self._reporter,
            lease=self.lease,
            world_size=metadata.world_size,
            redis_retries=connection_factory is not None,
        )
        #: Prefixes kept for routed requests (the fleet query's reserve_ms).
        self.reservations = Reservations(engine, self.rank)
        self._dispatcher.on_start = self.reservations.arrived
        #: Liveness: the lease with the heartbeat, the engine keys, snapshot, fingerprint.
        self.beat = Beat(
            cfg,
            self.keys,
            self.lease,
            factories.beat,
            f"rank {self.rank} beat",
            heartbeat=Heartbeat(
                self.rank,
                cfg.heartbeat_ttl_ms,
                self._beat_info,
                metadata.configured_engine_id,
                reading=self._loop.reading,
            ),
            metrics=MetricsPublisher(
                self.keys,
                rank_role(self.rank),
                "server",
                self.stats,
                interval_ms=cfg.metrics_period_ms,
                ttl_ms=cfg.metrics_ttl_ms,
                configured_engine_id=metadata.configured_engine_id,
            ),
            fingerprint=self.fingerprint,
        )
        self._loop.on_reading = self.beat.wake
        #: Answers the fleet query on its own thread and connection (never the loop's).
        self.prober = Prober(
            engine,
            self.keys,
            self.rank,
            factory,
            cfg.block_ms,
            lambda: self.lease.held(),
            self.reservations,
        )
        post_init = getattr(engine, "post_init", None)
        if callable(post_init):
            post_init(async_lookup_server=self)
        self._reporter.start()
        self._sweeper.start()
        self.beat.start()
        self._loop.start()
        self.prober.start()

    # -- LMCache's contract ---------------------------------------------------------

    def process_requests_from_scheduler(self) -> None:
        """No-op kept for LMCache compatibility: consuming starts on construction."""

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """The engine finished prefetching ``lookup_id``: report its loaded prefix."""
        self._dispatcher.report(lookup_id, num_hit_tokens)
        self.reservations.reported(lookup_id)  # after: the lookup holds its own pins now

    def send_progress_to_scheduler(self, lookup_id: str, num_loaded_tokens: int) -> None:
        """Optional, for engines that load in steps: ``num_loaded_tokens`` of ``lookup_id``'s
        prefix are loaded and pinned so far. With ``partial_answers`` on, a lookup that
        misses its deadline is answered the prefix every expected rank confirmed this way
        (the final report still comes through :meth:`send_response_to_scheduler`)."""
        self._dispatcher.progress(lookup_id, num_loaded_tokens)

    def close(self) -> None:
        """Ordered shutdown: stop reading, flush reports, release every pin; idempotent."""
        if self._closed:
            return
        self._closed = True
        grace = self.config.block_ms / 1000 + 2.0
        # The probe thread's blocked read has no order to keep: it runs out beside the loop's.
        self.prober.stop(0.0)
        ok = self._loop.stop(grace)
        ok = self.prober.stop(grace) and ok
        ok = self._sweeper.stop(grace) and ok
        ok = self._reporter.stop(grace) and ok
        ok = self.beat.stop(grace) and ok  # before the release: it would claim again
        self._release_lease()  # after the reports' flush: a released lease fences them
        self.fingerprint.close()
        self.reservations.release_all()
        self._dispatcher.release_all()
        for factory in self._own_factories:
            close_factory(factory)
        if not ok:
            logger.error("rank %d: server threads did not stop within %.1fs", self.rank, grace)

    def _release_lease(self) -> None:
        """Give the rank's lease (and heartbeat) up, so the next process takes over at once;
        a failure is logged: the lease then expires by itself."""
        try:
            client = self._factory()
            try:
                with translate_redis_errors("releasing the rank's lease"):
                    ScriptSet().call(client, self.lease.release_call(rank=True))
            finally:
                client.close()
        except BrokerLookupError as exc:
            logger.warning(
                "rank %d: lease not released at shutdown (it expires after %d ms): %s",
                self.rank,
                self.config.lease_ms,
                exc,
            )

    # -- observability --------------------------------------------------------------

    def _beat_info(self) -> dict[str, Any]:
        """The heartbeat's state: the loop's, plus the reservations held (``inspect``)."""
        return {**self._loop.beat_info(), "reservations": len(self.reservations)}

    def stats(self) -> RankStats:
        """Counters, map sizes and engine time for metrics, health, the metrics snapshot
        and tests."""
        loop = self._loop
        dispatcher = self._dispatcher
        sizes = self.lifecycle.sizes()
        return RankStats(
            rank=self.rank,
            counts={
                **dispatcher.counts(),
                **self.lifecycle.events(),
                **{"probe_" + k: v for k, v in self.prober.counts.items()},
                **{"reservation_" + k: v for k, v in self.reservations.counts.items()},
                "reservations_held": len(self.reservations),
            },
            running=sizes["running"],
            reporting=sizes["reporting"],
            held=sizes["held"],
            waiting=sizes["waiting"],
            seen=sizes["seen"],
            aborted=sizes["aborted"],
            late=sizes["late"],
            timers=sizes["timers"],
            progressed=sizes["progressed"],
            engine_seconds=tuple(dispatcher.engine_seconds),
            engine_seconds_sum=dispatcher.engine_seconds_sum,
            consumer=loop.reader.consumer_stats(),
            reporter_errors=self._reporter.errors,
            unexpected_errors=(
                loop.guard.count
                + self._reporter.guard.count
                + self._sweeper.guard.count
                + self.beat.guard.count
            ),
            last_heartbeat=self.beat.last_beat,
            ready=self.ready,
            alive=loop.alive() and self._sweeper.alive() and self.beat.alive(),
            ownership=self.lease.state(),
        )

    @property
    def ready(self) -> bool:
        """True while this process holds the rank's lease, the group exists and the loop
        is reading."""
        return self._loop.ready.is_set() and self.lease.held()

    def __enter__(self) -> RedisAsyncLookupServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RankFactories(NamedTuple):
    """A rank's connection factories, and those of them the server made (and closes)."""

    general: ConnectionFactory  #: the reporter's, the sweeper's, shutdown's
    read: ConnectionFactory  #: the read loop's (it blocks in XREADGROUP)
    beat: ConnectionFactory  #: the beat's (lease, heartbeat, refreshes)
    owned: list[ConnectionFactory]


def _rank_factories(
    config: LookupConfig, name: str, given: ConnectionFactory | None
) -> _RankFactories:
    """``given`` for every use (owned: none), or factories made here, which the server
    closes at shutdown.

    Made here, every socket times out after ``config.loop_timeout_s`` (the beat's after
    ``config.beat_timeout_s``), so no read of a stalled Redis pauses the rank's loop for
    the general socket timeout, nor its beat for a lease; the read loop's and the beat's
    factories have pools of their own, so each can turn redis-py's retries off alone.
    """
    if given is not None:
        return _RankFactories(given, given, given, [])
    general = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    read = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    beat = make_factory(config, name + "-beat", socket_timeout_s=config.beat_timeout_s)
    return _RankFactories(general, read, beat, [general, read, beat])
