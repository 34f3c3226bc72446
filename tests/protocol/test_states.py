"""Every client state transition (LMCache's contract: -1, None, then an int), on fakeredis
and on a real server."""

from __future__ import annotations

import time
from typing import Any

import pytest
from faultkit import MakeClient, MakeServer, Serve, alive, answer, ready
from helpers import Backend, lookup_request, text, wait_until

from broker_lookup.client import RedisLookupClient
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import REPORT, SUBMIT, Call, submit_call
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet

TOKENS = list(range(40))  # 10 chunks of 4 tokens


def test_unknown_then_pending_then_result_then_cleared(serve: Serve) -> None:
    engine, _, client = serve(StubEngine())
    assert client.lookup_cache("r1") == -1
    assert client.lookup(TOKENS, "r1") is None
    assert client.lookup_cache("r1") is None
    wait_until(lambda: engine.started_ids() == ["r1"])
    assert client.lookup_cache("r1") is None
    engine.report("r1", 24)
    assert wait_until(lambda: client.lookup_cache("r1") == 24)
    assert client.lookup_cache("r1") == 24  # stable until cleared
    client.clear_lookup_status("r1")
    assert client.lookup_cache("r1") == -1


def test_min_over_ranks_that_differ(serve: Serve, backend: Backend, engine_id: str) -> None:
    engines, _, client = serve.ranks([StubEngine(), StubEngine(), StubEngine()])
    client.lookup(TOKENS, "r1")
    wait_until(lambda: all(e.started_ids() == ["r1"] for e in engines))
    engines[0].report("r1", 40)
    engines[2].report("r1", 12)
    redis = backend.factory()
    wait_until(lambda: redis.hget(KeySpace(engine_id).lookup("r1"), "r2") == b"12")
    assert client.lookup_cache("r1") is None  # rank 1 has not answered
    engines[1].report("r1", 0 + 20)
    assert wait_until(lambda: client.lookup_cache("r1") == 12)
    fields = redis.hgetall(KeySpace(engine_id).lookup("r1"))
    assert fields[b"state"] == b"done" and fields[b"result"] == b"12"
    assert (fields[b"r0"], fields[b"r1"], fields[b"r2"]) == (b"40", b"20", b"12")


def test_duplicate_report_from_one_rank_does_not_complete(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engines, _, client = serve.ranks([StubEngine(), StubEngine()])
    client.lookup(TOKENS, "r1")
    wait_until(lambda: all(e.started_ids() for e in engines))
    engines[0].report("r1", 16)
    ks = KeySpace(engine_id)
    redis = backend.factory()
    wait_until(lambda: redis.hexists(ks.lookup("r1"), "r0"))
    gen = int(text(redis.hget(ks.lookup("r1"), "gen")))
    # A redelivered report of rank 0 (e.g. after a crash and replay) must not count as rank 1.
    again = ScriptSet().call(
        redis, Call(REPORT, (ks.lookup("r1"), ks.done), [0, gen, 16, 1000, "r1", 1000, 60_000])
    )
    assert again == b"duplicate"
    assert client.lookup_cache("r1") is None
    assert redis.hget(ks.lookup("r1"), "state") == b"pending"
    engines[1].report("r1", 8)
    assert wait_until(lambda: client.lookup_cache("r1") == 8)


def test_timeout_is_terminal_zero_and_cancels(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engine, server, client = serve(StubEngine(), lookup_timeout_ms=300)  # it never reports
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    assert wait_until(lambda: client.lookup_cache("r1") == 0, timeout=3)
    for _ in range(3):
        assert client.lookup_cache("r1") == 0  # re-polls: 0 again, never raise (LMCache D4)
    redis = backend.factory()
    wait_until(
        lambda: not redis.exists(KeySpace(engine_id).lookup("r1")),
        message="timeout deletes the lookup key",
    )
    wait_until(lambda: server.stats().counts.get("aborts", 0) == 1)
    engine.report("r1", 40)  # the slow prefetch finishes after the timeout
    wait_until(lambda: engine.released == ["r1"], message="rank releases the pinned memory")
    assert not redis.exists(KeySpace(engine_id).lookup("r1"))  # the late report changed nothing
    assert client.stats().outcomes["timeout"] == 1
    client.clear_lookup_status("r1")
    assert client.lookup_cache("r1") == -1


def test_timeout_fires_without_polling(serve: Serve) -> None:
    engine, server, client = serve(StubEngine(), lookup_timeout_ms=200)
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    # Nobody polls: the listener's sweep still ends it and tells the rank (LMCache D11).
    wait_until(lambda: server.stats().counts.get("aborts", 0) == 1, timeout=3)
    assert client.stats().outcomes["timeout"] == 1
    engine.report("r1", 40)
    wait_until(lambda: engine.released == ["r1"])
    assert client.lookup_cache("r1") == 0


def test_cancel_before_the_rank_starts(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    engine = StubEngine()
    client = make_client()
    redis = backend.factory()
    # A heartbeat without a consuming server: the request waits in the stream.
    ks = KeySpace(engine_id)
    redis.set(ks.heartbeat(0), "{}", px=60000)
    alive(client)
    redis.xgroup_create(ks.requests, ks.group(0), id="0", mkstream=True)
    client.lookup(TOKENS, "r1")
    wait_until(lambda: redis.exists(ks.lookup("r1")))
    client.cancel_lookup("r1")
    wait_until(lambda: not redis.exists(ks.lookup("r1")))
    assert client.lookup_cache("r1") == -1
    server = make_server(engine)  # starts now: sees the lookup, then its abort
    ready(server)
    wait_until(lambda: server.stats().counts.get("aborted", 0) == 1)
    assert engine.started_ids() == []


def test_cancel_during_prefetch_releases_when_it_finishes(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engine, server, client = serve(StubEngine())
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    client.cancel_lookup("r1")
    wait_until(lambda: server.stats().counts.get("aborts", 0) == 1)
    assert engine.released == []  # still prefetching: nothing to release yet
    engine.report("r1", 40)  # the prefetch finishes late
    wait_until(lambda: engine.released == ["r1"])
    redis = backend.factory()
    assert not redis.exists(KeySpace(engine_id).lookup("r1"))  # no resurrected key
    assert client.lookup_cache("r1") == -1


def test_cancel_after_prefetch_releases_at_once(serve: Serve) -> None:
    engine, server, client = serve(StubEngine("instant", hits=40))
    client.lookup(TOKENS, "r1")
    assert wait_until(lambda: client.lookup_cache("r1") == 40)
    assert engine.released == []  # pins are held for the retrieve
    client.cancel_lookup("r1")
    wait_until(lambda: engine.released == ["r1"])
    assert server.stats().held == 0


def test_late_report_after_cancel_resurrects_no_key(
    backend: Backend, engine_id: str, make_client: MakeClient
) -> None:
    client = make_client()
    ks = KeySpace(engine_id)
    redis = backend.factory()
    redis.set(ks.heartbeat(0), "{}", px=60000)
    alive(client)
    client.lookup(TOKENS, "r1")
    wait_until(lambda: redis.exists(ks.lookup("r1")))
    gen = int(text(redis.hget(ks.lookup("r1"), "gen")))
    client.cancel_lookup("r1")
    wait_until(lambda: not redis.exists(ks.lookup("r1")))
    late = ScriptSet().call(
        redis, Call(REPORT, (ks.lookup("r1"), ks.done), [0, gen, 40, 1000, "r1", 1000, 60_000])
    )
    assert late == b"dropped"
    assert not redis.exists(ks.lookup("r1"))


def test_id_reuse_gets_a_new_generation(serve: Serve, backend: Backend, engine_id: str) -> None:
    engine, _, client = serve(StubEngine())
    ks = KeySpace(engine_id)
    redis = backend.factory()
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    gen1 = int(text(redis.hget(ks.lookup("r1"), "gen")))
    client.clear_lookup_status("r1")  # e.g. preempted before allocation
    client.lookup(TOKENS, "r1")
    wait_until(lambda: int(redis.hget(ks.lookup("r1"), "gen") or 0) > gen1)
    # Attempt 1's report arrives now: it is stale and must not complete attempt 2.
    stale = ScriptSet().call(
        redis, Call(REPORT, (ks.lookup("r1"), ks.done), [0, gen1, 40, 1000, "r1", 1000, 60_000])
    )
    assert stale == b"stale"
    assert client.lookup_cache("r1") is None
    engine.report("r1", 40)  # the engine finishes attempt 1 (superseded: released, not sent)
    wait_until(lambda: engine.started_ids() == ["r1", "r1"], message="attempt 2 starts after 1")
    assert "r1" in engine.released
    engine.report("r1", 8)
    assert wait_until(lambda: client.lookup_cache("r1") == 8)


def test_short_prompt_answers_zero_without_a_round_trip(
    make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    client = make_client()
    assert client.lookup([1, 2, 3], "tiny") == 0
    # Recorded like any finished lookup: its 0 stays until cleared.
    assert client.lookup_cache("tiny") == 0
    assert client.stats().outcomes["miss"] == 1
    assert not backend.factory().exists(KeySpace(engine_id).lookup("tiny"))
    client.clear_lookup_status("tiny")
    assert client.lookup_cache("tiny") == -1


def test_dead_rank_answers_zero_at_once(
    make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    client = make_client(world_size=2, lookup_timeout_ms=30000)
    started = time.monotonic()
    assert client.lookup(TOKENS, "r1") == 0
    assert client.lookup_cache("r1") == 0
    assert time.monotonic() - started < 1.0
    assert client.stats().outcomes["dead_rank"] == 1
    assert not backend.factory().exists(KeySpace(engine_id).lookup("r1"))


def test_sync_client_returns_the_int(serve: Serve) -> None:
    _, _, client = serve(StubEngine("instant", hits=20), cls=RedisLookupClient)
    assert client.lookup(TOKENS, "r1") == 20
    assert client.lookup_cache("r1") == 20
    assert client.lookup_cache("nope") == -1


#: Pins live 4 s on a rank; the longest deadline (2.5 s) leaves 1.5 s, of which 1 s is kept.
RETAINED: dict[str, Any] = {
    "worker_pin_ttl_ms": 4000,
    "lookup_timeout_ms": 1000,
    "result_retention_ms": 1000,
}


def test_a_result_older_than_its_retention_answers_minus_one(serve: Serve) -> None:
    # The ranks release a result's pins worker_pin_ttl_ms after taking them. A hit answered
    # after its retention would promise pins that may be gone, whenever the listener's
    # eviction sweep (every few seconds) comes: lookup_cache itself judges the age.
    _, _, client = serve(StubEngine("instant", hits=24), rank_config=RETAINED, **RETAINED)
    client.lookup(TOKENS, "r1")
    assert answer(client, "r1", timeout=10) == 24
    answered = time.monotonic()  # the result was recorded at or before this
    wait_until(lambda: time.monotonic() >= answered + 1.0, message="the retention passed")
    assert client.lookup_cache("r1") == -1
    client.lookup(TOKENS, "r1")  # asked again, as the scheduler does after -1
    assert answer(client, "r1", timeout=10) == 24


def test_cancel_after_clear_still_releases_the_pins(serve: Serve) -> None:
    # vLLM clears a lookup when it allocates the request and cancels it on abort.
    engine, _, client = serve(StubEngine())
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", 24)
    assert wait_until(lambda: client.lookup_cache("r1") == 24)
    client.clear_lookup_status("r1")
    assert engine.released == []  # held for the retrieve
    client.cancel_lookup("r1")
    wait_until(lambda: engine.released == ["r1"], message="the abort reached the rank")
    client.cancel_lookup("r1")  # a second cancel has nothing left to release
    assert client.lookup_cache("r1") == -1


def test_a_resubmitted_generation_keeps_the_reports_already_recorded(
    backend: Backend, engine_id: str
) -> None:
    # The reply to a submit pipeline is lost after the server ran it, and the batch is
    # sent again: the fast rank's report must survive and no second entry is written.
    ks, scripts, conn = KeySpace(engine_id), ScriptSet(), backend.factory()
    key = ks.lookup("r1")
    request = lookup_request("r1", 7, chunks=10, expected=[0, 1], deadline_ms=2)
    submit = submit_call(
        ks, request, expected="0,1", created_ms=1, ttl_ms=60_000, maxlen=100, engine_ttl_ms=60_000
    )
    scripts.call(conn, submit)
    assert scripts.call(
        conn, Call(REPORT, (key, ks.done), [0, 7, 24, 100, "r1", 1000, 60_000])
    ) == (b"recorded")
    assert scripts.call(conn, submit) == b"duplicate"
    assert conn.hget(key, "r0") == b"24" and conn.xlen(ks.requests) == 1
    assert scripts.call(
        conn, Call(REPORT, (key, ks.done), [1, 7, 16, 100, "r1", 1000, 60_000])
    ) == (b"complete")
    assert conn.hget(key, "result") == b"16"
    # A newer generation still replaces the hash.
    scripts.call(conn, Call(SUBMIT, (key, ks.requests), [8, *submit.args[1:]]))
    assert conn.hget(key, "gen") == b"8" and conn.hget(key, "r0") is None


def test_lookups_queued_behind_a_slow_sender_are_not_taken_for_vanished(
    serve: Serve,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A burst keeps the sender over a second behind: the listener's reconcile must not
    # answer those lookups 0 as "vanished from Redis" before they were even written.
    _, _, client = serve(StubEngine("instant", hits=20), lookup_timeout_ms=5000)
    sender = client._sender
    original = sender._send_batch
    gate = {"first": True}

    def behind(link: Any, conn: Any, batch: Any) -> Any:
        if gate["first"]:
            gate["first"] = False
            sender._stop.wait(1.5)  # the sender's own thread, as a long burst would
        return original(link, conn, batch)

    monkeypatch.setattr(sender, "_send_batch", behind)
    for i in range(20):
        client.lookup(TOKENS, f"q{i}")
    for i in range(20):
        assert answer(client, f"q{i}", timeout=10) == 20
    assert client.stats().outcomes["error"] == 0
    assert not [r for r in caplog.records if "vanished" in r.getMessage()]
