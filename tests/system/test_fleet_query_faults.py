"""The fleet query against real rank processes (``python -m workers``) under faults: a
rank killed, the querier's link or one rank's link held (through the TCP fault proxy),
Redis restarted, while queries and reservations are in flight. In every case: no wrong
answer (a count is the prefix every rank holds, or 0 with its reason), no hang (each
query returns within its deadline, or its socket timeout when Redis is unreachable), no
leaked pin (a reservation is released at its TTL, whatever happened to Redis meanwhile).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from faultkit import CHUNK, StartRank, config, prompt
from helpers import RealServer, wait_until

from broker_lookup import FleetClient
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from faultproxy.proxy import FaultProxy

# Real rank processes and restarted servers, seconds each: in the long leg (`-m long`), to
# keep the default run within its CI budget; the in-process fleet-query tests
# (tests/protocol/test_fleet_query.py) run on fakeredis and a real server in the default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

HOT = prompt(2000)  # preloaded in memory on every rank
PROMPTS = [{"tokens": HOT}]
FULL = len(HOT)
DEADLINE_MS = 300


def _ranks(url: str, engine_id: str, rank_procs: StartRank, world: int = 2) -> list[Any]:
    procs = [rank_procs(url, engine_id, world, rank, PROMPTS) for rank in range(world)]
    return procs


def _fleet(url: str, **overrides: Any) -> FleetClient:
    return FleetClient(config(url, **overrides), deadline_ms=DEADLINE_MS)


def _full(fleet: FleetClient, engine_id: str, **ask: Any) -> Any:
    """Query until every rank answers the full prefix (the ranks start and preload)."""
    found: list[Any] = []

    def once() -> bool:
        found[:] = [fleet.query(HOT, engines=[engine_id], **ask).engines[0]]
        return bool(found[0].tokens == FULL)

    wait_until(once, timeout=60, message="every rank answers the full prefix")
    return found[0]


def _pinned(server_url: str, engine_id: str, rank: int) -> int | None:
    beat = redis.Redis.from_url(server_url).get(KeySpace(engine_id).heartbeat(rank))
    return None if beat is None else json.loads(beat).get("engine_pinned_chunks")


def test_a_rank_killed_while_queries_run(
    real_server: RealServer, engine_id: str, rank_procs: StartRank
) -> None:
    procs = _ranks(real_server.url, engine_id, rank_procs)
    fleet = _fleet(real_server.url)
    try:
        _full(fleet, engine_id)
        seen: list[tuple[int, str | None, float]] = []
        stop = threading.Event()

        def ask() -> None:
            while not stop.is_set():
                started = time.monotonic()
                e = fleet.query(HOT, engines=[engine_id]).engines[0]
                seen.append((e.tokens, e.reason, time.monotonic() - started))

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            wait_until(lambda: len(seen) >= 20, timeout=30, message="queries before the kill")
            procs[1].kill9()
            wait_until(
                lambda: seen and seen[-1][1] == "dead_rank",
                timeout=30,
                message="the killed rank's heartbeat lapses: dead_rank",
            )
        finally:
            stop.set()
            asker.join(30)
        assert not asker.is_alive()
        answers = {(tokens, reason) for tokens, reason, _ in seen}
        assert answers <= {(FULL, None), (0, "deadline"), (0, "dead_rank")}, answers
        assert max(took for _, _, took in seen) < DEADLINE_MS / 1000 + 1.0  # never hangs
    finally:
        fleet.close()


def test_a_held_link_answers_unavailable_then_recovers(
    real_server: RealServer, fault_proxy: FaultProxy, engine_id: str, rank_procs: StartRank
) -> None:
    _ranks(real_server.url, engine_id, rank_procs)
    fleet = _fleet(fault_proxy.url, socket_timeout_ms=1500)
    try:
        _full(fleet, engine_id)
        fault_proxy.hold()  # no RST: a stalled server or a partition
        started = time.monotonic()
        held = fleet.query(HOT, engines=[engine_id])
        assert time.monotonic() - started < 1.5 + 1.0  # bounded by the socket timeout
        assert [(e.tokens, e.reason) for e in held.engines] == [(0, "unavailable")]
        assert not held.available
        fault_proxy.release()
        assert _full(fleet, engine_id).reason is None
    finally:
        fleet.close()


def test_a_reservation_is_released_at_its_ttl_across_a_redis_restart(
    fresh_real_server: EmbeddedServer, engine_id: str, rank_procs: StartRank
) -> None:
    url = fresh_real_server.url
    _ranks(url, engine_id, rank_procs)
    fleet = _fleet(url)
    try:
        _full(fleet, engine_id)
        wait_until(lambda: _pinned(url, engine_id, 0) == 0, timeout=30, message="no pins yet")
        top = _full(fleet, engine_id, reserve_ms=4000)
        assert top.reserved == FULL
        wait_until(
            lambda: all(_pinned(url, engine_id, r) == FULL // CHUNK for r in (0, 1)),
            timeout=10,
            message="both ranks show the reserved chunks pinned",
        )
        fresh_real_server.restart()  # nothing in Redis now; the pins live in the ranks
        wait_until(
            lambda: all(_pinned(url, engine_id, r) == 0 for r in (0, 1)),
            timeout=30,
            ignoring=(redis.RedisError,),
            message="released at the TTL, reported by the ranks' next heartbeats",
        )
        assert _full(fleet, engine_id).tokens == FULL  # the probers reconnected
    finally:
        fleet.close()


Seen = list[tuple[int, str | None, int, float]]
#: Every answer a fault may give besides the truth: 0 with its reason.
FAULTED = {"deadline", "dead_rank", "no_ranks", "unavailable"}


def _asking(fleet: FleetClient, engine_id: str, seen: Seen, stop: threading.Event) -> None:
    """Query with a reservation until ``stop``: (tokens, reason, reserved, seconds) each."""
    while not stop.is_set():
        started = time.monotonic()
        e = fleet.query(HOT, engines=[engine_id], reserve_ms=1000).engines[0]
        seen.append((e.tokens, e.reason, e.reserved, time.monotonic() - started))


def _judge(seen: Seen, bound_s: float) -> None:
    """No wrong answer, no reservation beyond what was found, no query past ``bound_s``."""
    wrong = [
        s for s in seen if not ((s[0], s[1]) == (FULL, None) or (s[0] == 0 and s[1] in FAULTED))
    ]
    assert not wrong, wrong[:5]
    assert all(reserved in (0, tokens) for tokens, _, reserved, _ in seen)
    assert max(took for *_, took in seen) < bound_s


def test_redis_restarted_while_queries_and_reservations_run(
    fresh_real_server: EmbeddedServer, engine_id: str, rank_procs: StartRank
) -> None:
    url = fresh_real_server.url
    _ranks(url, engine_id, rank_procs)
    fleet = _fleet(url, socket_timeout_ms=1500)
    seen: Seen = []
    stop = threading.Event()
    asker = threading.Thread(target=_asking, args=(fleet, engine_id, seen, stop))
    try:
        _full(fleet, engine_id)
        asker.start()
        wait_until(lambda: len(seen) >= 10, timeout=30, message="queries before the restart")
        fresh_real_server.restart()
        restarted = len(seen)
        wait_until(
            lambda: any(s[0] == FULL and s[2] == FULL for s in seen[restarted + 1 :]),
            timeout=60,
            message="queries and reservations answer in full again",
        )
    finally:
        stop.set()
        asker.join(30)
        fleet.close()
    assert not asker.is_alive()  # no hang
    _judge(seen, 2 * DEADLINE_MS / 1000 + 1.5 + 1.0)
    wait_until(
        lambda: all(_pinned(url, engine_id, r) == 0 for r in (0, 1)),
        timeout=30,
        message="every reservation released: none leaked across the restart",
    )


def test_a_ranks_link_held_while_queries_and_reservations_run(
    real_server: RealServer, fault_proxy: FaultProxy, engine_id: str, rank_procs: StartRank
) -> None:
    # Rank 1 reaches Redis through the proxy: held, it answers nothing (its heartbeat
    # lapses too), while rank 0 keeps answering and pinning.
    procs = [
        rank_procs(real_server.url, engine_id, 2, 0, PROMPTS),
        rank_procs(fault_proxy.url, engine_id, 2, 1, PROMPTS),
    ]
    assert procs
    fleet = _fleet(real_server.url)
    seen: Seen = []
    stop = threading.Event()
    asker = threading.Thread(target=_asking, args=(fleet, engine_id, seen, stop))
    try:
        _full(fleet, engine_id)
        asker.start()
        wait_until(lambda: len(seen) >= 10, timeout=30, message="queries before the hold")
        fault_proxy.hold()
        held = len(seen)
        wait_until(
            lambda: any(s[1] in ("deadline", "dead_rank") for s in seen[held:]),
            timeout=30,
            message="the held rank's engine answers 0 with its reason",
        )
        fault_proxy.release()
        released = len(seen)
        wait_until(
            lambda: any(s[0] == FULL and s[2] == FULL for s in seen[released + 1 :]),
            timeout=60,
            message="queries and reservations answer in full again",
        )
    finally:
        stop.set()
        asker.join(30)
        fleet.close()
    assert not asker.is_alive()
    _judge(seen, 2 * DEADLINE_MS / 1000 + 1.0)
    wait_until(
        lambda: all(_pinned(real_server.url, engine_id, r) == 0 for r in (0, 1)),
        timeout=30,
        message="every reservation released at its TTL: none leaked by the hold",
    )
