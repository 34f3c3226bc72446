"""Rank processes crash, stall and stop while lookups are in flight (real server, real processes).

Each rank is ``python -m workers`` with a preloaded ReferenceEngine; disk-tier prompts
with a load delay keep a prefetch running for seconds, so a signal lands mid-prefetch.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import pytest
import redis
from faultkit import (
    MakeLookupClient,
    StartRank,
    alive,
    answer,
    beat,
    config,
    prompt,
    second_scheduler,
)
from helpers import RealServer, epoch_ms, lookup_request, request_entry, wait_until

from broker_lookup.protocol.keys import KeySpace

# Real processes, seconds each: in the long leg (`-m long`), to keep the default run
# within its CI budget; the in-process rank tests (tests/protocol: delivery, dead rank,
# connection loss) run on fakeredis and a real server in the default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

HOT = prompt(1000)  # in memory on every rank: a full hit
SLOW = prompt(2000)  # on disk on every rank: 8 chunks x 250 ms of loading
PROMPTS: list[dict[str, Any]] = [{"tokens": HOT}, {"tokens": SLOW, "tier": "disk"}]
FULL = len(HOT)


def _pending(conn: redis.Redis, ks: KeySpace, rank: int) -> tuple[int, int]:
    """(pending, lag) of a rank's group."""
    for g in conn.xinfo_groups(ks.requests):
        if g["name"] in (ks.group(rank), ks.group(rank).encode()):
            return int(g["pending"]), int(g["lag"] or 0)
    raise AssertionError(f"no group {ks.group(rank)}")


def test_kill9_mid_prefetch_then_restart_replays_pending(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    # A long heartbeat TTL: the crashed rank still counts as alive until it is back, so
    # lookups sent meanwhile wait for it instead of failing fast as dead-rank lookups.
    # The lease stays short: the restarted rank takes over as soon as the crashed one's ended.
    slow_hb: dict[str, Any] = {
        "heartbeat_interval_ms": 100,
        "heartbeat_ttl_ms": 20000,
        "owner_lease_ms": 1500,
    }
    ranks = [
        rank_procs(real_server.url, engine_id, 2, r, PROMPTS, load_delay_ms=250, **slow_hb)
        for r in range(2)
    ]
    short = clients(config(real_server.url, lookup_timeout_ms=2500, **slow_hb), engine_id, 2)
    long = second_scheduler(
        clients(config(real_server.url, lookup_timeout_ms=30000, **slow_hb), engine_id, 2)
    )
    alive(short)
    alive(long)
    assert short.lookup(SLOW, "slow") is None
    wait_until(lambda: beat(conn, ks.heartbeat(0)).get("running") == 1, timeout=10)
    ranks[0].kill9()  # mid-prefetch: rank 0 never reports "slow"
    assert long.lookup(HOT, "live") is None  # sent while rank 0 is down
    # The crashed rank had read "live" and an already-expired lookup, and acked neither.
    dead = lookup_request("expired", expected=[0, 1], deadline_ms=epoch_ms() - 1000)
    wait_until(lambda: _pending(conn, ks, 0)[1] >= 1, message="'live' queued for rank 0")
    conn.xadd(ks.requests, request_entry(dead))
    conn.xreadgroup(ks.group(0), ks.consumer(0), {ks.requests: ">"})
    assert _pending(conn, ks, 0)[0] >= 2
    assert answer(short, "slow", timeout=10) == 0  # the timeout; never rank 1's 32 alone
    ranks[0].start()  # restarted: replays its pending entries with id 0
    assert answer(long, "live", timeout=30) == FULL
    wait_until(lambda: _pending(conn, ks, 0) == (0, 0), timeout=10, message="rank 0 caught up")
    assert long.lookup(HOT, "after") is None
    assert answer(long, "after", timeout=10) == FULL

    ranks[0].signal(signal.SIGTERM)
    assert ranks[0].wait(30) == 0
    log = ranks[0].log()
    assert "expired=1" in log, log[-2000:]  # the stale entry was dropped, not prefetched


def test_sigterm_mid_prefetch_is_an_ordered_exit_zero(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    rank = rank_procs(real_server.url, engine_id, 1, 0, PROMPTS, load_delay_ms=250)
    client = clients(config(real_server.url, lookup_timeout_ms=30000), engine_id, 1)
    alive(client)
    client.lookup(SLOW, "slow")
    wait_until(lambda: beat(conn, ks.heartbeat(0)).get("running") == 1, timeout=10)
    rank.signal(signal.SIGTERM)
    assert rank.wait(20) == 0  # bounded: the runner stops BLOCK + grace, engine 5 s at most
    assert not conn.exists(ks.heartbeat(0))  # deleted on the way out: clients see it at once
    assert _pending(conn, ks, 0)[0] == 0  # nothing left unacked
    # The in-flight lookup ends now (dead rank), not after its 30 s timeout.
    assert answer(client, "slow", timeout=10) == 0
    assert client.stats().outcomes["dead_rank"] == 1
    log = rank.log()
    assert "SIGTERM received" in log and "stopped after" in log, log[-2000:]
    assert "Traceback" not in log, log[-4000:]


def test_stalled_rank_fails_fast_with_one_error_then_recovers(
    real_server: RealServer,
    engine_id: str,
    rank_procs: StartRank,
    clients: MakeLookupClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ks = KeySpace(engine_id)
    ranks = [rank_procs(real_server.url, engine_id, 2, r, PROMPTS) for r in range(2)]
    client = clients(config(real_server.url, lookup_timeout_ms=30000), engine_id, 2)
    alive(client)
    client.lookup(HOT, "before")
    assert answer(client, "before", timeout=10) == FULL
    caplog.set_level(logging.INFO, logger="broker_lookup")
    caplog.clear()  # the client started before the ranks: that was logged already
    ranks[1].signal(signal.SIGSTOP)  # alive but silent: its heartbeat expires
    wait_until(lambda: client.stats().dead_ranks == (1,), timeout=10)
    for i in range(3):
        started = time.monotonic()
        assert client.lookup(HOT, f"during-{i}") == 0
        # Answered at once, far under the 30 s timeout: no waiting on a dead rank.
        assert answer(client, f"during-{i}", timeout=5) == 0
        assert time.monotonic() - started < 5
    errors = [
        r for r in caplog.records if r.levelno == logging.ERROR and "rank 1 " in r.getMessage()
    ]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    assert ks.heartbeat(1) in errors[0].getMessage()
    ranks[1].signal(signal.SIGCONT)
    alive(client, timeout=10)
    client.lookup(HOT, "after")
    assert answer(client, "after", timeout=10) == FULL
