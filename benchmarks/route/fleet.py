"""The engines of ``python -m benchmarks.route``: reference engines with finite memory
behind in-process ranks, each with its scheduler-side client, and the KV events they emit.

An engine serves a routed request as vLLM + LMCache would: its own lookup (through its
rank, the path a scheduler's lookup takes, which also hands a reservation over), then it
stores every chunk of the prompt (the prefill), evicting the least recently used chunks
beyond its capacity. What that store added and evicted are the engine's KV events
(vLLM's ``BlockStored`` / ``BlockRemoved``; a restart is ``AllBlocksCleared``), which the
event-fed index of :mod:`benchmarks.route.policies` applies after its lag.
"""

from __future__ import annotations

import time

from benchmarks.bench.measure import BenchError
from benchmarks.route.trace import Request
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

__all__ = ["Event", "Fleet"]

#: (engine index, "stored" | "evicted" | "cleared", chunk hash or 0)
Event = tuple[int, str, int]

_READY_S = 30.0
_ANSWER_S = 30.0


class _Slot:
    """One engine: its store, its rank, and the chunks it is known to hold."""

    def __init__(self, engine_id: str, capacity: int, config: LookupConfig) -> None:
        self.engine = ReferenceEngine(memory_capacity_chunks=capacity, max_workers=2)
        meta = LookupMetadata(engine_id=engine_id, world_size=1, worker_id=0)
        self.rank = RedisAsyncLookupServer(self.engine, meta, config)
        self.held: set[int] = set()
        deadline = time.monotonic() + _READY_S
        while not (
            self.rank.ready
            and self.rank.stats().last_heartbeat
            and self.rank.prober.reading.is_set()
        ):
            if time.monotonic() > deadline:
                self.close()
                raise BenchError(f"rank of {engine_id} not ready in {_READY_S:.0f}s")
            time.sleep(0.01)

    def close(self) -> None:
        self.rank.close()
        self.engine.close()


class Fleet:
    """``n`` engines ``<prefix>-<i>`` of ``capacity`` chunks each on ``config``'s server."""

    def __init__(self, config: LookupConfig, prefix: str, n: int, capacity: int) -> None:
        self.config = config
        self.capacity = capacity
        self.ids = [f"{prefix}-{i}" for i in range(n)]
        #: Restarts so far per engine: a request routed before one lost its cache with it.
        self.generation = [0] * n
        self._slots: list[_Slot] = []
        self._clients: list[RedisAsyncLookupClient] = []
        self._past: dict[str, int] = {}  # the counts of engines restarted since
        try:
            for eid in self.ids:
                self._slots.append(_Slot(eid, capacity, config))
            for eid in self.ids:
                meta = LookupMetadata(engine_id=eid, world_size=1)
                self._clients.append(RedisAsyncLookupClient(config, meta))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every client, then every rank (a client outliving its rank would say so)."""
        for client in self._clients:
            client.close()
        self._clients.clear()
        for slot in self._slots:
            slot.close()
        self._slots.clear()

    def restart(self, i: int) -> list[Event]:
        """Engine ``i`` restarts (its cache and reservations gone); its event."""
        self._add(self._past, self._slots[i])
        self._slots[i].close()
        self._slots[i] = _Slot(self.ids[i], self.capacity, self.config)
        self.generation[i] += 1
        return [(i, "cleared", 0)]

    def lookup(self, i: int, request: Request, lookup_id: str) -> int:
        """Engine ``i``'s own lookup of ``request`` (as its scheduler asks): the tokens found."""
        client = self._clients[i]
        found = client.lookup(request.tokens, lookup_id)
        deadline = time.monotonic() + _ANSWER_S
        while found is None or found < 0:
            if time.monotonic() > deadline:
                raise BenchError(f"lookup {lookup_id} unanswered after {_ANSWER_S:.0f}s")
            time.sleep(0.0005)
            found = client.lookup_cache(lookup_id)
        client.clear_lookup_status(lookup_id)
        return found

    def serve(self, i: int, request: Request) -> list[Event]:
        """Engine ``i`` prefills ``request``: stores its chunks; the events that emits."""
        slot = self._slots[i]
        slot.engine.store(request.hashes, request.offsets)
        events: list[Event] = []
        for h in request.hashes:
            if h not in slot.held and slot.engine.get_chunk(h) is not None:
                slot.held.add(h)
                events.append((i, "stored", h))
        for h in [h for h in slot.held if slot.engine.get_chunk(h) is None]:
            slot.held.discard(h)
            events.append((i, "evicted", h))
        return events

    def stats(self) -> dict[str, int]:
        """Evictions and reservation counts summed over every engine, restarted or not."""
        out = dict(self._past)
        for slot in self._slots:
            self._add(out, slot)
        return out

    @staticmethod
    def _add(out: dict[str, int], slot: _Slot) -> None:
        counts = {"evictions": slot.engine.stats()["memory_evictions"]}
        counts.update({f"reservations_{k}": v for k, v in slot.rank.reservations.counts.items()})
        for k, v in counts.items():
            out[k] = out.get(k, 0) + v
