"""``RedisAsyncLookupServer``: one worker rank's side of the protocol.

LMCache's ``LMCacheAsyncLookupServer`` contract over Redis: it starts consuming on
construction, dispatches lookups to the engine's ``async_lookup_and_prefetch``,
and the engine reports through :meth:`send_response_to_scheduler`. Aborts call
``cleanup_memory_objs`` at once if the prefetch finished, else when it finishes.
A worker always answers: an engine that raises or reports nonsense reports 0.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from typing import Any

from broker_lookup._state import LATENCY_BUCKETS
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.connection import ConnectionFactory, make_factory
from broker_lookup.engine import LookupEngine
from broker_lookup.fingerprint import Publisher
from broker_lookup.hashing import ChunkedTokenHasher
from broker_lookup.keys import KeySpace
from broker_lookup.messages import Abort, LookupRequest
from broker_lookup.scripts import ScriptSet
from workers._consumer import Consumer
from workers._reporter import Reporter
from workers._tracker import Job, Tracker

__all__ = ["RedisAsyncLookupServer"]

logger = logging.getLogger(__name__)

_KEEP = ("complete", "recorded", "duplicate")


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
        factory = connection_factory or make_factory(
            cfg, f"bl-worker-{metadata.engine_id}-{self.rank}"
        )
        self.tracker = Tracker(
            cfg.worker_dedupe_capacity, cfg.worker_pin_ttl_ms / 1000, cfg.key_ttl_ms / 1000
        )
        #: Publishes this rank's hashing fingerprint from the consumer's tick, and checks.
        self.fingerprint = Publisher(
            self.keys, f"rank{self.rank}", ChunkedTokenHasher(cfg), factory
        )
        self.counts: dict[str, int] = {}
        self._count_lock = threading.Lock()
        #: Reports queued to Redis, by (lookup_id, gen): engine threads add, the reporter pops.
        self._jobs: dict[tuple[str, int], Job] = {}
        self.engine_seconds = [0] * (len(LATENCY_BUCKETS) + 1)
        self.engine_seconds_sum = 0.0
        self._closed = False
        self._build_threads(factory)
        post_init = getattr(engine, "post_init", None)
        if callable(post_init):
            post_init(async_lookup_server=self)
        self._reporter.start()
        self._consumer.start()

    def _build_threads(self, factory: ConnectionFactory) -> None:
        cfg = self.config
        self._reporter = Reporter(
            cfg, self.keys, self.rank, factory, ScriptSet(), self._on_reported
        )
        self._consumer = Consumer(
            cfg,
            self.keys,
            self.rank,
            factory,
            self._handle,
            self._beat_info,
            self._sweep,
            world_size=self.metadata.world_size,
            flush=self._reporter.flush,
            bind=self._reporter.bind_thread,
        )

    # -- LMCache's contract ---------------------------------------------------------

    def process_requests_from_scheduler(self) -> None:
        """No-op kept for LMCache compatibility: consuming starts on construction."""

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """The engine finished prefetching ``lookup_id``: report its loaded prefix."""
        job = self.tracker.take_running(lookup_id)
        if job is None:
            self._count("report_unknown")
            logger.warning(
                "rank %d: report for %s which is not running; ignored", self.rank, lookup_id
            )
            return
        self._observe(job)
        hits = num_hit_tokens
        if type(hits) is not int or not 0 <= hits <= job.tokens:
            self._count("engine_invalid_hits")
            logger.error(
                "rank %d: engine reported %r hits for %s (%d tokens); reporting 0",
                self.rank,
                num_hit_tokens,
                lookup_id,
                job.tokens,
            )
            hits = 0
        if job.aborted or job.superseded:
            self._count("report_skipped_aborted")
            self._release(lookup_id, job, keep=False)
            return
        self._jobs[(lookup_id, job.gen)] = job
        self._reporter.put(lookup_id, job.gen, hits)

    def close(self) -> None:
        """Ordered shutdown: stop reading, flush reports, release every pin; idempotent."""
        if self._closed:
            return
        self._closed = True
        grace = self.config.block_ms / 1000 + 2.0
        ok = self._consumer.stop(grace)
        ok = self._reporter.stop(grace) and ok
        self.fingerprint.close()
        for lookup_id in self.tracker.release_all():
            self._cleanup(lookup_id)
        if not ok:
            logger.error("rank %d: server threads did not stop within %.1fs", self.rank, grace)

    # -- dispatch -------------------------------------------------------------------

    def _handle(self, msg: LookupRequest | Abort) -> None:
        if isinstance(msg, Abort):
            self._count("aborts")
            if self.tracker.on_abort(msg.lookup_id, msg.gen, time.monotonic()):
                self._cleanup(msg.lookup_id)
            return
        self._handle_lookup(msg)

    def _handle_lookup(self, req: LookupRequest) -> None:
        if self.rank not in req.expected:
            self._count("not_expected")
            return
        if int(time.time() * 1000) > req.deadline_ms:
            self._count("expired")
            return
        decision = self.tracker.on_request(req, time.monotonic())
        self._count(decision)
        if decision == "release_then_start":
            self._cleanup(req.lookup_id)
        if decision in ("start", "release_then_start"):
            self._start(req)

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

    def _on_reported(self, lookup_id: str, gen: int, answer: str) -> None:
        job = self._jobs.pop((lookup_id, gen), None)
        self._count("report_" + answer)
        if job is not None:
            self._release(lookup_id, job, keep=answer in _KEEP)

    def _release(self, lookup_id: str, job: Job, keep: bool) -> None:
        held, nxt = self.tracker.settle(lookup_id, job, keep, time.monotonic())
        if not held:
            self._cleanup(lookup_id)
        if nxt is not None:
            self._start(nxt)

    def _cleanup(self, lookup_id: str) -> None:
        self._count("released")
        try:
            self.engine.cleanup_memory_objs(lookup_id)
        except Exception:  # engine bug: count and log, the loop must go on
            self._count("engine_errors")
            logger.exception("rank %d: engine failed to release %s", self.rank, lookup_id)

    def _sweep(self) -> None:
        for lookup_id in self.tracker.expired_holds(time.monotonic()):
            self._cleanup(lookup_id)
        self.fingerprint.tick()

    # -- observability --------------------------------------------------------------

    def _count(self, what: str, n: int = 1) -> None:
        with self._count_lock:
            self.counts[what] = self.counts.get(what, 0) + n

    def _observe(self, job: Job) -> None:
        seconds = time.monotonic() - job.started
        with self._count_lock:
            self.engine_seconds[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.engine_seconds_sum += seconds

    def _beat_info(self) -> dict[str, Any]:
        return {**self.tracker.sizes(), "requests": self.counts.get("requests", 0)}

    def stats(self) -> dict[str, Any]:
        """Counters and map sizes for metrics, heartbeats and tests."""
        return {
            "rank": self.rank,
            "counts": dict(self.counts),
            **self.tracker.sizes(),
            "consumer": dict(self._consumer.stats),
            "reporter_errors": self._reporter.errors,
            "unexpected_errors": self._consumer.guard.count + self._reporter.guard.count,
            "last_heartbeat": self._consumer.last_beat,
            "ready": self._consumer.ready.is_set(),
            "alive": self._consumer.alive(),
        }

    @property
    def ready(self) -> bool:
        """True once the group exists and the loop is reading."""
        return self._consumer.ready.is_set()

    def __enter__(self) -> RedisAsyncLookupServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
