"""``RedisAsyncLookupServer``: one worker rank's side of the protocol.

LMCache's ``LMCacheAsyncLookupServer`` contract over Redis: it starts consuming on
construction, dispatches lookups to the engine's ``async_lookup_and_prefetch``,
and the engine reports through :meth:`send_response_to_scheduler`. What happens to
each lookup id is decided by one :class:`~workers.pipeline.lifecycle.Lifecycle` (running ->
reporting -> held -> released, one generation at a time); this class only carries
out its steps on the engine and Redis. A worker always answers: an engine that
raises or reports nonsense reports 0, and one that never reports is answered 0 by
the watchdog at its deadline plus ``worker_watchdog_grace_ms`` and released.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from typing import Any

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.engine import LookupEngine
from broker_lookup.ops.histogram import LATENCY_BUCKETS
from broker_lookup.protocol.fingerprint import Publisher
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, LookupRequest
from broker_lookup.protocol.scripts import ScriptSet
from broker_lookup.transport.connection import ConnectionFactory, close_factory
from workers.pipeline.connections import rank_factories
from workers.pipeline.consumer import Consumer
from workers.pipeline.lifecycle import Job, Lifecycle, Step
from workers.pipeline.reporter import Reporter
from workers.pipeline.watchdog import RateLimitedLog, Sweeper

__all__ = ["RedisAsyncLookupServer"]

logger = logging.getLogger(__name__)

_KEEP = ("complete", "recorded", "duplicate")
#: How often the watchdog, pin TTL and memo expiry run.
SWEEP_EVERY_S = 0.05


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
        self.config = config if config is not None else LookupConfig.load()
        self.metadata = metadata
        self.rank = metadata.worker_id
        self.keys = KeySpace(metadata.engine_id)
        self.engine = engine
        cfg = self.config
        self._pin_ttl_s = cfg.worker_pin_ttl_ms / 1000
        #: The one owner of every lookup id's lifecycle on this rank.
        self.tracker = Lifecycle(
            cfg.worker_dedupe_capacity,
            self._pin_ttl_s,
            cfg.key_ttl_ms / 1000,
            cfg.worker_watchdog_grace_ms / 1000,
        )
        factory, read_factory, self._own_factories = rank_factories(
            cfg, f"bl-worker-{metadata.engine_id}-{self.rank}", connection_factory
        )
        #: Publishes this rank's hashing fingerprint from the consumer's tick, and checks.
        self.fingerprint = Publisher(
            self.keys, f"rank{self.rank}", ChunkedTokenHasher(cfg), factory
        )
        self.counts: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._warn = RateLimitedLog(logger)
        self._watchdog_log = RateLimitedLog(logger)
        self.engine_seconds = [0] * (len(LATENCY_BUCKETS) + 1)
        self.engine_seconds_sum = 0.0
        self._closed = False
        self._build_threads(factory, read_factory, own=connection_factory is None)
        post_init = getattr(engine, "post_init", None)
        if callable(post_init):
            post_init(async_lookup_server=self)
        self._reporter.start()
        self._sweeper.start()
        self._consumer.start()

    def _build_threads(
        self, factory: ConnectionFactory, read_factory: ConnectionFactory, own: bool
    ) -> None:
        cfg = self.config
        self._reporter = Reporter(
            cfg, self.keys, self.rank, factory, ScriptSet(), self._on_reported
        )
        self._sweeper = Sweeper(f"rank {self.rank} sweeper", SWEEP_EVERY_S, self._sweep)
        self._consumer = Consumer(
            cfg,
            self.keys,
            self.rank,
            read_factory,
            self._handle,
            self._beat_info,
            self.fingerprint.tick,
            world_size=self.metadata.world_size,
            flush=self._reporter.flush,
            bind=self._reporter.bind_thread,
            redis_retries=not own,
        )

    # -- LMCache's contract ---------------------------------------------------------

    def process_requests_from_scheduler(self) -> None:
        """No-op kept for LMCache compatibility: consuming starts on construction."""

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """The engine finished prefetching ``lookup_id``: report its loaded prefix."""
        now = time.monotonic()
        outcome, job, step = self.tracker.on_report(lookup_id, now)
        if job is None:
            self._count("report_" + outcome)
            if outcome == "unknown":
                self._warn(
                    logging.WARNING,
                    "rank %d: report for %s which is not running; ignored",
                    self.rank,
                    lookup_id,
                )
            return
        self._observe(job, now)
        if outcome == "skipped":  # aborted or superseded: nobody wants the answer
            self._count("report_skipped_aborted")
            self._apply(lookup_id, step)
            return
        self._reporter.put(lookup_id, job.gen, self._valid_hits(job, num_hit_tokens))

    def close(self) -> None:
        """Ordered shutdown: stop reading, flush reports, release every pin; idempotent."""
        if self._closed:
            return
        self._closed = True
        grace = self.config.block_ms / 1000 + 2.0
        ok = self._consumer.stop(grace)
        ok = self._sweeper.stop(grace) and ok
        ok = self._reporter.stop(grace) and ok
        self.fingerprint.close()
        for lookup_id in self.tracker.release_all():
            self._cleanup(lookup_id)
        for factory in self._own_factories:
            close_factory(factory)
        if not ok:
            logger.error("rank %d: server threads did not stop within %.1fs", self.rank, grace)

    # -- dispatch -------------------------------------------------------------------

    def _handle(self, msg: LookupRequest | Abort, remaining_ms: float = math.inf) -> None:
        now = time.monotonic()
        if isinstance(msg, Abort):
            self._count("aborts")
            self._apply(msg.lookup_id, self.tracker.on_abort(msg.lookup_id, msg.gen, now))
            return
        if self.rank not in msg.expected:
            self._count("not_expected")
            return
        if remaining_ms <= 0:
            self._count("expired")
            return
        # Local and monotonic from here on; capped so no wire value outlives the pin TTL.
        deadline = now + min(remaining_ms / 1000, self._pin_ttl_s)
        decision, step = self.tracker.on_request(msg, now, deadline)
        self._count(decision)
        self._apply(msg.lookup_id, step)

    def _apply(self, lookup_id: str, step: Step) -> None:
        """Carry out a lifecycle step: release the engine's generation, then start the next."""
        if step.release:
            self._cleanup(lookup_id)
        if step.start is not None:
            self._start(step.start)

    def _start(self, req: LookupRequest) -> None:
        self._count("requests")
        try:
            self.engine.async_lookup_and_prefetch(
                req.lookup_id,
                req.hashes,
                req.offsets,
                pin=True,
                request_configs=req.request_configs,
            )
        except Exception:  # any engine failure: the rule is that a worker always answers
            self._count("engine_errors")
            logger.exception(
                "rank %d: engine failed to start %s; reporting 0", self.rank, req.lookup_id
            )
            self.send_response_to_scheduler(req.lookup_id, 0)

    def _valid_hits(self, job: Job, hits: object) -> int:
        if type(hits) is int and 0 <= hits <= job.tokens:
            return hits
        self._count("engine_invalid_hits")
        logger.error(
            "rank %d: engine reported %r hits for %s (%d tokens); reporting 0",
            self.rank,
            hits,
            job.lookup_id,
            job.tokens,
        )
        return 0

    def _on_reported(self, lookup_id: str, gen: int, answer: str) -> None:
        self._count("report_" + answer)
        step = self.tracker.on_settled(lookup_id, gen, answer in _KEEP, time.monotonic())
        self._apply(lookup_id, step)

    def _cleanup(self, lookup_id: str) -> None:
        self._count("released")
        try:
            self.engine.cleanup_memory_objs(lookup_id)
        except Exception:  # engine bug: count and log, the loop must go on
            self._count("engine_errors")
            logger.exception("rank %d: engine failed to release %s", self.rank, lookup_id)

    def _sweep(self, now: float) -> None:
        """On the sweeper thread: the watchdog, then pins past their TTL."""
        for kind, job, step in self.tracker.due(now):
            if kind == "watchdog":
                self._on_watchdog(job)
            self._apply(job.lookup_id, step)
        for lookup_id in self.tracker.expired_holds(now):
            self._cleanup(lookup_id)

    def _on_watchdog(self, job: Job) -> None:
        """The engine never reported ``job`` (LMCache D9): answer 0 for it ourselves."""
        self._watchdog_log(
            logging.ERROR,
            "rank %d: engine did not report %s (gen %d) by its deadline + %d ms; "
            "reporting 0 and releasing its memory",
            self.rank,
            job.lookup_id,
            job.gen,
            self.config.worker_watchdog_grace_ms,
        )
        if not (job.aborted or job.superseded):  # else nobody waits for the answer
            self._reporter.put(job.lookup_id, job.gen, 0)

    # -- observability --------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def _observe(self, job: Job, now: float) -> None:
        seconds = now - job.started
        with self._count_lock:
            self.engine_seconds[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.engine_seconds_sum += seconds

    def _counts_copy(self) -> dict[str, int]:
        with self._count_lock:
            return dict(self.counts)

    def _beat_info(self) -> dict[str, Any]:
        consumer = self._consumer.stats
        return {
            **self.tracker.sizes(),
            "requests": self.counts.get("requests", 0),
            "replayed": consumer["replayed"],  # deliveries read again: lost ones among them
            "redis_errors": consumer["redis_errors"],
        }

    def stats(self) -> dict[str, Any]:
        """Counters and map sizes for metrics, heartbeats and tests."""
        return {
            "rank": self.rank,
            "counts": {**self._counts_copy(), **self.tracker.events()},
            **self.tracker.sizes(),
            "consumer": dict(self._consumer.stats),
            "reporter_errors": self._reporter.errors,
            "unexpected_errors": (
                self._consumer.guard.count + self._reporter.guard.count + self._sweeper.guard.count
            ),
            "last_heartbeat": self._consumer.last_beat,
            "ready": self._consumer.ready.is_set(),
            "alive": self._consumer.alive() and self._sweeper.alive(),
        }

    @property
    def ready(self) -> bool:
        """True once the group exists and the loop is reading."""
        return self._consumer.ready.is_set()

    def __enter__(self) -> RedisAsyncLookupServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
