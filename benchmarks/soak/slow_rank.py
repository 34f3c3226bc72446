"""One rank as a process of its own around a synchronous, slow engine: the liveness soak's
ranks and the liveness process tests'.

``python -m benchmarks.soak.slow_rank --engine-id E [--world-size N --rank R]`` (config
from the ``BROKER_LOOKUP_*`` environment) serves one rank with :class:`SyncEngine`, which
answers inside ``async_lookup_and_prefetch``, on the rank's read loop, as LMCache does
without async loading: each lookup costs ``--sync-ms``; some calls stall ``--stall-ms``
more (the ``--stall-at``-th, counting from 1, and one every ``--stall-every MIN-MAX``
seconds). Every lookup is a full hit. It prints ``ready`` once it reads its group, and on
SIGTERM stops in order and prints one JSON line: the rank's counters, its lease claims and
losses, the engine's calls and stalls, and the ids it released early (before the stop, and
before half the pin TTL had passed since their report; a rank releases a reported
lookup's pins when its pin TTL ends, as nobody retrieves them here).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from typing import Any

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.stub_engine import StubEngine
from broker_lookup.threads import set_from_signal
from workers.server import RedisAsyncLookupServer

__all__ = ["SyncEngine", "main"]


class SyncEngine(StubEngine):
    """Answers each lookup (a full hit) synchronously after ``sync_s``; the ``stall_at``-th
    call (0: none) and the first call after each ``stall_every_s`` interval (random in
    the range; None: never) take ``stall_s`` more.

    ``pin_ttl_s``: the rank's pin TTL (``worker_pin_ttl_ms``); a release half of it or
    more after the report is the TTL's, not early. None: every release is early.

    Attributes:
        calls: Lookups answered.
        stalls: Calls that stalled.
        released_early: Ids whose pins were released early, before the stop: a hit
            answered for one of them is a broken promise.
        released_at_ttl: Releases when the pin TTL ended.
    """

    def __init__(
        self,
        sync_s: float,
        stall_s: float = 0.0,
        stall_at: int = 0,
        stall_every_s: tuple[float, float] | None = None,
        seed: int = 0,
        pin_ttl_s: float | None = None,
    ) -> None:
        super().__init__("manual", record=False)
        self._sync_s, self._stall_s, self._stall_at = sync_s, stall_s, stall_at
        self._every, self._rng = stall_every_s, random.Random(seed)
        self._next_stall = self._after(time.monotonic())
        self.calls = 0
        self.stalls = 0
        self.stopping = False
        self.released_early: list[str] = []
        self.released_at_ttl = 0
        self._pin_ttl_s = pin_ttl_s
        self._reported: dict[str, float] = {}

    def _after(self, now: float) -> float:
        return now + self._rng.uniform(*self._every) if self._every else float("inf")

    def _stall(self) -> float:
        """The extra seconds of this call."""
        now = time.monotonic()
        due = now >= self._next_stall
        if due:
            self._next_stall = self._after(now)
        if self._stall_s and (due or self.calls == self._stall_at):
            self.stalls += 1
            return self._stall_s
        return 0.0

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
        time.sleep(self._sync_s + self._stall())  # the engine's own work, on the caller's thread
        self.report(lookup_id, sum(offsets))
        if self._pin_ttl_s is not None:
            self._reported[lookup_id] = time.monotonic()

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        super().cleanup_memory_objs(lookup_id)
        reported = self._reported.pop(lookup_id, None)
        ttl = self._pin_ttl_s
        if self.stopping:
            return
        if reported is not None and ttl is not None and time.monotonic() - reported >= ttl / 2:
            self.released_at_ttl += 1
        else:
            self.released_early.append(lookup_id)


def _interval(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    pair = (float(low), float(high or low))
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX seconds, not {text!r}")
    return pair


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak.slow_rank", description=__doc__)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--sync-ms", type=float, default=30.0, help="engine time per lookup")
    p.add_argument("--stall-ms", type=float, default=0.0, help="extra time of a stalled call")
    p.add_argument("--stall-at", type=int, default=0, help="this call stalls (from 1; 0: none)")
    p.add_argument("--stall-every", type=_interval, metavar="MIN-MAX", help="seconds apart")
    p.add_argument("--seed", type=int, default=0, help="of the stalls' timing")
    return p


def main(argv: list[str] | None = None) -> None:
    """Serve until SIGTERM, then print the summary line."""
    args = _parser().parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop))
    config = LookupConfig.load()
    engine = SyncEngine(
        args.sync_ms / 1000,
        args.stall_ms / 1000,
        args.stall_at,
        args.stall_every,
        args.seed,
        pin_ttl_s=config.worker_pin_ttl_ms / 1000,
    )
    meta = LookupMetadata(engine_id=args.engine_id, world_size=args.world_size, worker_id=args.rank)
    server = RedisAsyncLookupServer(engine, meta, config)
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
        "released_at_ttl": engine.released_at_ttl,
        "calls": engine.calls,
        "stalls": engine.stalls,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
