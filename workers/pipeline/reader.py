"""The rank's consumer group on the request stream: what it reads next, and what it read.

The group is created idempotently; then the rank re-reads its own pending entries with
id ``0`` (a restarted rank finishes what it had been given), then reads new entries
with ``>`` and a short BLOCK on its own connection. The reader builds each read
(:meth:`Reader.read_command`: the loop may send it with the last batch's acks) and
decodes its raw reply (:meth:`Reader.parse`) into a :class:`Batch`: the entries to
serve, the ids to ack once served, and the XADDs dead-lettering the entries that
can't be served (sent with those acks): :func:`entry_problem` says which, by the wire's
rules and the rank's limits.

Nothing read stays pending: after any error, and once a second
anyway, the reader re-reads its own pending entries, so a delivery whose reply was
lost between XREADGROUP and XACK (a reset, a held connection, redis-py retrying the
read) is served then; dedupe by (id, gen) makes a re-served entry harmless. A group
re-created after NOGROUP starts at ``0``, so entries written meanwhile are read.
The timed replay never starves the new entries: it comes only after a read of new
entries, and its second is counted from the end of the last replay, so a loop whose
turns take longer than that second still alternates, never replaying only.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import (
    BrokerLookupError,
    MalformedMessage,
    NoGroup,
    translate_redis_errors,
)
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import (
    BATCH_TYPE,
    Abort,
    Keep,
    LookupRequest,
    Request,
    decode_entry,
    request_configs_problem,
    validate_request,
    wire_id_problem,
)
from broker_lookup.protocol.stats import ConsumerStats
from broker_lookup.transport.link import Link, pairs, stream_entries
from workers.pipeline.clock import ServerClock

__all__ = ["Batch", "Reader"]

logger = logging.getLogger(__name__)

_COUNTERS = (
    "entries",
    "dead_letters",
    "trimmed",
    "redis_errors",
    "nogroup",
    "replayed",
    "pending",
    "lag",
)
#: How often the reader re-reads its own pending entries when nothing went wrong.
REPLAY_EVERY_S = 1.0
#: Most entries one read returns.
BATCH_SIZE = 100


@dataclass(frozen=True, slots=True)
class Batch:
    """The entries of one read: what to serve, in order, and the ids to ack once served."""

    #: Each message with the ms it stays worth answering (inf for aborts and keeps);
    #: aborts first, so a lookup and its abort read in one batch never reach the engine
    #: (a keep stays after its lookup: it only means something once that runs).
    messages: list[tuple[Request, float]]
    ack_ids: list[bytes]  #: every entry read, dead-lettered ones included
    #: the XADDs dead-lettering the entries that can't be served, each followed by the
    #: dead-letter stream's PEXPIRE (it lives as long as the engine)
    dead: list[Command]


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
        self._made = False  # the group was made (or found) once: a later one starts at 0
        self._replaying = True
        self._sent_replaying = True  # what the read in flight asked for
        self._next_replay = 0.0
        self._read_new = False  # a read of new entries was sent since the last replay
        #: Counters for ``stats().consumer``, plus the group's pending and lag.
        self.stats: dict[str, int] = dict.fromkeys(_COUNTERS, 0)

    def consumer_stats(self) -> ConsumerStats:
        """A copy of :attr:`stats`, for the rank's ``stats()``."""
        s = self.stats
        return ConsumerStats(
            entries=s["entries"],
            replayed=s["replayed"],
            dead_letters=s["dead_letters"],
            trimmed=s["trimmed"],
            redis_errors=s["redis_errors"],
            nogroup=s["nogroup"],
            pending=s["pending"],
            lag=s["lag"],
        )

    # -- the group ------------------------------------------------------------------

    def ensure_group(self, link: Link) -> None:
        """Create the group (idempotent: BUSYGROUP only): at ``$`` the first time, at ``0``
        once this rank has made it before (it went with its stream, whatever error the rank
        saw first), so nothing written meanwhile is skipped.

        MKSTREAM may create the stream, so its TTL is set in the same round trip.
        """
        again = self._recreate or self._made
        start = "0" if again else "$"
        stream = self._keys.requests
        create = ("XGROUP", "CREATE", stream, self._group, start, "MKSTREAM")
        with translate_redis_errors(f"creating consumer group {self._group} on {stream}"):
            reply, ttl = link.call([create, ("PEXPIRE", stream, self._config.engine_ttl_ms)])
            if isinstance(reply, ResponseError) and not str(reply).startswith("BUSYGROUP"):
                raise reply
            if isinstance(ttl, ResponseError):
                raise ttl
        if again and not isinstance(reply, ResponseError):
            logger.info("rank %d: re-created group %s at 0", self._rank, self._group)
        self._recreate = False
        self._made = True

    def group_info(self, link: Link) -> None:
        """Refresh the group's ``pending`` and ``lag`` in :attr:`stats`."""
        with translate_redis_errors("reading group info"):
            [groups] = link.call([("XINFO", "GROUPS", self._keys.requests)])
            if isinstance(groups, ResponseError):
                if "no such key" in str(groups).lower():
                    # The stream expired or was flushed: its group went with it. NOGROUP, so
                    # the group is made again at 0 and nothing written meanwhile is skipped.
                    raise NoGroup(f"consumer group missing while reading group info: {groups}")
                raise groups
        for raw in groups:
            g = {_text(k): v for k, v in pairs(raw).items()}
            if _text(g.get("name")) == self._group:
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

    def read_command(self) -> Command:
        """The next XREADGROUP: the own pending entries when replaying, else new ones (BLOCK).

        Its reply goes to :meth:`parse`, before the next command is asked for.
        """
        if not self._replaying and self._read_new and time.monotonic() >= self._next_replay:
            self._replaying = True
        self._sent_replaying = self._replaying
        self._read_new = self._read_new or not self._replaying
        head = ("XREADGROUP", "GROUP", self._group, self._name, "COUNT", BATCH_SIZE)
        if self._replaying:
            return (*head, "STREAMS", self._keys.requests, "0")
        return (*head, "BLOCK", self._config.block_ms, "STREAMS", self._keys.requests, ">")

    def parse(self, reply: Any) -> Batch:
        """The batch of one XREADGROUP reply (raw or redis-py's shape); dead letters named."""
        entries = stream_entries(reply)
        if self._sent_replaying:
            if not entries:
                self._replaying = False  # nothing of ours is pending: read new entries
                self._read_new = False
                self._next_replay = time.monotonic() + REPLAY_EVERY_S
            self.stats["replayed"] += len(entries)
        self.stats["entries"] += len(entries)
        messages: list[tuple[Request, float]] = []
        dead: list[Command] = []
        remaining_ms = self._clock.remaining_ms
        aborts = False
        for entry_id, fields in entries:
            for msg in self._decode(dead, entry_id, fields):
                if type(msg) is LookupRequest:  # the common case first (never a subclass)
                    messages.append((msg, remaining_ms(msg, entry_id)))
                else:
                    messages.append((msg, math.inf))
                    aborts = aborts or type(msg) is Abort
        if aborts and len(messages) > 1:
            messages.sort(key=lambda pair: not isinstance(pair[0], Abort))  # stable: aborts first
        return Batch(messages, [entry_id for entry_id, _ in entries], dead)

    def _decode(
        self, dead: list[Command], entry_id: bytes, fields: dict[bytes, bytes] | None
    ) -> list[Request]:
        """The requests of one entry (a batch entry's parts, in order) that can be served;
        each one that can't is dead-lettered alone, so a bad part costs only itself.

        An own pending entry the stream no longer holds (a real server gives it no fields,
        fakeredis empty ones: an entry always has one) was trimmed before the rank read it
        again, after a crash: its lookups' deadlines passed long ago, so it is acked and
        counted as ``trimmed``, not dead-lettered (nothing to park, and no producer erred).
        """
        if not fields:
            self.stats["trimmed"] += 1
            # Debug only: a restart can find hundreds; the counter is what operators read.
            logger.debug(
                "rank %d: pending entry %r was trimmed (expired unread): acked",
                self._rank,
                entry_id,
            )
            return []
        parts = decode_entry(fields)
        if len(parts) == 1 and type(parts[0]) is LookupRequest:  # the common case, checked
            reason = entry_problem(parts[0], self._config, self._world_size)
            if reason is None:
                return [parts[0]]
        batch = fields is not None and fields.get(b"type") == BATCH_TYPE
        served: list[Request] = []
        for i, part in enumerate(parts):
            if isinstance(part, MalformedMessage):
                reason, raw = part.reason, part.payload
            else:
                problem = entry_problem(part, self._config, self._world_size)
                if problem is None:
                    served.append(part)
                    continue
                reason, raw = problem, part
            # A batch's part is parked alone, named; a plain entry (or a batch entry that
            # can't be split: no usable count) whole, as it came.
            if batch and raw is not fields:
                dead += self._dead_letter(entry_id, f"part {i} of {len(parts)}: {reason}", raw)
            else:
                dead += self._dead_letter(entry_id, reason, fields)
        return served

    def _dead_letter(self, entry_id: bytes, reason: str, raw: object) -> list[Command]:
        """The XADD parking an entry that can't be served in ``bl:{E}:dead``, and the
        stream's PEXPIRE (it may have just been created); counted."""
        self.stats["dead_letters"] += 1
        logger.warning("rank %d: dead-lettering entry %r: %s", self._rank, entry_id, reason)
        fields = ("rank", self._rank, "entry", entry_id, "reason", reason, "raw", repr(raw)[:1024])
        cap = ("MAXLEN", "~", self._config.dead_maxlen)
        dead = self._keys.dead
        return [("XADD", dead, *cap, "*", *fields), ("PEXPIRE", dead, self._config.engine_ttl_ms)]


def entry_problem(msg: Request, config: LookupConfig, world_size: int | None) -> str | None:
    """Why ``msg`` can't be served (None if it can), by the producer's limits too.

    Any non-empty UTF-8 ``str`` is a legal lookup id (keys hold a digest of ids they
    should not hold verbatim), so ids with spaces or non-ASCII characters are served.
    """
    if isinstance(msg, Abort):
        return wire_id_problem(msg.lookup_id, config.max_lookup_id_length)
    if isinstance(msg, Keep):
        if msg.tokens <= 0:
            return f"keep tokens={msg.tokens} must be > 0 (a partial answer of 0 is an abort)"
        return wire_id_problem(msg.lookup_id, config.max_lookup_id_length)
    reason = validate_request(
        msg, max_chunks=config.max_chunks_per_request, max_id_length=config.max_lookup_id_length
    )
    if reason is not None:
        return reason
    if world_size is not None and max(msg.expected) >= world_size:
        return f"expected ranks {msg.expected[:8]} go beyond world_size={world_size}"
    configs = request_configs_problem(msg.request_configs, config.max_request_configs_bytes)
    return None if configs is None else configs.reason


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
