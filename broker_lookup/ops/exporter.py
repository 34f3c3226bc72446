"""``broker-lookup exporter``: ``/metrics`` of every process of every engine on one server.

Each scheduler and rank publishes its counters to ``bl:{E}:metrics:<role>``
(:mod:`broker_lookup.protocol.snapshot`); at each scrape the exporter reads every
snapshot (one SCAN, then one pipelined GET) and renders it with the collectors of
:mod:`broker_lookup.ops.metrics`, so a series has the name and meaning it has on a
process's own ``/metrics``. Each series gets, besides its own labels:

=========================  =============================================================
``engine``                 the key namespace (a vLLM instance: ``<engine_id>@<instance>``)
``configured_engine_id``   the engine id the operator configured (``engine`` where it was
                           not derived)
``role``                   ``scheduler`` or ``worker`` (a rank; its series carry ``rank``,
                           the scheduler's ``rank_*`` series the rank they are about)
``host``                   the process's host name (the pod's name in Kubernetes)
=========================  =============================================================

The exporter holds no state: it may restart, and two replicas serve the same series.
It needs the read-only ``operator`` ACL user (SCAN, GET); the chart's is ``exporter``. One
process's snapshot never costs the others their series: a key that is no snapshot (another
type, undecodable, a value beyond float range) or one the user may not read is skipped,
counted in ``broker_lookup_exporter_snapshots{state="malformed"|"denied"}`` and logged.
``broker_lookup_engine_split`` is 1 for each namespace of an engine split in two (see
``split``), else 0. Every scrape carries ``broker_lookup_redis_up``: 1 when it read Redis;
Redis unreachable, ``/metrics`` still answers 200 with ``broker_lookup_redis_up 0`` alone, so
an alert tells a Redis outage (that series at 0) from an exporter that is gone (Prometheus's
``up`` 0, or the series absent). ``/readyz`` answers 503 then; ``/healthz`` answers 200 while
the HTTP thread lives.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker_lookup.errors import REDIS_ERRORS, BrokerLookupError, MalformedMessage
from broker_lookup.ops.access import denial
from broker_lookup.ops.endpoint import Endpoint, PostRoute
from broker_lookup.ops.metrics import EXPORTER_METRICS, ClientCollector, ServerCollector
from broker_lookup.ops.split import View, find_splits
from broker_lookup.protocol.keys import (
    METRICS_FLEET_PATTERN,
    configured_of,
    engine_of,
    selected_patterns,
)
from broker_lookup.protocol.snapshot import MetricsSnapshot, decode_snapshot
from broker_lookup.protocol.stats import ClientStats, RankStats, client_stats, rank_stats
from broker_lookup.ratelimit import RateLimitedLog

__all__ = [
    "PROCESS_LABELS",
    "ExporterServer",
    "FleetCollector",
    "ServedCollector",
    "read_snapshots",
    "render_once",
    "serve",
]

logger = logging.getLogger(__name__)

#: The labels the exporter adds to every series of a process, in this order.
PROCESS_LABELS = ("engine", "configured_engine_id", "role", "host")
_ROLE = {"client": "scheduler", "server": "worker"}
_S = TypeVar("_S", ClientStats, RankStats)


def read_snapshots(
    client: redis.Redis, engine_id: str | None = None
) -> tuple[list[tuple[str, MetricsSnapshot]], int]:
    """Every metrics snapshot on the server (of ``engine_id`` and its vLLM instances
    only, when given), as (engine, snapshot), sorted; and how many did not decode.

    Raises:
        redis.RedisError: Redis failed.
    """
    found, skipped = _read(client, engine_id)
    return found, skipped["malformed"]


def _read(
    client: redis.Redis, engine_id: str | None
) -> tuple[list[tuple[str, MetricsSnapshot]], dict[str, int]]:
    """:func:`read_snapshots`, with the skipped keys counted by why (malformed, denied)."""
    patterns = (
        [METRICS_FLEET_PATTERN]
        if engine_id is None
        else list(selected_patterns(engine_id, "metrics:*"))
    )
    found = sorted({k for p in patterns for k in client.scan_iter(match=p, count=1000)})
    pipe = client.pipeline(transaction=False)
    for key in found:
        pipe.get(key)
    out: list[tuple[str, MetricsSnapshot]] = []
    skipped = {"malformed": 0, "denied": 0}
    # One key's error (another type, a key the user may not read) is that key's alone.
    replies = pipe.execute(raise_on_error=False) if found else []
    for key, raw in zip(found, replies, strict=True):
        engine = engine_of(key)
        if raw is None or engine is None:  # expired between the SCAN and the GET
            continue
        if isinstance(raw, Exception):
            if isinstance(raw, redis.ConnectionError | redis.TimeoutError):
                raise raw
            why = "denied" if denial(raw) else "malformed"
            skipped[why] += 1
            _SKIPPED(logging.WARNING, "exporter: %s skipped (%s): %s", _text(key), why, raw)
            continue
        try:
            out.append((engine, decode_snapshot(raw)))
        except MalformedMessage as exc:
            skipped["malformed"] += 1
            _SKIPPED(logging.WARNING, "exporter: %s skipped: %s", _text(key), exc.reason)
    return out, skipped


def _text(key: object) -> str:
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


#: Skipped keys are logged at most every 60 s: a bad key is met at every scrape.
_SKIPPED = RateLimitedLog(logger, 60.0)


class _Published(Generic[_S]):
    """A snapshot's stats standing in for the process it came from, for the collectors."""

    def __init__(self, stats: _S) -> None:
        self._stats: _S = stats

    def stats(self) -> _S:
        return self._stats


def _families(snapshot: MetricsSnapshot, clock: Callable[[], float]) -> list[Metric]:
    """The families of one snapshot.

    Raises:
        MalformedMessage: its ``stats`` do not read as its kind's stats.
    """
    version = snapshot.lmcache
    if snapshot.kind == "client":
        client = _Published(client_stats(snapshot.stats))
        return list(ClientCollector(client, lambda: version).collect())
    server = _Published(rank_stats(snapshot.stats))
    return list(ServerCollector(server, clock, lambda: version).collect())


class ServedCollector(Collector):
    """What :class:`ExporterServer` serves: the series of a scrape (:meth:`collect`), and
    the one Redis client its ``/readyz`` pings, made by ``factory`` when first needed."""

    def __init__(self, factory: Callable[[], redis.Redis]) -> None:
        self._factory = factory
        self._client: redis.Redis | None = None
        self._lock = threading.Lock()

    @abstractmethod
    def collect(self) -> Iterator[Metric]:
        """Every series of one scrape."""

    def client(self) -> redis.Redis:
        """The Redis client (made on first use)."""
        with self._lock:
            if self._client is None:
                self._client = self._factory()
            return self._client

    def close(self) -> None:
        """Close the Redis client."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


class FleetCollector(ServedCollector):
    """The series of every process of every engine on one server (see the module doc).

    Args:
        factory: makes the Redis client (one, made on the first scrape).
        engine_id: only this engine and its vLLM instances (None: every engine).
        clock: wall clock for the heartbeat ages (tests pass their own).
    """

    def __init__(
        self,
        factory: Callable[[], redis.Redis],
        engine_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(factory)
        self._engine_id = engine_id
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        """One family per metric name, every process's samples in it.

        Raises:
            redis.RedisError: Redis failed (the scrape fails: ``up`` is 0).
        """
        snapshots, skipped = _read(self.client(), self._engine_id)
        merged: dict[str, Metric] = {}
        read = 0
        for engine, snapshot in snapshots:
            try:
                families = _families(snapshot, self._clock)
            except (MalformedMessage, ArithmeticError, ValueError, TypeError) as exc:
                # Stats of the wrong shape, or a count beyond float range: as undecodable.
                skipped["malformed"] += 1
                _SKIPPED(logging.WARNING, "exporter: snapshot of %s skipped: %s", engine, exc)
                continue
            read += 1
            _merge(merged, engine, snapshot, families)
        yield from merged.values()
        yield _redis_up(1.0)
        yield _split_family(snapshots)
        state = GaugeMetricFamily(
            "broker_lookup_exporter_snapshots",
            EXPORTER_METRICS["broker_lookup_exporter_snapshots"][1],
            labels=["state"],
        )
        state.add_metric(["read"], float(read))
        for why, count in skipped.items():
            state.add_metric([why], float(count))
        yield state


def _redis_up(value: float) -> Metric:
    """``broker_lookup_redis_up``: whether this scrape read Redis."""
    name = "broker_lookup_redis_up"
    family = GaugeMetricFamily(name, EXPORTER_METRICS[name][1])
    family.add_metric([], value)
    return family


class _RedisDown(Collector):
    """What a scrape serves when Redis does not answer: ``broker_lookup_redis_up 0``."""

    def collect(self) -> Iterator[Metric]:
        yield _redis_up(0.0)


def _split_family(snapshots: list[tuple[str, MetricsSnapshot]]) -> Metric:
    """``broker_lookup_engine_split``: per namespace with a snapshot, 1 if it is one side
    of a split engine, else 0."""
    scheduler: dict[str, bool] = {}
    ranks: dict[str, set[int]] = {}
    dead: dict[str, frozenset[int] | None] = {}
    configured: dict[str, str] = {}
    for engine, snap in snapshots:
        configured.setdefault(engine, snap.configured_engine_id or configured_of(engine))
        ranks.setdefault(engine, set())
        scheduler.setdefault(engine, False)
        if snap.kind == "client":
            scheduler[engine] = True
            try:
                stats = client_stats(snap.stats)
            except MalformedMessage:
                continue
            dead[engine] = frozenset(stats.dead_ranks) if stats.liveness_known else None
        elif snap.role.isdigit():
            ranks[engine].add(int(snap.role))
    views = [View(e, scheduler[e], frozenset(ranks[e]), dead.get(e)) for e in sorted(ranks)]
    split = {ns for s in find_splits(views) for ns in (s.scheduler_ns, s.ranks_ns)}
    name = "broker_lookup_engine_split"
    family = GaugeMetricFamily(
        name, EXPORTER_METRICS[name][1], labels=["engine", "configured_engine_id"]
    )
    for engine in sorted(ranks):
        family.add_metric([engine, configured[engine]], 1.0 if engine in split else 0.0)
    return family


def _merge(
    merged: dict[str, Metric], engine: str, snapshot: MetricsSnapshot, families: list[Metric]
) -> None:
    """Add one snapshot's samples to ``merged``, labelled with the process they came from."""
    extra = {
        "engine": engine,
        "configured_engine_id": snapshot.configured_engine_id or engine,
        "role": _ROLE[snapshot.kind],
        "host": snapshot.host,
    }
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
        for sample in family.samples:
            labels = {**extra, **sample.labels}
            if snapshot.kind == "server":
                # Ranks of one pod share engine and host: each series names its rank
                # (broker_lookup_lmcache_info has none of its own).
                labels.setdefault("rank", snapshot.role)
            into.add_sample(sample.name, labels, sample.value)


class ExporterServer:
    """The exporter's ``/metrics``, ``/healthz`` and ``/readyz``, served by the one
    :class:`~broker_lookup.ops.endpoint.Endpoint` a rank serves its own with.

    >>> server = ExporterServer(FleetCollector(factory), "127.0.0.1", 0)  # doctest: +SKIP
    >>> server.start(); server.port                                        # doctest: +SKIP
    """

    def __init__(
        self,
        collector: ServedCollector,
        host: str,
        port: int,
        routes: dict[str, PostRoute] | None = None,
    ) -> None:
        self.collector = collector
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(collector)
        self._warn = RateLimitedLog(logger, 30.0)
        self._down = CollectorRegistry(auto_describe=False)
        self._down.register(_RedisDown())
        self._endpoint = Endpoint(
            host, port, self.metrics, ready=self.ping, name="bl-exporter-http", routes=routes
        )

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, for port 0)."""
        return self._endpoint.port

    def start(self) -> ExporterServer:
        """Serve on the HTTP thread."""
        self._endpoint.start()
        return self

    def metrics(self) -> tuple[int, bytes, str]:
        """(status, body, content type) of one scrape: Redis unreachable, 200 with
        ``broker_lookup_redis_up 0`` alone (an alert rule reads it; a 503 would look like
        a gone exporter)."""
        try:
            return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST
        except (*REDIS_ERRORS, BrokerLookupError) as exc:
            self._warn(logging.WARNING, "exporter: cannot read the snapshots: %s", exc)
            return 200, generate_latest(self._down), CONTENT_TYPE_LATEST
        except Exception:  # a bug: this scrape fails, the HTTP thread and the next live on
            logger.exception("exporter: scrape failed")
            return 500, b"scrape failed: see the exporter's log\n", "text/plain"

    def ping(self) -> str | None:
        """None while Redis answers PING, else why not."""
        try:
            self.collector.client().ping()
        except (*REDIS_ERRORS, BrokerLookupError) as exc:
            return f"Redis does not answer: {exc}"
        return None

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop serving and close the Redis client; False if the thread did not end in time."""
        stopped = self._endpoint.stop(timeout_s)
        self.collector.close()
        return stopped


def render_once(collector: FleetCollector) -> bytes:
    """One scrape's text (``broker-lookup exporter --once``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def serve(
    collector: ServedCollector,
    host: str,
    port: int,
    stop: threading.Event,
    announce: Callable[[str], None] = print,
    routes: dict[str, PostRoute] | None = None,
) -> int:
    """Serve until ``stop`` is set (``routes``: POST routes beside ``/metrics``); returns
    the exit code."""
    server = ExporterServer(collector, host, port, routes).start()
    announce(f"broker-lookup exporter: serving http://{host}:{server.port}/metrics")
    try:
        stop.wait()
    finally:
        if not server.stop():
            logger.error("exporter: HTTP thread did not stop within 2s")
    return 0
