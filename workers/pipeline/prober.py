"""The rank's answers to the fleet query: its own thread on its own connection.

A router asks every rank of an engine how much of a prefix it holds (``protocol.probe``).
The rank's lookups must not pay for that, so probes never enter the request stream, the
consumer group or the dispatcher: this thread XREADs the engine's probe stream (plain
XREAD, BLOCK ``block_ms``, from ``LOOKBACK_MS`` before the server's time when it
connects), asks the engine with a lookup that loads and pins nothing
(:class:`~broker_lookup.engine.ProbeEngine`, or LMCache's ``lookup(..., pin=False)``) and
RPUSHes one answer per probe, the answers of one read in the pipeline that carries the
next read. Only the rank's lease holder answers: a process waiting for the rank would
answer for a cache nobody routes to. After a Redis error it reconnects and reads from
``LOOKBACK_MS`` back again, so a probe sent during a blip is still answered (a late answer
costs nothing: its list expires); one older than that is answered by nobody, which its
querier reports as the deadline, never as a wrong count.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup.errors import REDIS_ERRORS, MalformedMessage
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.probe import (
    Probe,
    ProbeAnswer,
    Reserve,
    decode_probe,
    encode_answer,
)
from broker_lookup.ratelimit import RateLimitedLog
from broker_lookup.threads import LoopThread
from broker_lookup.transport.connection import ConnectionFactory
from broker_lookup.transport.link import Link, open_link, stream_entries
from workers.pipeline.reservations import Reservations

__all__ = ["Prober", "probe_function"]

logger = logging.getLogger(__name__)

#: Most probes one read returns.
BATCH_SIZE = 100
#: How far back the first read after a (re)connect starts, by the server's clock.
LOOKBACK_MS = 1000
#: Wait after a Redis error before connecting again.
ERROR_BACKOFF_S = 0.2

#: ``(hashes, offsets, request_configs) -> tokens held``; None: the engine cannot say.
ProbeFunction = Callable[[list[int], list[int], dict[str, Any] | None], int]


def probe_function(engine: object) -> ProbeFunction | None:
    """How to ask ``engine`` for its held prefix without a load: ``probe_prefix`` (the
    reference engine), else LMCache's ``lookup`` with ``pin=False``, else None."""
    own = getattr(engine, "probe_prefix", None)
    if callable(own):
        return lambda h, o, c: int(own(h, o, request_configs=c))
    lookup = getattr(engine, "lookup", None)
    if callable(lookup):
        return lambda h, o, c: int(lookup(hashes=h, offsets=o, pin=False, request_configs=c))
    return None


class Prober(LoopThread):
    """Answers the probes of one rank (see the module docstring).

    Args:
        engine: the rank's engine.
        keys: the engine's key space.
        rank: this rank.
        factory: connections (a pool of its own is not needed: the thread holds one).
        block_ms: XREAD BLOCK, under the factory's socket timeout.
        serving: whether this process holds the rank's lease now.
        reservations: the rank's reservations: this thread makes them and expires them.
    """

    def __init__(
        self,
        engine: object,
        keys: KeySpace,
        rank: int,
        factory: ConnectionFactory,
        block_ms: int,
        serving: Callable[[], bool],
        reservations: Reservations,
    ) -> None:
        super().__init__(f"rank {rank} prober")
        self._reservations = reservations
        self._ask = probe_function(engine)
        self._keys, self._rank, self._factory = keys, rank, factory
        self._block_ms, self._serving = block_ms, serving
        self._warn = RateLimitedLog(logger, 30.0)
        #: Probes answered, by status, plus undecodable ones and Redis errors.
        self.counts = {"ok": 0, "unsupported": 0, "error": 0, "malformed": 0, "redis_errors": 0}
        #: Answers of the last read, sent with the next (list key, answer, TTL ms).
        self._answers: list[tuple[str, bytes, int]] = []
        #: Set once the first read's start is fixed: a probe sent after it is answered.
        self.reading = threading.Event()

    def _run(self) -> None:
        client: redis.Redis | None = None
        link: Link | None = None
        last: bytes | str = "0"
        while not self._stop.is_set():
            # Before anything that needs Redis: a reservation ends at its TTL while Redis
            # is unreachable too.
            self._reservations.expire()
            try:
                if client is None or link is None:
                    client = self._factory()
                    seconds, micros = client.time()
                    last = f"{max(0, seconds * 1000 + micros // 1000 - LOOKBACK_MS)}-0"
                    link = open_link(client)
                    self.reading.set()
                last = self._turn(link, last)
            except REDIS_ERRORS as exc:
                self.counts["redis_errors"] += 1
                self._warn(logging.WARNING, "rank %d: probes: Redis: %s", self._rank, exc)
                _dropped(client, link)
                client = link = None
                self._stop.wait(ERROR_BACKOFF_S)
            except Exception:
                self.guard()
        _dropped(client, link)

    def _turn(self, link: Link, last: bytes | str) -> bytes | str:
        """Send the last read's answers with the next read, in one write on the lean link
        (a probe costs the rank one read's share and one RPUSH); returns the id to read
        after."""
        answers: list[Command] = []
        for key, answer, ttl_ms in self._answers:
            answers += [("RPUSH", key, answer), ("PEXPIRE", key, ttl_ms)]
        self._answers = []
        read = ("XREAD", "COUNT", BATCH_SIZE, "BLOCK", self._block_ms, "STREAMS")
        link.call(answers, read=(*read, self._keys.probes, last))
        entries = stream_entries(link.take_read())
        if not entries:
            return last
        if self._serving():
            self._answers = [a for _, fields in entries if (a := self._answered(fields))]
        return entries[-1][0]

    def _answered(self, fields: dict[bytes, bytes] | None) -> tuple[str, bytes, int] | None:
        """(answer list, answer, its TTL) of one probe entry; None for one not a probe."""
        try:
            probe = decode_probe(fields or {})
        except MalformedMessage as exc:
            self.counts["malformed"] += 1
            self._warn(logging.WARNING, "rank %d: probe ignored: %s", self._rank, exc)
            return None
        answer = self._answer(probe)
        self.counts[answer.status] += 1
        key = self._keys.probe_reply(probe.query_id)
        return key, encode_answer(answer), max(1, probe.budget_ms)

    def _answer(self, probe: Probe | Reserve) -> ProbeAnswer:
        if isinstance(probe, Reserve):
            if not self._reservations.supported:
                return ProbeAnswer(rank=self._rank, tokens=0, status="unsupported")
            return ProbeAnswer(rank=self._rank, tokens=self._reservations.reserve(probe))
        if self._ask is None:
            return ProbeAnswer(rank=self._rank, tokens=0, status="unsupported")
        try:
            tokens = self._ask(probe.hashes, probe.offsets, probe.request_configs)
        except Exception:
            logger.exception("rank %d: the engine failed a probe; answered 'error'", self._rank)
            return ProbeAnswer(rank=self._rank, tokens=0, status="error")
        # Never more than was asked: the count is a promise a router acts on.
        return ProbeAnswer(rank=self._rank, tokens=max(0, min(tokens, sum(probe.offsets))))


def _dropped(client: redis.Redis | None, link: Link | None) -> None:
    for thing in (link, client):
        if thing is not None:
            try:
                thing.close()
            except REDIS_ERRORS:
                pass
