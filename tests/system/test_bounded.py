"""Bounded resources: 50,000 lookups with cancels, timeouts, late reports and id reuse leave
nothing behind: every key has a TTL or a trim bound, every per-lookup map drains.

Runs on the real server (two in-process ranks with real ReferenceEngines). A fifth of
a percent of lookups are cancelled before they are sent, a tenth after, one in twenty
times out (its ranks hold the report until after the timeout, then send it late), one
in ten reuses an id, and one in a hundred is never cleared by the caller.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
import redis
from faultkit import CHUNK, alive, config, prompt, second_scheduler
from helpers import RealServer, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

pytestmark = [pytest.mark.real, pytest.mark.slow]

TOTAL = 50_000
WINDOW = 1000
STREAM_CAP = 2000
SLACK = 200  # MAXLEN ~ trims whole macro nodes (100 entries each)
DEDUPE = 5000
SETTINGS: dict[str, Any] = {
    "lookup_timeout_ms": 5000,  # the late lookups have their own client, timing out at 300
    "heartbeat_ttl_ms": 5000,
    "key_grace_ms": 1000,
    # Pins outlive the lookup and the retention (a result never outlives its pins).
    "worker_pin_ttl_ms": 6500,
    # Flat deadlines: the pins (6.5 s) outlive the 5 s one and the retention together.
    "lookup_timeout_per_1k_tokens_ms": 0,
    "worker_dedupe_capacity": DEDUPE,
    "result_retention_ms": 1000,
    "stream_maxlen": STREAM_CAP,
    "done_maxlen": STREAM_CAP,
}
#: prompt -> chunks stored on rank 0 and rank 1.
STORED = {0: (8, 8), 1: (8, 3), 2: (0, 8), 3: (5, 6)}
PROMPTS = {i: prompt(50_000 * (i + 1)) for i in STORED}
RIGHT = {i: min(s) * CHUNK for i, s in STORED.items()}


class LateSink:
    """Holds reports of ``late-*`` lookups until :meth:`flush`, after their timeout."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.held: deque[tuple[str, int]] = deque()

    def send_response_to_scheduler(self, lookup_id: str, hits: int) -> None:
        if lookup_id.startswith("late-"):
            self.held.append((lookup_id, hits))
        else:
            self.sink.send_response_to_scheduler(lookup_id, hits)

    def flush(self) -> None:
        while self.held:
            self.sink.send_response_to_scheduler(*self.held.popleft())


class LateEngine(ReferenceEngine):
    def set_response_sink(self, sink: Any) -> None:
        self.late = LateSink(sink)
        super().set_response_sink(self.late)


class Run:
    """The two ranks, the client, and what the run saw."""

    def __init__(self, cfg: LookupConfig, engine_id: str, fast: LookupConfig) -> None:
        self.engines = [LateEngine(), LateEngine()]
        self.servers = [
            RedisAsyncLookupServer(
                e, LookupMetadata(engine_id=engine_id, world_size=2, worker_id=r), cfg
            )
            for r, e in enumerate(self.engines)
        ]
        meta = LookupMetadata(engine_id=engine_id, world_size=2)
        self.client = RedisAsyncLookupClient(cfg, meta)
        # For the lookups that time out: a second deadline on the same ranks.
        self.fast = second_scheduler(RedisAsyncLookupClient(fast, meta))
        for i, tokens in PROMPTS.items():
            hashes, offsets = self.client.hasher.hashes_and_offsets(tokens)
            for rank, engine in enumerate(self.engines):
                engine.store(hashes[: STORED[i][rank]], offsets[: STORED[i][rank]])
        self.rng = random.Random(3)
        self.reusable: list[str] = []
        self.peak = {"entries": 0, "seen": 0, "aborted": 0, "held": 0}
        self.counts = {"right": 0, "late": 0, "cancelled": 0, "uncleared": 0}

    def close(self) -> None:
        self.client.close()
        self.fast.close()
        for server in self.servers:
            server.close()
        for engine in self.engines:
            engine.close()

    def window(self, start: int) -> None:
        """Issue WINDOW lookups, judge every answer, clear most of them."""
        want: dict[str, int] = {}
        for n in range(start, start + WINDOW):
            lookup_id, right = self.issue(n)
            if lookup_id is not None:
                want[lookup_id] = right
        got: dict[str, int] = {}

        def collect() -> bool:  # the scheduler's poll: read each answer once it is there
            for i in want.keys() - got.keys():
                value = self.owner(i).lookup_cache(i)
                if value is not None:
                    got[i] = value
            return len(got) == len(want)

        wait_until(collect, timeout=30, message="every lookup of the window answered")
        assert got == want, {i: (v, want[i]) for i, v in got.items() if v != want[i]}
        for lookup_id in want:
            self.finish(lookup_id)
        for engine in self.engines:
            engine.late.flush()  # their lookups timed out long ago: late reports now
        self.sample()

    def owner(self, lookup_id: str) -> RedisAsyncLookupClient:
        return self.fast if lookup_id.startswith("late-") else self.client

    def issue(self, n: int) -> tuple[str | None, int]:
        rng, client = self.rng, self.client
        which = rng.choice(list(STORED))
        roll = rng.random()
        if roll < 0.05:
            self.fast.lookup(PROMPTS[which], f"late-{n}")
            self.counts["late"] += 1
            return f"late-{n}", 0
        lookup_id = f"id-{n}"
        if roll < 0.15 and self.reusable:
            lookup_id = self.reusable.pop(rng.randrange(len(self.reusable)))
        client.lookup(PROMPTS[which], lookup_id)
        if roll > 0.9:  # cancelled, before or after it is sent
            client.cancel_lookup(lookup_id)
            self.counts["cancelled"] += 1
            self.reusable.append(lookup_id)
            return None, 0
        return lookup_id, RIGHT[which]

    def finish(self, lookup_id: str) -> None:
        if lookup_id.startswith("id-") and self.rng.random() < 0.01:
            self.counts["uncleared"] += 1  # never cleared: evicted by result_retention_ms
            return
        self.owner(lookup_id).clear_lookup_status(lookup_id)
        self.counts["right"] += 1
        if lookup_id.startswith("id-") and len(self.reusable) < 100:
            self.reusable.append(lookup_id)

    def sample(self) -> None:
        entries = self.client.stats().entries + self.fast.stats().entries
        self.peak["entries"] = max(self.peak["entries"], entries)
        for server in self.servers:
            stats = server.stats()
            for k, v in (("seen", stats.seen), ("aborted", stats.aborted), ("held", stats.held)):
                self.peak[k] = max(self.peak[k], v)


def _drained(run: Run) -> bool:
    clients = [run.client.stats(), run.fast.stats()]
    maps = [s.stats() for s in run.servers]
    engines = [e.stats() for e in run.engines]
    return (
        all(c.entries == 0 and c.inflight == 0 for c in clients)
        and all(m.running == m.waiting == m.held == m.seen == m.aborted == 0 for m in maps)
        and all(e["pinned_chunks"] == 0 and e["inflight"] == 0 for e in engines)
    )


def _keys_bounded(conn: redis.Redis, ks: KeySpace) -> dict[str, int]:
    lengths: dict[str, int] = {}
    for key in conn.scan_iter(match=ks.pattern, count=1000):
        if conn.type(key) == b"stream":
            lengths[key.decode()] = conn.xlen(key)
        else:
            assert conn.pttl(key) != -1, f"{key!r} has no TTL"
    return lengths


@pytest.mark.long
def test_fifty_thousand_lookups_leave_nothing_behind(
    real_server: RealServer, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    conn.xgroup_create(ks.requests, "rank-9", id="$", mkstream=True)  # a dead group
    cfg = config(real_server.url, **SETTINGS)
    run = Run(cfg, engine_id, config(real_server.url, **{**SETTINGS, "lookup_timeout_ms": 300}))
    try:
        alive(run.client, timeout=10)
        for start in range(0, TOTAL, WINDOW):
            run.window(start)
            for key, length in _keys_bounded(conn, ks).items():
                assert length <= STREAM_CAP + SLACK, (key, length)
        assert run.peak["seen"] <= DEDUPE and run.peak["aborted"] <= DEDUPE, run.peak
        assert run.counts["late"] > 1000 and run.counts["cancelled"] > 1000, run.counts
        assert run.counts["uncleared"] > 100, run.counts
        wait_until(lambda: _drained(run), timeout=30, message="every map drained")
        lengths = _keys_bounded(conn, ks)
        assert set(lengths) == {ks.requests, ks.done}  # no dead letters: all input was valid
        assert all(length <= STREAM_CAP + SLACK for length in lengths.values()), lengths
        assert run.fast.stats().outcomes["timeout"] == run.counts["late"]
        assert run.client.stats().outcomes["timeout"] == 0
    finally:
        run.close()
