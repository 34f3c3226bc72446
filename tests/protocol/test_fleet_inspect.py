"""``inspect`` of a fleet: every engine on one server, its owners, in-flight lookups,
conflicts, and when a stale engine's keys expire; on fakeredis and on a real server."""

from __future__ import annotations

import os
import time
from typing import Any

from faultkit import config, prompt, ready
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupMetadata
from broker_lookup.ops.fleet import fleet_snapshot, render_fleet
from broker_lookup.ops.inspect import check, snapshot
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer


def _server(backend: Backend, engine_id: str, rank: int = 0) -> RedisAsyncLookupServer:
    meta = LookupMetadata(engine_id=engine_id, world_size=1, worker_id=rank)
    return RedisAsyncLookupServer(StubEngine(), meta, config(), connection_factory=backend.factory)


def _mine(snap: dict[str, Any], *ids: str) -> dict[str, dict[str, Any]]:
    """The engines of this test (a real server is shared with other tests)."""
    return {e["engine_id"]: e for e in snap["engines"] if e["engine_id"] in ids}


def test_every_engine_with_owners_inflight_conflicts_and_expiry(
    backend: Backend, engine_id: str
) -> None:
    live, stale = engine_id + "-live", engine_id + "-stale"
    conn = backend.factory()
    # The newcomer starts only once the owner holds the lease: started together, either
    # may claim first.
    owner = _server(backend, live)
    newcomer: RedisAsyncLookupServer | None = None
    meta = LookupMetadata(engine_id=live, world_size=1)
    client = RedisAsyncLookupClient(config(), meta, connection_factory=backend.factory)
    try:
        ready(owner)
        newcomer = _server(backend, live)
        wait_until(lambda: newcomer.lease.counts["conflicts"] >= 1)
        wait_until(lambda: not client.stats().dead_ranks)
        client.lookup(prompt(0), "in-flight")  # the manual stub engine never answers it
        wait_until(lambda: owner.engine.started_ids() == ["in-flight"])  # type: ignore[attr-defined]
        # A stale engine: what a dead one leaves, a lookup hash with its TTL.
        conn.hset(KeySpace(stale).lookup("old"), mapping={"state": "done", "gen": "1"})
        conn.pexpire(KeySpace(stale).lookup("old"), 90_000)
        snap = fleet_snapshot(conn, int(time.time() * 1000))
        mine = _mine(snap, live, stale)
        assert set(mine) == {live, stale}
        e = mine[live]
        assert e["live"] and e["inflight"] == 1
        assert e["scheduler"]["owner"]["pid"] == os.getpid()
        assert e["ranks"][0]["heartbeat"] and e["ranks"][0]["owner"]["epoch"] == 1
        (conflict,) = e["conflicts"]
        assert conflict.startswith(f"engine {live} rank 0: served by ")
        assert owner.lease.identity.describe() in conflict
        assert newcomer.lease.identity.describe() in conflict
        s = mine[stale]
        assert not s["live"] and s["conflicts"] == [] and 0 < s["expires_in_ms"] <= 90_000
        text = render_fleet(snap, "redis://x")
        assert "CONFLICTS (" in text and conflict in text
        # The engine's own view names the conflict too, and its check fails on it.
        one = snapshot(conn, KeySpace(live), 1, 50)
        assert one["conflicts"] == [conflict] and conflict in check(one, KeySpace(live))
        newcomer.close()  # its contender key goes with it (released)
        wait_until(lambda: not check(snapshot(conn, KeySpace(live), 1, 50), KeySpace(live)))
    finally:
        client.close()
        owner.close()
        if newcomer is not None:
            newcomer.close()
    # Stopped cleanly: leases and heartbeats released, the engine is stale at once; its
    # streams have no TTL here (expiry of those is the engine TTL's business).
    after = _mine(fleet_snapshot(conn, int(time.time() * 1000)), live)[live]
    assert not after["live"] and after["scheduler"] is None and after["ranks"] == {}
