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
It needs the read-only ``operator`` ACL user (SCAN, GET). Redis unreachable: ``/metrics``
answers 503 (Prometheus's ``up`` is 0) and ``/readyz`` too; ``/healthz`` answers 200
while the HTTP thread lives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generic, TypeVar

import redis
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker_lookup.errors import REDIS_ERRORS, BrokerLookupError, MalformedMessage
from broker_lookup.ops.metrics import EXPORTER_METRICS, ClientCollector, ServerCollector
from broker_lookup.protocol.keys import (
    METRICS_FLEET_PATTERN,
    KeySpace,
    configured_patterns,
    engine_of,
    instance_of,
)
from broker_lookup.protocol.snapshot import MetricsSnapshot, decode_snapshot
from broker_lookup.protocol.stats import ClientStats, RankStats, client_stats, rank_stats
from broker_lookup.ratelimit import RateLimitedLog

__all__ = [
    "PROCESS_LABELS",
    "ExporterServer",
    "FleetCollector",
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
    if engine_id is None:
        patterns = [METRICS_FLEET_PATTERN]
    elif instance_of(engine_id) is None:
        patterns = list(configured_patterns(engine_id, "metrics:*"))
    else:
        patterns = [KeySpace(engine_id).metrics_pattern]
    found = sorted({k for p in patterns for k in client.scan_iter(match=p, count=1000)})
    pipe = client.pipeline(transaction=False)
    for key in found:
        pipe.get(key)
    out: list[tuple[str, MetricsSnapshot]] = []
    malformed = 0
    for key, raw in zip(found, pipe.execute() if found else [], strict=True):
        engine = engine_of(key)
        if raw is None or engine is None:  # expired between the SCAN and the GET
            continue
        try:
            out.append((engine, decode_snapshot(raw)))
        except MalformedMessage:
            malformed += 1
    return out, malformed


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


class FleetCollector(Collector):
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
        self._factory = factory
        self._client: redis.Redis | None = None
        self._engine_id = engine_id
        self._clock = clock
        self._lock = threading.Lock()

    def client(self) -> redis.Redis:
        """The exporter's Redis client."""
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

    def collect(self) -> Iterator[Metric]:
        """One family per metric name, every process's samples in it.

        Raises:
            redis.RedisError: Redis failed (the scrape fails: ``up`` is 0).
        """
        snapshots, malformed = read_snapshots(self.client(), self._engine_id)
        merged: dict[str, Metric] = {}
        read = 0
        for engine, snapshot in snapshots:
            try:
                families = _families(snapshot, self._clock)
            except MalformedMessage:  # stats of the wrong shape: as an undecodable one
                malformed += 1
                continue
            read += 1
            _merge(merged, engine, snapshot, families)
        yield from merged.values()
        state = GaugeMetricFamily(
            "broker_lookup_exporter_snapshots",
            EXPORTER_METRICS["broker_lookup_exporter_snapshots"][1],
            labels=["state"],
        )
        state.add_metric(["read"], float(read))
        state.add_metric(["malformed"], float(malformed))
        yield state


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


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        owner = self.server.owner
        if path == "/metrics":
            code, body, ctype = owner.metrics()
        elif path == "/healthz":
            code, body, ctype = 200, b"ok\n", "text/plain"
        elif path == "/readyz":
            problem = owner.ping()
            code = 503 if problem else 200
            body, ctype = (problem or "ok").encode() + b"\n", "text/plain"
        else:
            code, body, ctype = 404, b"try /metrics, /healthz or /readyz\n", "text/plain"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: ExporterServer


class ExporterServer:
    """The exporter's HTTP endpoint on its own thread: ``/metrics``, ``/healthz``, ``/readyz``.

    >>> server = ExporterServer(FleetCollector(factory), "127.0.0.1", 0)  # doctest: +SKIP
    >>> server.start(); server.port                                        # doctest: +SKIP
    """

    def __init__(self, collector: FleetCollector, host: str, port: int) -> None:
        self.collector = collector
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(collector)
        self._http = _HTTPServer((host, port), _Handler)
        self._http.owner = self
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="bl-exporter-http", daemon=True
        )
        self._warn = RateLimitedLog(logger, 30.0)

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, for port 0)."""
        return int(self._http.server_address[1])

    def start(self) -> ExporterServer:
        """Serve on the HTTP thread."""
        self._thread.start()
        return self

    def metrics(self) -> tuple[int, bytes, str]:
        """(status, body, content type) of one scrape."""
        try:
            return 200, generate_latest(self._registry), CONTENT_TYPE_LATEST
        except (*REDIS_ERRORS, BrokerLookupError) as exc:
            self._warn(logging.WARNING, "exporter: cannot read the snapshots: %s", exc)
            return 503, f"cannot read the metrics snapshots: {exc}\n".encode(), "text/plain"

    def ping(self) -> str | None:
        """None while Redis answers PING, else why not."""
        try:
            self.collector.client().ping()
        except (*REDIS_ERRORS, BrokerLookupError) as exc:
            return f"Redis does not answer: {exc}"
        return None

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop serving and close the Redis client; False if the thread did not end in time."""
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout_s)
        self.collector.close()
        return not self._thread.is_alive()


def render_once(collector: FleetCollector) -> bytes:
    """One scrape's text (``broker-lookup exporter --once``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def serve(
    collector: FleetCollector,
    host: str,
    port: int,
    stop: threading.Event,
    announce: Callable[[str], None] = print,
) -> int:
    """Serve until ``stop`` is set; returns the exit code."""
    server = ExporterServer(collector, host, port).start()
    announce(f"broker-lookup exporter: serving http://{host}:{server.port}/metrics")
    try:
        stop.wait()
    finally:
        if not server.stop():
            logger.error("exporter: HTTP thread did not stop within 2s")
    return 0
