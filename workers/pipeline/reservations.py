"""A rank's reservations: prefixes pinned for a request a router is sending this way.

The fleet query's ``reserve_ms`` (``protocol.probe.Reserve``) asks the ranks of the engine
a router chose to keep the prefix they hold until the engine's own lookup of the prompt
arrives, so the routed request finds what it was promised. One owner here holds every
reservation of the rank, apart from the lookups' lifecycle (a reservation is no lookup:
it has no generation, no report and no scheduler waiting), and releases each exactly
once, whichever comes first:

* the engine's own lookup of the prompt (its chunk hashes begin with the reserved ones)
  reported: by then the lookup holds its own pins, so the prefix is never unpinned in
  between (the dispatcher tells :meth:`arrived` when the lookup starts, the server tells
  :meth:`reported` when it reports);
* ``reserve_ms`` passed (the probe thread calls :meth:`expire` on every wake, at least
  every ``block_ms``);
* the rank stops (:meth:`release_all`), and, as for any pin, the engine's pin timeout.

At most ``capacity`` reservations are held; beyond that a reserve is refused (answered 0)
and counted, so a router cannot pin a rank's memory away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker_lookup.protocol.probe import Reserve

__all__ = ["MAX_RESERVE_MS", "Reservations"]

logger = logging.getLogger(__name__)

#: The longest a reservation is held, whatever a router asks.
MAX_RESERVE_MS = 60_000
#: Reservations one rank holds at most.
CAPACITY = 1024
#: Prefix of a reservation's owner id in the engine (no lookup id of vLLM's starts so).
OWNER_PREFIX = "bl-reserve:"

Pin = Callable[[str, list[int], list[int], dict[str, Any] | None], int]


@dataclass
class _Held:
    owner: str
    until: float
    last_hash: int  #: the last reserved chunk's hash: a lookup of the prompt holds it
    index: int  #: ... at this chunk index
    tokens: int  #: the prefix pinned
    lookups: set[str] = field(default_factory=set)  #: lookups of the prompt under way


class Reservations:
    """Every reservation of one rank (see the module docstring)."""

    def __init__(
        self,
        engine: object,
        rank: int,
        capacity: int = CAPACITY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine, self._rank, self._capacity, self._clock = engine, rank, capacity, clock
        self._pin, self._unpin = _engine_calls(engine)
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self._by_hash: dict[int, set[str]] = {}  #: last reserved hash -> owners
        self._by_lookup: dict[str, set[str]] = {}  #: lookup id -> owners it will release
        #: reserved, refused_full, unsupported, engine_errors, and released_<why>.
        self.counts: dict[str, int] = {}

    @property
    def supported(self) -> bool:
        """Whether the engine can reserve at all."""
        return self._pin is not None

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, req: Reserve) -> int:
        """Pin the prefix ``req`` asks for; return its tokens (0: none held, refused, or
        the engine cannot)."""
        if self._pin is None:
            self._count("unsupported")
            return 0
        owner = OWNER_PREFIX + req.query_id
        with self._lock:
            held = self._held.get(owner)
            if held is not None:  # a re-read entry (after a reconnect): the same answer
                return held.tokens
            if len(self._held) >= self._capacity:
                self._count_locked("refused_full")
                return 0
        try:
            tokens = self._pin(owner, req.hashes, req.offsets, req.request_configs)
        except Exception:
            self._count("engine_errors")
            logger.exception("rank %d: the engine failed a reservation", self._rank)
            self._release_owner(owner, None)
            return 0
        chunks = _chunks_within(req.offsets, tokens)
        if chunks == 0:
            self._release_owner(owner, None)
            return 0
        until = self._clock() + min(req.reserve_ms, MAX_RESERVE_MS) / 1000
        reserved = sum(req.offsets[:chunks])
        held = _Held(owner, until, req.hashes[chunks - 1], chunks - 1, reserved)
        with self._lock:
            self._held[owner] = held
            self._by_hash.setdefault(held.last_hash, set()).add(owner)
            self._count_locked("reserved")
        return reserved

    def arrived(self, lookup_id: str, hashes: list[int]) -> None:
        """The engine starts ``lookup_id``: a reservation of its prompt is released once
        it reports. Called for every lookup: a dict probe per chunk while any is held."""
        if not self._by_hash:
            return
        with self._lock:
            for index, chunk_hash in enumerate(hashes):
                for owner in self._by_hash.get(chunk_hash, ()):
                    held = self._held[owner]
                    if held.index == index:
                        held.lookups.add(lookup_id)
                        self._by_lookup.setdefault(lookup_id, set()).add(owner)

    def reported(self, lookup_id: str) -> None:
        """``lookup_id`` reported: the reservations of its prompt are released."""
        if not self._by_lookup:
            return
        with self._lock:
            owners = self._by_lookup.pop(lookup_id, set())
            gone = [self._forget_locked(o) for o in owners]
        for held in gone:
            if held is not None:
                self._release_owner(held.owner, "released_lookup")

    def expire(self) -> int:
        """Release every reservation past its time; returns how many."""
        now = self._clock()
        with self._lock:
            due = [o for o, h in self._held.items() if h.until <= now]
            gone = [self._forget_locked(o) for o in due]
        for held in gone:
            if held is not None:
                self._release_owner(held.owner, "released_ttl")
        return len(due)

    def release_all(self) -> None:
        """Release every reservation (the rank stops)."""
        with self._lock:
            gone = [self._forget_locked(o) for o in list(self._held)]
        for held in gone:
            if held is not None:
                self._release_owner(held.owner, "released_shutdown")

    def _forget_locked(self, owner: str) -> _Held | None:
        held = self._held.pop(owner, None)
        if held is None:
            return None
        owners = self._by_hash.get(held.last_hash)
        if owners is not None:
            owners.discard(owner)
            if not owners:
                del self._by_hash[held.last_hash]
        for lookup_id in held.lookups:
            waiting = self._by_lookup.get(lookup_id)
            if waiting is not None:
                waiting.discard(owner)
                if not waiting:
                    del self._by_lookup[lookup_id]
        return held

    def _release_owner(self, owner: str, why: str | None) -> None:
        try:
            if self._unpin is not None:
                self._unpin(owner)
        except Exception:
            self._count("engine_errors")
            logger.exception("rank %d: the engine failed to release a reservation", self._rank)
        if why is not None:
            self._count(why)

    def _count(self, what: str) -> None:
        with self._lock:
            self._count_locked(what)

    def _count_locked(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def _chunks_within(offsets: list[int], tokens: int) -> int:
    """How many leading chunks ``tokens`` covers whole."""
    total = 0
    for i, size in enumerate(offsets):
        if total + size > tokens:
            return i
        total += size
    return len(offsets)


def _engine_calls(engine: object) -> tuple[Pin | None, Callable[[str], None] | None]:
    """(pin, unpin) of ``engine``: its own ``reserve_prefix`` and ``cleanup_memory_objs``,
    else LMCache's pinning ``lookup`` and ``lookup_unpin`` (one id: LMCache 0.5.6's);
    (None, None) if neither."""
    own = getattr(engine, "reserve_prefix", None)
    cleanup = getattr(engine, "cleanup_memory_objs", None)
    if callable(own) and callable(cleanup):
        return (lambda o, h, f, c: int(own(o, h, f, request_configs=c))), cleanup
    lookup, unpin = getattr(engine, "lookup", None), getattr(engine, "lookup_unpin", None)
    if callable(lookup) and callable(unpin):
        return (
            lambda o, h, f, c: int(
                lookup(hashes=h, offsets=f, lookup_id=o, pin=True, request_configs=c)
            ),
            lambda o: unpin(o),
        )
    return None, None
