"""One worker rank as a process: engine, preload, lookup server, HTTP endpoint, ordered stop.

Shutdown order: ``/readyz`` answers 503 → ``server.close()`` (stop reading, flush
reports, release pins, delete the heartbeat) → ``engine.close()`` → HTTP stops.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec
import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from broker_lookup.config import LookupConfig, LookupMetadata, redact_url
from broker_lookup.errors import AuthFailed, BrokerLookupError, translate_redis_errors
from broker_lookup.ops.endpoint import Endpoint, Pinger
from broker_lookup.ops.metrics import ServerCollector
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.transport.connection import close_factory, make_factory
from workers.runtime.access import denied_access
from workers.server import RedisAsyncLookupServer

if TYPE_CHECKING:  # imported when a rank starts: it loads torch, seconds that --help skips
    from workers.reference.engine import ReferenceEngine

__all__ = ["RankSpec", "UsageError"]

logger = logging.getLogger(__name__)


class UsageError(BrokerLookupError):
    """A bad flag, environment variable, config or preload file: exit code USAGE (2)."""


class _Prompt(msgspec.Struct, forbid_unknown_fields=True):
    tokens: list[int]
    ranks: list[int] | None = None  #: None: every rank
    fraction: float = 1.0  #: leading share of the chunks stored
    tier: Literal["memory", "disk"] = "memory"


class _PreloadFile(msgspec.Struct, forbid_unknown_fields=True):
    prompts: list[_Prompt]


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank process needs, already validated."""

    config: LookupConfig
    metadata: LookupMetadata
    metrics_host: str
    metrics_port: int  #: 0 disables the HTTP endpoint
    connect_timeout_s: float
    memory_chunks: int
    disk_dir: str | None
    disk_chunks: int
    load_delay_ms: float
    preload: str | None
    #: seconds this process may go without the rank's lease before it exits NOT_OWNER
    #: (None: twice the lease plus 10 s; 0: wait forever)
    claim_timeout_s: float | None = None

    @property
    def claim_wait_s(self) -> float:
        """The bound on waiting for the rank's lease (0.0: none)."""
        if self.claim_timeout_s is not None:
            return self.claim_timeout_s
        return 2 * self.config.lease_ms / 1000 + 10.0


def preload(engine: ReferenceEngine, config: LookupConfig, rank: int, path: str) -> int:
    """Store ``rank``'s share of the prompts of a ``--preload`` file; return the chunks stored.

    The file is ``{"prompts": [{"tokens": [...], "ranks": [0, 1] | null, "fraction": 1.0,
    "tier": "memory" | "disk"}]}``: each prompt is hashed as the scheduler hashes it and
    its first ``fraction`` of chunks is stored on the listed ranks (null: every rank).

    Raises:
        UsageError: The file is unreadable or invalid.
    """
    try:
        data = msgspec.json.decode(Path(path).read_bytes(), type=_PreloadFile)
    except (OSError, msgspec.DecodeError) as exc:
        raise UsageError(f"--preload {path}: {exc}") from None
    logger.info("preloading %d prompts from %s", len(data.prompts), path)
    hasher = ChunkedTokenHasher(config)
    stored = 0
    for i, prompt in enumerate(data.prompts):
        if not 0.0 <= prompt.fraction <= 1.0:
            raise UsageError(f"--preload {path}: prompts[{i}].fraction is not in [0, 1]")
        if prompt.ranks is not None and rank not in prompt.ranks:
            continue
        hashes, offsets = hasher.hashes_and_offsets(prompt.tokens)
        keep = int(len(hashes) * prompt.fraction)
        try:
            stored += engine.store(hashes[:keep], offsets[:keep], tier=prompt.tier)
        except ValueError as exc:
            raise UsageError(f"--preload {path}: prompts[{i}]: {exc}") from None
    logger.info("preloaded %d chunks from %s", stored, path)
    return stored


def wait_for_redis(config: LookupConfig, timeout_s: float, stop: threading.Event) -> str | None:
    """PING until Redis answers; None once it does, else the last error after ``timeout_s``.

    Raises:
        AuthFailed: Redis refused the credentials: at once, since waiting will not help.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        # Each PING waits at most what is left of timeout_s, and once: redis-py's own
        # retries, connecting again each time, would outlast the bound the log promised.
        left = min(deadline - time.monotonic(), config.socket_timeout_ms / 1000)
        factory = make_factory(config, "bl-worker-startup", socket_timeout_s=max(left, 0.05))
        client = factory()
        try:
            with translate_redis_errors("connecting at startup"):
                client.ping()
            return None
        except AuthFailed:
            raise
        except (BrokerLookupError, redis.RedisError) as exc:
            error = str(exc)
        finally:
            client.close()
            close_factory(factory)
        if time.monotonic() >= deadline - 0.05 or stop.is_set():
            return error
        logger.info("Redis not reachable yet (%s); retrying", error)
        stop.wait(min(0.5, max(deadline - time.monotonic(), 0.0)))


class RankRunner:
    """Runs one rank until ``stop`` is set; :meth:`run` returns the process exit code."""

    def __init__(self, spec: RankSpec, stop: threading.Event) -> None:
        self.spec = spec
        self._stop = stop
        self._started = time.monotonic()

    def run(self) -> int:
        """Start everything, serve until stopped, shut down in order."""
        spec = self.spec
        logger.info(
            "rank %d of engine %s: connecting to %s (up to %.0fs, --connect-timeout)",
            spec.metadata.worker_id,
            spec.metadata.engine_id,
            redact_url(spec.config.redis_url),
            spec.connect_timeout_s,
        )
        try:
            error = wait_for_redis(spec.config, spec.connect_timeout_s, self._stop)
        except AuthFailed as exc:
            logger.error("%s", exc)
            return ExitCode.USAGE
        if error is not None:
            if self._stop.is_set():
                return ExitCode.OK
            logger.error(
                "Redis unreachable after %.0fs (--connect-timeout): %s",
                spec.connect_timeout_s,
                error,
            )
            return ExitCode.UNREACHABLE
        denied = denied_access(spec.config, spec.metadata, spec.connect_timeout_s)
        if denied is not None:  # like a wrong password: retrying will not help
            logger.error("%s", denied)
            return ExitCode.USAGE
        engine = self._engine()
        try:
            if spec.preload:
                preload(engine, spec.config, spec.metadata.worker_id, spec.preload)
            logger.info("starting the lookup server (consumer group, heartbeat)")
            server = RedisAsyncLookupServer(engine, spec.metadata, spec.config)
        except BaseException:
            engine.close()
            raise
        return self._serve(engine, server)

    def _engine(self) -> ReferenceEngine:
        spec = self.spec
        logger.info(
            "Redis answered; loading the reference engine (torch; memory %d chunks, disk %s)",
            spec.memory_chunks,
            f"{spec.disk_chunks} chunks in {spec.disk_dir}" if spec.disk_dir else "off",
        )
        from workers.reference.engine import ReferenceEngine

        try:
            return ReferenceEngine(
                memory_capacity_chunks=spec.memory_chunks,
                disk_dir=spec.disk_dir,
                disk_capacity_chunks=spec.disk_chunks,
                load_delay_s=spec.load_delay_ms / 1000,
            )
        except (ValueError, OSError) as exc:
            raise UsageError(f"reference engine options: {exc}") from None

    def _serve(self, engine: ReferenceEngine, server: RedisAsyncLookupServer) -> int:
        http: Endpoint | None = None
        pinger = Pinger(make_factory(self.spec.config, "bl-worker-probe"))
        code: int = ExitCode.OK
        try:
            http = self._http(server, pinger)
            logger.info(
                "rank %d of engine %s serving (metrics port %s)",
                server.rank,
                self.spec.metadata.engine_id,
                http.port if http else "off",
            )
            code = self._watch(server)
        except OSError as exc:
            logger.error("cannot serve --metrics-port %d: %s", self.spec.metrics_port, exc)
            code = ExitCode.USAGE
        finally:
            self._shutdown(engine, server, http, pinger)
        return code

    def _http(self, server: RedisAsyncLookupServer, pinger: Pinger) -> Endpoint | None:
        if not self.spec.metrics_port:
            return None
        registry = CollectorRegistry()
        registry.register(ServerCollector(server))

        def ready() -> str | None:
            if not server.lease.held():
                return server.lease.not_serving_reason()
            if not server.ready:
                return "consumer group not ready (the rank is not reading yet)"
            return pinger.ping(1.0)

        def alive() -> str | None:
            return None if server.stats().alive else "the rank's read loop is not running"

        return Endpoint(
            self.spec.metrics_host,
            self.spec.metrics_port,
            lambda: (200, generate_latest(registry), CONTENT_TYPE_LATEST),
            alive=alive,
            ready=ready,
        ).start()

    def _watch(self, server: RedisAsyncLookupServer) -> int:
        wait_s = self.spec.claim_wait_s
        while not self._stop.wait(1.0):
            if not server.stats().alive:
                logger.error("rank %d: the read loop died; exiting", server.rank)
                return ExitCode.FAILED
            if wait_s and server.lease.contended_for() > wait_s:
                logger.error(
                    "rank %d: another process held its lease for %.0fs (--claim-timeout): %s; "
                    "exiting with code %d",
                    server.rank,
                    wait_s,
                    server.lease.not_serving_reason(),
                    ExitCode.NOT_OWNER,
                )
                return ExitCode.NOT_OWNER
        return ExitCode.OK

    def _shutdown(
        self,
        engine: ReferenceEngine,
        server: RedisAsyncLookupServer,
        http: Endpoint | None,
        pinger: Pinger,
    ) -> None:
        if http is not None:
            http.draining.set()
        server.close()
        engine.close(timeout_s=5.0)
        if http is not None and not http.stop(2.0):
            logger.error("HTTP thread did not stop within 2s")
        pinger.join(1.0)
        self._summary(server)

    def _summary(self, server: RedisAsyncLookupServer) -> None:
        st = server.stats()
        counts = st.counts
        consumer = st.consumer
        logger.info(
            "rank %d stopped after %.1fs: requests=%d reports=%d aborts=%d expired=%d "
            "dead_letters=%d redis_errors=%d engine_errors=%d",
            server.rank,
            time.monotonic() - self._started,
            counts.get("requests", 0),
            sum(v for k, v in counts.items() if k.startswith("report_")),
            counts.get("aborts", 0),
            counts.get("expired", 0),
            consumer.dead_letters,
            consumer.redis_errors + st.reporter_errors,
            counts.get("engine_errors", 0),
        )
