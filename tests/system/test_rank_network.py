"""Network faults between a rank and Redis, through a TCP fault proxy.

Real server, a real rank process (``python -m workers``) whose connections all go
through the :class:`FaultProxy`; the client talks to the server directly, so each
fault lands on the rank's side alone: a delivery whose reply is lost between
XREADGROUP and XACK (the connection then reset, or left silent), a lost XACK reply, a
stall without RST, resets. In every case the lookup is answered right (a full hit,
not 0) once no fault is active, nothing hangs, and the rank's pending entries drain.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest
import redis
from faultkit import (
    MakeLookupClient,
    RankProcess,
    StartRank,
    alive,
    answer,
    beat,
    config,
    eventually_right,
    prompt,
)
from helpers import RealServer, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.protocol.keys import KeySpace
from faultproxy.proxy import FaultProxy

# Real processes, seconds each: in the long leg (`-m long`), to keep the default run
# within its CI budget; the in-process connection-loss and delivery tests (tests/protocol)
# run on fakeredis and a real server in the default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

HOT = prompt(1000)  # in memory on the rank: a full hit
PROMPTS = [{"tokens": HOT}]
FULL = len(HOT)
#: The rank may go silent for a socket timeout (BLOCK + breaker_open_ms) without the
#: client calling it dead, so a lost delivery is answered by the rank, not as a dead rank.
PATIENT = {"heartbeat_ttl_ms": 6000, "lookup_timeout_ms": 10_000}


def _pending(conn: redis.Redis, ks: KeySpace) -> int:
    return int(conn.xpending(ks.requests, ks.group(0))["pending"])


#: The ``setup`` fixture: ``setup(**config)`` starts the rank and its client.
Setup = Callable[..., tuple[RankProcess, RedisAsyncLookupClient, redis.Redis]]


@pytest.fixture
def setup(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    rank_procs: StartRank,
    clients: MakeLookupClient,
) -> Setup:
    """(rank process through the proxy, its client straight to the server, direct conn)."""

    def make(**overrides: Any) -> tuple[RankProcess, RedisAsyncLookupClient, redis.Redis]:
        rank = rank_procs(fault_proxy.url, engine_id, 1, 0, PROMPTS, **overrides)
        client = clients(config(real_server.url, **overrides), engine_id, 1)
        alive(client)
        client.lookup(HOT, "warm")
        conn = redis.Redis.from_url(real_server.url)
        got = answer(client, "warm", timeout=10)
        assert got == FULL, (client.stats(), beat(conn, KeySpace(engine_id).heartbeat(0)))
        return rank, client, conn

    return make


@pytest.mark.parametrize("then", ["hold", "reset"])
def test_lost_delivery_is_read_again_and_served(
    setup: Setup, fault_proxy: FaultProxy, engine_id: str, then: str
) -> None:
    ks = KeySpace(engine_id)
    rank, client, conn = setup(**PATIENT)
    for i in range(4):
        # Stopped, the rank sends nothing; armed meanwhile, the next XREADGROUP it sends
        # after SIGCONT (a read of the entry already in the stream, unless a periodic
        # re-read comes first) runs on the server but its reply is lost.
        rank.signal(signal.SIGSTOP)
        fault_proxy.lose_reply("XREADGROUP", then=then)
        client.lookup(HOT, f"lost-{i}")
        rank.signal(signal.SIGCONT)
        assert answer(client, f"lost-{i}", timeout=20) == FULL
        wait_until(lambda: _pending(conn, ks) == 0, timeout=10, message="the PEL drains")
    # Every loss was an error the rank saw, and at least one delivery was read again.
    wait_until(
        lambda: (
            (hb := beat(conn, ks.heartbeat(0))) and hb["replayed"] >= 1 and hb["redis_errors"] >= 4
        ),
        message="the heartbeat counts the losses and the re-read",
    )


def test_lost_xack_reply_drains_and_answers_right(
    setup: Setup, fault_proxy: FaultProxy, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    _, client, conn = setup(**PATIENT)
    for i in range(3):
        fault_proxy.lose_reply("XACK", then="reset")
        client.lookup(HOT, f"ack-{i}")
        assert answer(client, f"ack-{i}", timeout=20) == FULL
        wait_until(lambda: _pending(conn, ks) == 0, timeout=10, message="the PEL drains")
    wait_until(lambda: beat(conn, ks.heartbeat(0))["redis_errors"] >= 3, message="3 errors")


def test_stalled_rank_connection_answers_zero_fast_then_recovers(
    setup: Setup, fault_proxy: FaultProxy, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    _, client, conn = setup()  # FAST: a 1.5 s heartbeat TTL and lookup timeout
    fault_proxy.hold()  # the rank's connections stall, no RST
    wait_until(lambda: client.stats().dead_ranks == (0,), timeout=10)
    for i in range(3):
        client.lookup(HOT, f"during-{i}")
        assert answer(client, f"during-{i}", timeout=5) == 0  # dead rank: at once, no hang
    fault_proxy.release()
    assert eventually_right(client, HOT, FULL, timeout=20, tag="after") >= 1
    wait_until(lambda: _pending(conn, ks) == 0, timeout=10, message="the PEL drains")


def test_reset_rank_connections_recover_by_themselves(
    setup: Setup, fault_proxy: FaultProxy, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    _, client, conn = setup(**PATIENT)
    for i in range(3):
        client.lookup(HOT, f"reset-{i}")
        # After the last reset the rank may still be in its 0.2 s back-off, with no
        # connection open, though its report already ran: reset once it has reconnected.
        wait_until(lambda: fault_proxy.reset() >= 1, timeout=10, message="a rank connection")
        assert answer(client, f"reset-{i}", timeout=20) == FULL
    assert eventually_right(client, HOT, FULL, timeout=20, tag="after") >= 1
    wait_until(lambda: _pending(conn, ks) == 0, timeout=10, message="the PEL drains")
