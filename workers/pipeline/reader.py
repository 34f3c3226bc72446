"""The rank's consumer group on the request stream: what it reads next, and what it read.

The group is created idempotently; then the rank re-reads its own pending entries with
id ``0`` (a restarted rank finishes what it had been given), then reads new entries
with ``>`` and a short BLOCK on its own connection. An entry that can't be served is
dead-lettered as it is read; the others come back as a :class:`Batch` to serve, and
every id of the batch is acked once it was served.

Nothing read stays pending (DESIGN rule 10): after any error, and once a second
anyway, the reader re-reads its own pending entries, so a delivery whose reply was
lost between XREADGROUP and XACK (a reset, a held connection, redis-py retrying the
read) is served then; dedupe by (id, gen) makes a re-served entry harmless. A group
re-created after NOGROUP starts at ``0``, so entries written meanwhile are read.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import redis
from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    BrokerLookupError,
    MalformedMessage,
    NoGroup,
    translate_redis_errors,
)
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, LookupRequest, decode_request
from broker_lookup.transport.connection import ensure_group
from workers.pipeline.clock import ServerClock
from workers.pipeline.entries import entry_problem

__all__ = ["Batch", "Reader"]

logger = logging.getLogger(__name__)

_COUNTERS = ("entries", "dead_letters", "redis_errors", "nogroup", "replayed", "pending", "lag")
#: How often the reader re-reads its own pending entries when nothing went wrong.
REPLAY_EVERY_S = 1.0
#: Most entries one read returns.
BATCH_SIZE = 100


@dataclass(frozen=True, slots=True)
class Batch:
    """The entries of one read: what to serve, in order, and the ids to ack once served."""

    #: Each message with the ms it stays worth answering (inf for aborts); aborts first,
    #: so a lookup and its abort read in one batch never reach the engine.
    messages: list[tuple[LookupRequest | Abort, float]]
    ack_ids: list[bytes]  #: every entry read, dead-lettered ones included


class Reader:
    """Reads one rank's deliveries from its consumer group; owns no thread or connection."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        clock: ServerClock,
        world_size: int | None = None,
    ) -> None:
        self._config = config
        self._keys = keys
        self._rank = rank
        self._clock = clock
        self._world_size = world_size
        self._group = keys.group(rank)
        self._name = keys.consumer(rank)
        self._recreate = False  # after NOGROUP: the new group starts at 0
        self._replaying = True
        self._next_replay = 0.0
        #: Counters for ``stats()["consumer"]``, plus the group's pending and lag.
        self.stats: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    # -- the group ------------------------------------------------------------------

    def ensure_group(self, client: redis.Redis) -> None:
        """Create the group (idempotent: BUSYGROUP only); at ``0`` after NOGROUP."""
        if self._recreate:
            self._create_at_zero(client)
        else:
            ensure_group(client, self._keys.requests, self._group)

    def _create_at_zero(self, client: redis.Redis) -> None:
        stream = self._keys.requests
        with translate_redis_errors(f"re-creating consumer group {self._group} on {stream}"):
            try:
                client.xgroup_create(stream, self._group, id="0", mkstream=True)
                logger.info("rank %d: re-created group %s at 0", self._rank, self._group)
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):
                    raise
        self._recreate = False

    def group_info(self, client: redis.Redis) -> None:
        """Refresh the group's ``pending`` and ``lag`` in :attr:`stats`."""
        with translate_redis_errors("reading group info"):
            groups: Any = client.xinfo_groups(self._keys.requests)
        for g in groups:
            name = g.get("name")
            if name in (self._group, self._group.encode()):
                self.stats["pending"] = int(g.get("pending") or 0)
                self.stats["lag"] = int(g.get("lag") or 0)

    # -- after errors ---------------------------------------------------------------

    def replay(self) -> None:
        """Read the own pending entries next: whatever was delivered is read again."""
        self._replaying = True

    def on_nogroup(self, exc: NoGroup) -> None:
        """The group is gone (flushed, restarted without persistence, stream evicted)."""
        self.replay()
        self.stats["nogroup"] += 1
        logger.warning(
            "rank %d: consumer group %s missing on %s; re-creating it (%s)",
            self._rank,
            self._group,
            self._keys.requests,
            exc,
        )
        self._recreate = True

    def on_error(self, exc: BrokerLookupError) -> None:
        """Any other Redis failure: count it, log the first and every 50th, replay."""
        self.replay()
        self.stats["redis_errors"] += 1
        count = self.stats["redis_errors"]
        if count == 1 or count % 50 == 0:
            logger.warning("rank %d: Redis error #%d: %s (retrying)", self._rank, count, exc)

    # -- reading --------------------------------------------------------------------

    def read(self, client: redis.Redis) -> Batch:
        """One XREADGROUP: the own pending entries when replaying, else new ones (BLOCK)."""
        now = time.monotonic()
        if now >= self._next_replay:
            self._next_replay = now + REPLAY_EVERY_S
            self._replaying = True
        replaying = self._replaying
        with translate_redis_errors(f"reading {self._keys.requests} as {self._group}"):
            resp: Any = client.xreadgroup(
                self._group,
                self._name,
                {self._keys.requests: "0" if replaying else ">"},
                count=BATCH_SIZE,
                block=None if replaying else self._config.block_ms,
            )
        entries: list[tuple[bytes, dict[bytes, bytes] | None]] = resp[0][1] if resp else []
        if replaying:
            if not entries:
                self._replaying = False  # nothing of ours is pending: read new entries
            self.stats["replayed"] += len(entries)
        messages: list[tuple[LookupRequest | Abort, float]] = []
        for entry_id, fields in entries:
            msg = self._decode(client, entry_id, fields)
            if isinstance(msg, Abort):
                messages.append((msg, math.inf))
            elif msg is not None:
                messages.append((msg, self._clock.remaining_ms(msg, entry_id)))
        messages.sort(key=lambda pair: not isinstance(pair[0], Abort))  # stable: aborts first
        return Batch(messages, [entry_id for entry_id, _ in entries])

    def _decode(
        self, client: redis.Redis, entry_id: bytes, fields: dict[bytes, bytes] | None
    ) -> LookupRequest | Abort | None:
        self.stats["entries"] += 1
        try:
            msg = decode_request(fields)
        except MalformedMessage as exc:
            self._dead_letter(client, entry_id, exc.reason, fields)
            return None
        reason = entry_problem(msg, self._config, self._world_size)
        if reason is not None:
            self._dead_letter(client, entry_id, reason, fields)
            return None
        return msg

    def _dead_letter(self, client: redis.Redis, entry_id: bytes, reason: str, raw: object) -> None:
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
