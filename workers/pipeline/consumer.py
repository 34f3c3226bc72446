"""The rank's read loop: its consumer group on the request stream, acks, dead letters, heartbeat.

On start it creates the group idempotently, then re-reads its own pending entries
with id ``0`` (a restarted rank finishes what it had been given), then reads new
entries with ``>`` and a short BLOCK on its own connection. Every entry is acked
after dispatch; undecodable ones are dead-lettered first.

Nothing read stays pending (DESIGN rule 10): after any error, and once a second
anyway, the loop re-reads its own pending entries, so a delivery whose reply was lost
between XREADGROUP and XACK (a reset, a held connection, redis-py retrying the read)
is served then; dedupe by (id, gen) makes a re-served entry harmless. A group
re-created after NOGROUP starts at ``0``, so entries written meanwhile are read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, MalformedMessage, translate_redis_errors
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import (
    Abort,
    LookupRequest,
    decode_request,
)
from broker_lookup.threads import LoopThread
from broker_lookup.transport.connection import ensure_group
from workers.pipeline.clock import ServerClock
from workers.pipeline.entries import entry_problem

__all__ = ["Consumer"]

logger = logging.getLogger(__name__)

#: Dispatches one entry; the float is how many ms it stays worth answering (inf for aborts).
Handler = Callable[[LookupRequest | Abort, float], None]
#: Acks the entries of a batch (and sends what else must ride with the ack).
Flush = Callable[[redis.Redis, list[bytes]], None]

_COUNTERS = ("entries", "dead_letters", "redis_errors", "nogroup", "replayed", "pending", "lag")
#: How often the loop re-reads its own pending entries when nothing went wrong.
REPLAY_EVERY_S = 1.0


class Consumer(LoopThread):
    """Owns the rank's blocking connection and loop thread."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        handle: Handler,
        beat_info: Callable[[], dict[str, Any]],
        on_tick: Callable[[], None],
        *,
        world_size: int | None = None,
        flush: Flush | None = None,
        bind: Callable[[], None] | None = None,
        redis_retries: bool = True,
    ) -> None:
        super().__init__(f"rank {rank} consumer", f"rank-{rank}")
        self._config = config
        self._world_size = world_size
        self._keys = keys
        self._rank = rank
        self._factory = factory
        self._handle = handle
        self._beat_info = beat_info
        self._on_tick = on_tick
        self._flush: Flush = flush or self._xack
        self._bind: Callable[[], None] = bind or (lambda: None)
        self._group = keys.group(rank)
        self._name = keys.consumer(rank)
        self._replaying = True
        self._recreate = False  # after NOGROUP: the new group starts at 0
        self._next_replay = 0.0
        self._redis_retries = redis_retries
        #: The server's clock, sampled with the heartbeat; judges request budgets.
        self.clock = ServerClock()
        self._next_beat = 0.0
        self._next_info = 0.0
        self.stats: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.last_beat = 0.0
        self.ready = threading.Event()
        self._started_ms = int(time.time() * 1000)

    def _run(self) -> None:
        self._bind()
        client = self._factory()
        if not self._redis_retries:
            # A timed-out read surfaces at once (and is followed by a re-read of the
            # pending entries) instead of being retried blind, which would multiply the
            # socket timeout and could swallow a delivery.
            client.set_retry(Retry(NoBackoff(), 0))
        try:
            while not self._stop.is_set():
                self._iteration(client)
        finally:
            self._clear_heartbeat(client)
            client.close()

    def _iteration(self, client: redis.Redis) -> None:
        try:
            if not self.ready.is_set():
                self._create_group(client)
                self.ready.set()
            self._beat(client)
            self._schedule_replay()
            self._read_batch(client)
            self._on_tick()
        except BrokerLookupError as exc:
            self._on_error(exc)
        except Exception:  # a bug: counted and logged, never a silent dead thread
            self._replaying = True
            self.guard()

    def _create_group(self, client: redis.Redis) -> None:
        if not self._recreate:
            ensure_group(client, self._keys.requests, self._group)
            return
        stream = self._keys.requests
        with translate_redis_errors(f"re-creating consumer group {self._group} on {stream}"):
            try:
                client.xgroup_create(stream, self._group, id="0", mkstream=True)
                logger.info("rank %d: re-created group %s at 0", self._rank, self._group)
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise
        self._recreate = False

    def _schedule_replay(self) -> None:
        now = time.monotonic()
        if now >= self._next_replay:
            self._next_replay = now + REPLAY_EVERY_S
            self._replaying = True

    def _on_error(self, exc: BrokerLookupError) -> None:
        self._replaying = True  # whatever was delivered before the error is read again
        if is_nogroup(exc):
            # Flushed, restarted without persistence, or the stream was evicted.
            self.stats["nogroup"] += 1
            logger.warning(
                "rank %d: consumer group %s missing on %s; re-creating it",
                self._rank,
                self._group,
                self._keys.requests,
            )
            self.ready.clear()
            self._recreate = True
            return
        self.stats["redis_errors"] += 1
        self.ready.clear()
        count = self.stats["redis_errors"]
        if count == 1 or count % 50 == 0:
            logger.warning("rank %d: Redis error #%d: %s (retrying)", self._rank, count, exc)
        self._stop.wait(0.2)

    def _read_batch(self, client: redis.Redis) -> None:
        start = "0" if self._replaying else ">"
        block = None if self._replaying else self._config.block_ms
        with translate_redis_errors(f"reading {self._keys.requests} as {self._group}"):
            resp: Any = client.xreadgroup(
                self._group, self._name, {self._keys.requests: start}, count=100, block=block
            )
        entries = resp[0][1] if resp else []
        if self._replaying:
            if not entries:
                self._replaying = False
                return
            self.stats["replayed"] += len(entries)
        decoded = [(self._decode(client, eid, fields), eid) for eid, fields in entries]
        # Aborts first: a lookup and its abort read in one batch never reach the engine.
        for msg, eid in sorted(
            ((m, e) for m, e in decoded if m is not None), key=lambda p: not isinstance(p[0], Abort)
        ):
            remaining = math.inf if isinstance(msg, Abort) else self.clock.remaining_ms(msg, eid)
            self._handle(msg, remaining)
        if entries:
            self._flush(client, [e for e, _ in entries])

    def _xack(self, client: redis.Redis, ids: list[bytes]) -> None:
        with translate_redis_errors("acking entries"):
            client.xack(self._keys.requests, self._group, *ids)

    def _decode(
        self, client: redis.Redis, entry_id: bytes, fields: dict[bytes, bytes] | None
    ) -> LookupRequest | Abort | None:
        self.stats["entries"] += 1
        try:
            msg = decode_request(fields)
        except MalformedMessage as exc:
            self.dead_letter(client, entry_id, exc.reason, fields)
            return None
        reason = entry_problem(msg, self._config, self._world_size)
        if reason is not None:
            self.dead_letter(client, entry_id, reason, fields)
            return None
        return msg

    def dead_letter(
        self, client: redis.Redis, entry_id: bytes | str, reason: str, raw: object
    ) -> None:
        """Park an entry that can't be served in ``bl:{E}:dead`` with the reason; count it."""
        self.stats["dead_letters"] += 1
        logger.warning("rank %d: dead-lettering entry %r: %s", self._rank, entry_id, reason)
        with translate_redis_errors("dead-lettering"):
            client.xadd(
                self._keys.dead,
                {"rank": self._rank, "entry": entry_id, "reason": reason, "raw": repr(raw)[:1024]},
                maxlen=self._config.dead_maxlen,
                approximate=True,
            )

    def _beat(self, client: redis.Redis) -> None:
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._next_beat = now + self._config.heartbeat_interval_ms / 1000
        if self.clock.due(now):
            self.clock.sample(client)
        info = {
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_ms": self._started_ms,
            "ts_ms": int(time.time() * 1000),
            **self._beat_info(),
        }
        with translate_redis_errors("writing the heartbeat"):
            client.set(
                self._keys.heartbeat(self._rank), json.dumps(info), px=self._config.heartbeat_ttl_ms
            )
        self.last_beat = time.time()
        if now >= self._next_info:
            self._next_info = now + 5.0
            self._group_info(client)

    def _group_info(self, client: redis.Redis) -> None:
        with translate_redis_errors("reading group info"):
            groups: Any = client.xinfo_groups(self._keys.requests)
        for g in groups:
            name = g.get("name")
            if name in (self._group, self._group.encode()):
                self.stats["pending"] = int(g.get("pending") or 0)
                self.stats["lag"] = int(g.get("lag") or 0)

    def _clear_heartbeat(self, client: redis.Redis) -> None:
        # Clients see this rank dead at once instead of after the heartbeat TTL.
        try:
            with translate_redis_errors("deleting the heartbeat"):
                client.delete(self._keys.heartbeat(self._rank))
        except BrokerLookupError as exc:
            logger.warning("rank %d: heartbeat not deleted at shutdown: %s", self._rank, exc)


def is_nogroup(exc: BaseException) -> bool:
    """True if ``exc`` (or its cause) is Redis's NOGROUP error."""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    return isinstance(cause, ResponseError) and str(cause).startswith("NOGROUP")
