"""The Redis server restarts, or is flushed, while lookups are in flight (a private real server).

Nothing is told about it: the client and the ranks reconnect on their own, the ranks
re-create their consumer groups (NOGROUP), reload the scripts (NOSCRIPT), re-announce
their heartbeats. In-flight lookups end as 0 or right, never wrong and never hanging;
new lookups are right again within a bounded time; no thread dies.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from faultkit import alive, config, eventually_right, prompt, settle
from helpers import wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

pytestmark = [pytest.mark.real, pytest.mark.slow]

HOT = prompt(1000)
FULL = len(HOT)
WORLD = 2


class Stack:
    """Two in-process ranks and a client, all connected by URL only."""

    def __init__(self, cfg: LookupConfig, engine_id: str) -> None:
        self.engines = [ReferenceEngine() for _ in range(WORLD)]
        self.servers = []
        for rank, engine in enumerate(self.engines):
            meta = LookupMetadata(engine_id=engine_id, world_size=WORLD, worker_id=rank)
            self.servers.append(RedisAsyncLookupServer(engine, meta, cfg))
        hashes, offsets = self.client_hashes(cfg, engine_id)
        for engine in self.engines:
            engine.store(hashes, offsets)
        self.client = RedisAsyncLookupClient(
            cfg, LookupMetadata(engine_id=engine_id, world_size=WORLD)
        )

    def client_hashes(self, cfg: LookupConfig, engine_id: str) -> tuple[list[int], list[int]]:
        from broker_lookup.protocol.hashing import ChunkedTokenHasher

        return ChunkedTokenHasher(cfg).hashes_and_offsets(HOT)

    def threads_alive(self) -> bool:
        c = self.client
        return (
            all(s.stats().alive for s in self.servers)
            and c._sender._thread.is_alive()
            and c._listener._thread.is_alive()
        )

    def close(self) -> None:
        self.client.close()
        for server in self.servers:
            server.close()
        for engine in self.engines:
            engine.close()


@pytest.fixture
def stack(fresh_real_server: EmbeddedServer, engine_id: str) -> Iterator[Stack]:
    st = Stack(config(fresh_real_server.url, lookup_timeout_ms=1500), engine_id)
    try:
        alive(st.client, timeout=10)
        yield st
    finally:
        st.close()


def _burst(client: RedisAsyncLookupClient, tag: str, n: int = 20) -> dict[str, int]:
    for i in range(n):
        client.lookup(HOT, f"{tag}-{i}")
    return {f"{tag}-{i}": FULL for i in range(n)}


def test_server_restart_mid_traffic(
    stack: Stack, fresh_real_server: EmbeddedServer, engine_id: str
) -> None:
    eventually_right(stack.client, HOT, FULL, timeout=10, tag="warm")
    inflight = _burst(stack.client, "a")
    fresh_real_server.restart()  # same port, empty: no keys, no groups, no scripts
    settle(stack.client, inflight, timeout=1.5 + 3)
    eventually_right(stack.client, HOT, FULL, timeout=30, tag="after-restart")
    conn = redis.Redis.from_url(fresh_real_server.url)
    groups = {g["name"] for g in conn.xinfo_groups(KeySpace(engine_id).requests)}
    assert groups == {b"rank-0", b"rank-1"}  # re-created by the ranks themselves
    assert stack.threads_alive()
    consumer = [s.stats().consumer for s in stack.servers]
    # Each rank noticed (a connection error, or NOGROUP once redis-py reconnected), counted it.
    assert all(c.nogroup + c.redis_errors >= 1 for c in consumer), consumer


def test_flushall_mid_traffic(
    stack: Stack, fresh_real_server: EmbeddedServer, engine_id: str
) -> None:
    eventually_right(stack.client, HOT, FULL, timeout=10, tag="warm")
    inflight = _burst(stack.client, "b")
    conn = redis.Redis.from_url(fresh_real_server.url)
    conn.flushall()  # keys, heartbeats, streams and groups gone; the scripts stay
    settle(stack.client, inflight, timeout=1.5 + 3)
    eventually_right(stack.client, HOT, FULL, timeout=30, tag="after-flush")
    groups = {g["name"] for g in conn.xinfo_groups(KeySpace(engine_id).requests)}
    assert groups == {b"rank-0", b"rank-1"}
    consumer = [s.stats().consumer for s in stack.servers]
    # Each rank learnt of the flush as NOGROUP, or as its blocked read being unblocked.
    assert all(c.nogroup + c.redis_errors >= 1 for c in consumer), consumer
    assert stack.threads_alive()


def test_server_down_for_a_while_then_back(
    stack: Stack, fresh_real_server: EmbeddedServer, engine_id: str
) -> None:
    eventually_right(stack.client, HOT, FULL, timeout=10, tag="warm")
    fresh_real_server.stop()
    down = _burst(stack.client, "down", n=10)
    # Nobody can answer: every lookup ends as 0 by its timeout (or at once, as an
    # error or a dead rank), none hangs.
    assert settle(stack.client, down, timeout=1.5 + 3) == [0] * 10
    wait_until(lambda: stack.client.stats().redis_errors > 0, timeout=5)
    assert stack.threads_alive()
    fresh_real_server.start()
    eventually_right(stack.client, HOT, FULL, timeout=30, tag="back")
    assert stack.threads_alive()
