"""The query endpoint's own series: what its routers asked and what they were told.

``broker-lookup query --listen`` serves these on ``/metrics``. The ranks count their side
(probes answered, reservations held and released) in their own snapshots, which the
exporter serves; this is the querier's side, which no rank sees: a query's outcome per
engine, the reservations it asked for, and how long a query took.

=======================================================  ======================================
``broker_lookup_query_requests_total{result}``           queries by ``result``: ``ok``,
                                                         ``bad_request`` (400), ``unavailable``
                                                         (Redis failed)
``broker_lookup_query_engine_answers_total``             per engine answered, by ``outcome``:
``{engine, outcome}``                                    ``hit`` or the reason for 0 (``miss``,
                                                         ``no_ranks``, ``dead_rank``,
                                                         ``deadline``, ``unavailable``)
``broker_lookup_query_reservations_total``               reservations asked of the best engine,
``{engine, outcome}``                                    by ``outcome``: ``reserved`` (every
                                                         rank pinned), ``refused`` (one did not:
                                                         full, no answer in time, cannot pin)
``broker_lookup_query_duration_seconds``                 a query's time, reserve included
=======================================================  ======================================

``engine`` is the configured engine id (a vLLM instance's namespace without its
``@<instance>``): an instance's id changes with each restart, the configured one does not,
so the series stay few.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric

from broker_lookup.ops.exporter import ServedCollector
from broker_lookup.ops.fleet_query import FleetAnswer
from broker_lookup.protocol.keys import configured_of

__all__ = ["QueryMetrics"]

#: Seconds: a query's deadline is tens of milliseconds; a reserve doubles it at most.
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class QueryMetrics(ServedCollector):
    """Counts each answer of the query endpoint (see the module); a prometheus collector.

    Args:
        factory: makes the Redis client the endpoint's ``/readyz`` pings (made on the
            first ping; a scrape never touches Redis).
    """

    def __init__(self, factory: Callable[[], redis.Redis]) -> None:
        super().__init__(factory)
        self._registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "broker_lookup_query_requests",
            "Fleet queries answered by the endpoint, by result: ok, bad_request, unavailable.",
            ["result"],
            registry=self._registry,
        )
        self.answers = Counter(
            "broker_lookup_query_engine_answers",
            "Engines' answers to fleet queries, by configured engine id and outcome: hit, "
            "or the reason for 0 (miss, no_ranks, dead_rank, deadline, unavailable).",
            ["engine", "outcome"],
            registry=self._registry,
        )
        self.reservations = Counter(
            "broker_lookup_query_reservations",
            "Reservations asked of the best engine, by configured engine id and outcome: "
            "reserved (every rank pinned) or refused.",
            ["engine", "outcome"],
            registry=self._registry,
        )
        self.duration = Histogram(
            "broker_lookup_query_duration_seconds",
            "Time to answer a fleet query, its reservation included.",
            buckets=BUCKETS,
            registry=self._registry,
        )

    def record(self, answer: FleetAnswer, reserve_ms: int = 0) -> None:
        """Count ``answer`` (to a query that asked ``reserve_ms``)."""
        if answer.problem and answer.available:
            self.requests.labels("bad_request").inc()
            return
        self.requests.labels("ok" if answer.available else "unavailable").inc()
        self.duration.observe(answer.elapsed_ms / 1000)
        for e in answer.engines:
            engine = configured_of(e.engine_id)
            self.answers.labels(engine, "hit" if e.tokens else e.reason or "miss").inc()
        best = answer.best()
        if reserve_ms and best is not None:
            outcome = "reserved" if best.reserved else "refused"
            self.reservations.labels(configured_of(best.engine_id), outcome).inc()

    def collect(self) -> Iterator[Metric]:
        """Every series (one scrape)."""
        yield from self._registry.collect()
