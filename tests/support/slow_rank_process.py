"""One rank as a process of its own around a synchronous, slow engine, for liveness tests.

``python slow_rank_process.py ENGINE_ID SYNC_MS STALL_AT STALL_MS`` (config from the
``BROKER_LOOKUP_*`` environment) serves rank 0 of a one-rank engine with an engine that
answers inside ``async_lookup_and_prefetch``, on the rank's read loop, as LMCache does
without async loading: each lookup costs ``SYNC_MS``, and the ``STALL_AT``-th (counting
from 1; 0: none) ``STALL_MS`` more. Every lookup is a full hit. It prints ``ready`` once
it reads its group, and on SIGTERM stops in order and prints one JSON line: the rank's
counters, its lease claims, and the ids the engine released before the stop.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.stub_engine import StubEngine
from broker_lookup.threads import set_from_signal
from workers.server import RedisAsyncLookupServer


class SyncEngine(StubEngine):
    """Answers each lookup synchronously after ``sync_s`` (one call ``stall_s`` more)."""

    def __init__(self, sync_s: float, stall_at: int, stall_s: float) -> None:
        super().__init__("manual")
        self._sync_s, self._stall_at, self._stall_s = sync_s, stall_at, stall_s
        self.calls = 0
        self.stopping = False
        self.released_early: list[str] = []

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        super().async_lookup_and_prefetch(lookup_id, hashes, offsets, pin, request_configs)
        self.calls += 1
        stall = self._stall_s if self.calls == self._stall_at else 0.0
        time.sleep(self._sync_s + stall)  # the engine's own work, on the caller's thread
        self.report(lookup_id, sum(offsets))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        super().cleanup_memory_objs(lookup_id)
        if not self.stopping:
            self.released_early.append(lookup_id)


def main(argv: list[str]) -> None:
    engine_id, sync_ms, stall_at, stall_ms = argv
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop))
    engine = SyncEngine(float(sync_ms) / 1000, int(stall_at), float(stall_ms) / 1000)
    meta = LookupMetadata(engine_id=engine_id, world_size=1, worker_id=0)
    server = RedisAsyncLookupServer(engine, meta, LookupConfig.load())
    while not server.ready and not stop.wait(0.02):
        pass
    print("ready", flush=True)
    stop.wait()
    engine.stopping = True
    server.close()
    stats = server.stats()
    out = {
        "counts": stats.counts,
        "claims": stats.ownership.claims,
        "lost": stats.ownership.lost,
        "released_early": engine.released_early,
        "calls": engine.calls,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
