"""Metrics snapshots: each process's counters in Redis, for ``broker-lookup exporter``.

vLLM runs an API server, an EngineCore (the scheduler's lookup client) and one worker
per GPU (a rank's server) in one pod: a metrics port per process would collide, and
nothing would scrape them. Instead the holder of each role (the scheduler, each rank)
writes its ``stats()`` (:mod:`broker_lookup.protocol.stats`) as one JSON string,
``bl:{E}:metrics:<role>``, with a PX of three publish intervals (``metrics_interval_ms``),
from the thread that already renews its lease (the rank's read loop, the client's
listener), in the same round trip as the engine's key refresh. The exporter reads every
snapshot on the server and renders it with the same collectors a process's own
``/metrics`` uses, so names and meanings are one. A restarted process starts from zero
(Prometheus reads that as a counter reset); a gone process's snapshot expires, and its
series with it.

A snapshot is bounded (:data:`MAX_SNAPSHOT_BYTES`): ``stats()`` holds counters keyed by
fixed sets of outcomes and reasons and, with ``rank_insights``, one row per expected
rank. One that grows past the bound is not written (logged once), never truncated.

Schema evolution as for the wire messages: new fields get defaults, unknown ones are
ignored (``stats`` too: :func:`~broker_lookup.protocol.stats.client_stats` and
:func:`~broker_lookup.protocol.stats.rank_stats` read it back), so an exporter and
processes of neighbouring versions share a server.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from broker_lookup.errors import MalformedMessage
from broker_lookup.lmcache_version import running_lmcache_version
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.stats import ClientStats, RankStats, as_json_object

__all__ = [
    "MAX_SNAPSHOT_BYTES",
    "MetricsPublisher",
    "MetricsSnapshot",
    "decode_snapshot",
    "encode_snapshot",
]

logger = logging.getLogger(__name__)

#: The largest snapshot written (a rank's is about 2 KB, a scheduler's of 8 ranks 5 KB).
MAX_SNAPSHOT_BYTES = 64 * 1024

Kind = Literal["client", "server"]


class MetricsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One process's counters at ``ts_ms``: what ``bl:{E}:metrics:<role>`` holds."""

    kind: Kind  #: "client" (the scheduler) or "server" (a rank)
    role: str  #: the lease's role: "sched" or the rank
    host: str
    pid: int
    started_ms: int
    ts_ms: int  #: wall clock of the publish
    #: the engine id the operator configured, where the key namespace was derived from it
    configured_engine_id: str | None = None
    lmcache: str | None = None  #: the LMCache version the process runs (None: none)
    #: the process's ``stats()``, field name -> value (a ClientStats or a RankStats)
    stats: dict[str, Any] = {}


_decoder = msgspec.json.Decoder(MetricsSnapshot)


def encode_snapshot(snapshot: MetricsSnapshot) -> bytes:
    """The JSON of ``snapshot`` (readable with ``redis-cli GET``)."""
    return msgspec.json.encode(snapshot)


def decode_snapshot(raw: bytes | str) -> MetricsSnapshot:
    """The snapshot a ``bl:{E}:metrics:<role>`` key holds.

    Raises:
        MalformedMessage: not a snapshot.
    """
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(f"bad metrics snapshot: {exc}", raw) from None


class MetricsPublisher:
    """Makes one process's snapshot write when due; owns no thread or connection.

    Args:
        keys: the engine's key space.
        role: the lease's role (``SCHEDULER_ROLE`` or ``rank_role(r)``).
        kind: "client" or "server".
        stats: the process's counters, read when a snapshot is due.
        interval_ms: ``metrics_interval_ms`` (0: never due).
        ttl_ms: the snapshot's PX (``metrics_ttl_ms``).
        configured_engine_id: see :class:`MetricsSnapshot`.
    """

    def __init__(
        self,
        keys: KeySpace,
        role: str,
        kind: Kind,
        stats: Callable[[], ClientStats | RankStats],
        *,
        interval_ms: int,
        ttl_ms: int,
        configured_engine_id: str | None = None,
    ) -> None:
        self._key = keys.metrics(role)
        self._role = role
        self._kind: Kind = kind
        self._stats = stats
        self._interval_s = interval_ms / 1000
        self._ttl_ms = ttl_ms
        self._configured = configured_engine_id
        self._host = socket.gethostname()
        self._started_ms = int(time.time() * 1000)
        self._next = 0.0
        self._refused = False
        #: Snapshots made (for tests and stats).
        self.published = 0

    def command(self, now: float) -> Command | None:
        """The SET of a snapshot if one is due at monotonic ``now`` (then the next is
        scheduled), else None; None too, logged once, for one over MAX_SNAPSHOT_BYTES."""
        if not self._interval_s or now < self._next:
            return None
        self._next = now + self._interval_s
        try:
            body = self._body()
        except TypeError as exc:  # stats() holds something JSON cannot: a bug, said once
            self._refuse(f"cannot be encoded ({exc})")
            return None
        if len(body) > MAX_SNAPSHOT_BYTES:
            self._refuse(f"is {len(body)} bytes, over {MAX_SNAPSHOT_BYTES}")
            return None
        self.published += 1
        return ("SET", self._key, body, "PX", self._ttl_ms)

    def _body(self) -> bytes:
        return encode_snapshot(
            MetricsSnapshot(
                kind=self._kind,
                role=self._role,
                host=self._host,
                pid=os.getpid(),
                started_ms=self._started_ms,
                ts_ms=int(time.time() * 1000),
                configured_engine_id=self._configured,
                lmcache=running_lmcache_version(),
                stats=as_json_object(self._stats()),
            )
        )

    def _refuse(self, why: str) -> None:
        if not self._refused:
            self._refused = True
            logger.error(
                "metrics snapshot of %s %s: not published (the exporter shows nothing "
                "for this process)",
                self._key,
                why,
            )
