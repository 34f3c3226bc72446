"""Partial answers with real rank processes: one rank's disk tier is slow, so at the
deadline it has confirmed only a prefix; the answer is that prefix, both rank processes
keep exactly it pinned, and a cancel releases everything. And a rank behind a slow link,
whose reports reach Redis after the deadline answered, keeps what was answered."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from faultkit import (
    CHUNK,
    LateEngine,
    MakeLookupClient,
    StartRank,
    alive,
    answer,
    beat,
    config,
    prompt,
    ready,
)
from helpers import RealServer, wait_until

from broker_lookup.config import LookupMetadata
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from faultproxy.proxy import FaultProxy
from workers.server import RedisAsyncLookupServer

# Real processes, seconds each: in the long leg (`-m long`), to keep the default run
# within its CI budget; the in-process partial-answer tests (tests/protocol:
# test_partial_answers, test_partial_promises) run on fakeredis and a real server in the
# default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

TOKENS = prompt(7000)  # 8 chunks
PARTIAL: dict[str, Any] = {
    "partial_answers": True,
    "lookup_timeout_ms": 1500,
    "lookup_timeout_per_1k_tokens_ms": 0,
}


def test_slow_disk_rank_gets_a_partial_answer_with_pins_kept_then_released(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    fast: list[dict[str, Any]] = [{"tokens": TOKENS}]
    slow: list[dict[str, Any]] = [
        {"tokens": TOKENS, "fraction": 0.25},  # its first 2 chunks in memory
        {"tokens": TOKENS, "tier": "disk"},
    ]
    rank_procs(real_server.url, engine_id, 2, 0, fast, **PARTIAL)
    rank_procs(real_server.url, engine_id, 2, 1, slow, load_delay_ms=700, **PARTIAL)
    client = clients(config(real_server.url, **PARTIAL), engine_id, 2)
    alive(client)
    assert client.lookup(TOKENS, "long") is None
    got = answer(client, "long", timeout=15)
    assert 2 * CHUNK <= got < len(TOKENS)
    raw: Any = conn.hgetall(ks.lookup("long"))
    fields = lookup_hash.decode(raw)
    assert (fields.result, fields.partial) == (got, True)
    kept = got // CHUNK

    def pins() -> list[Any]:
        return [beat(conn, ks.heartbeat(r)).get("engine_pinned_chunks") for r in (0, 1)]

    wait_until(lambda: pins() == [kept, kept], timeout=10, message="both ranks keep the prefix")
    client.cancel_lookup("long")
    wait_until(lambda: pins() == [0, 0], timeout=10, message="cancel released everything")


def test_a_lost_reply_to_the_deadline_script_still_gives_the_partial_answer(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    rank_procs: StartRank,
    clients: MakeLookupClient,
) -> None:
    """The server answers the lookup at its deadline, the reply never reaches the client,
    its connection is reset: the re-sent script finds its own answer (idempotent), and
    the ranks are told to keep exactly that prefix."""
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    fast: list[dict[str, Any]] = [{"tokens": TOKENS}]
    slow: list[dict[str, Any]] = [
        {"tokens": TOKENS, "fraction": 0.25},
        {"tokens": TOKENS, "tier": "disk"},
    ]
    rank_procs(real_server.url, engine_id, 2, 0, fast, **PARTIAL)
    rank_procs(real_server.url, engine_id, 2, 1, slow, load_delay_ms=700, **PARTIAL)
    client = clients(config(fault_proxy.url, **PARTIAL), engine_id, 2)
    alive(client)
    client.lookup(TOKENS, "long")
    wait_until(lambda: conn.hexists(ks.lookup("long"), "p1"), message="the slow rank's progress")
    fault_proxy.lose_reply("EVALSHA", then="reset")  # the client's next script: the deadline's
    got = answer(client, "long", timeout=15)
    assert fault_proxy.stats["replies_lost"] == 1
    assert 2 * CHUNK <= got < len(TOKENS)
    assert conn.hget(ks.lookup("long"), "result") == str(got).encode()
    kept = got // CHUNK
    pins = [ks.heartbeat(r) for r in (0, 1)]
    wait_until(
        lambda: [beat(conn, k).get("engine_pinned_chunks") for k in pins] == [kept, kept],
        timeout=10,
        message="both ranks keep the answered prefix",
    )


def test_a_long_prompt_on_a_slow_tier_is_answered_within_its_scaled_deadline(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    """1,000 chunks on a disk tier at >= 2 ms each take over 2 s to load: a flat 1 s
    deadline would answer 0; 1 s + 3 s per 1,000 tokens gives this 4,000-token prompt
    13 s, and it is answered as the full hit it is."""
    long = list(range(100_000, 104_000))
    scaled: dict[str, Any] = {
        "lookup_timeout_ms": 1000,
        "lookup_timeout_per_1k_tokens_ms": 3000,
        "lookup_timeout_max_ms": 20_000,
    }
    rank_procs(real_server.url, engine_id, 1, 0, [{"tokens": long, "tier": "disk"}], 2.0, **scaled)
    client = clients(config(real_server.url, **scaled), engine_id, 1)
    alive(client)
    started = time.monotonic()
    client.lookup(long, "long")
    assert answer(client, "long", timeout=30) == len(long)
    assert time.monotonic() - started > 2.0  # the sleeps alone: past the flat deadline
    assert client.stats().outcomes["hit"] == 1


@pytest.mark.long  # the first chunk must be confirmed through a delayed link in time
def test_reports_that_a_slow_link_delivers_after_the_partial_answer_keep_it(
    real_server: RealServer, fault_proxy: FaultProxy, engine_id: str, clients: MakeLookupClient
) -> None:
    """150 ms each way on the rank's link. Its engine reports as soon as the client has
    its partial answer: before the keep reaches the rank, so the report is sent, and it
    reaches Redis after the deadline answered (``settled:<n>``). The rank must keep the
    prefix it was answered, every time."""
    # The first chunk's progress takes a read and a report, each 300 ms longer, several on
    # a loaded machine (3 s once fell short in CI): a deadline with room for that. The
    # heartbeat TTL is FAST's: the rank's beat renews it whatever the link costs a turn.
    slow: dict[str, Any] = {**PARTIAL, "lookup_timeout_ms": 6000}
    engine = LateEngine(after_s=None)
    meta = LookupMetadata(engine_id=engine_id, world_size=1, worker_id=0)
    server = RedisAsyncLookupServer(engine, meta, config(fault_proxy.url, **slow))
    try:
        ready(server)
        fault_proxy.delay(150)
        client = clients(config(real_server.url, **slow), engine_id, 1)
        alive(client)
        answers: dict[str, int] = {}
        for i in range(3):
            lookup_id = f"slow-{i}"
            client.lookup(TOKENS, lookup_id)
            answers[lookup_id] = answer(client, lookup_id, timeout=30)
            assert answers[lookup_id] == CHUNK  # the confirmed first chunk
            engine.report_now(lookup_id)
        wait_until(
            lambda: server.stats().counts.get("report_settled") == len(answers),
            timeout=15,
            message="every report answered after its partial answer",
        )
        assert engine.broken(answers) == []
        assert server.lifecycle.sizes()["held"] == len(answers)
    finally:
        fault_proxy.clear()
        server.close()
        engine.close()
