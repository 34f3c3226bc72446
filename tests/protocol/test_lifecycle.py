"""The rank's lifecycle of a lookup id against a real stream, on fakeredis and a real server:
an engine that never reports, the generation race (a new lookup under a reused id), clock
skew, NOGROUP.

Lookups are written the way the client writes them (a ``pending`` hash and a stream
entry), so each test controls exactly which generation the hash holds when.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from faultkit import MakeServer, Serve, answer, hold_reports, prompt
from helpers import epoch_ms, lookup_request, request_entry, text, wait_until

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from workers import server as server_module
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(0, chunks=10)


def _submit(
    conn: redis.Redis, ks: KeySpace, lookup_id: str, gen: int, entry_id: str = "*", **changes: Any
) -> Any:
    """What submit.lua does for one rank: a fresh pending hash of ``gen``, then the entry."""
    fields = {"deadline_ms": epoch_ms() + 60_000, "budget_ms": 60_000, **changes}
    req = lookup_request(lookup_id, gen, **fields)
    key = ks.lookup(lookup_id)
    conn.delete(key)
    conn.hset(key, mapping={"state": "pending", "gen": gen, "expected": "0", "tokens": 8})
    conn.pexpire(key, 60_000)
    return conn.xadd(ks.requests, request_entry(req), id=entry_id)


def _hash(conn: redis.Redis, ks: KeySpace, lookup_id: str) -> dict[str, str]:
    fields = conn.hgetall(ks.lookup(lookup_id))
    assert isinstance(fields, dict)
    return {text(k): text(v) for k, v in fields.items()}


def _counts(server: RedisAsyncLookupServer) -> dict[str, int]:
    counts: dict[str, int] = server.stats().counts
    return counts


def test_engine_that_never_reports_is_answered_zero_released_and_the_id_reused(
    serve: Serve,
) -> None:
    grace = {"worker_watchdog_grace_ms": 300}
    engine, server, client = serve(StubEngine(), rank_config=grace, lookup_timeout_ms=800)
    client.lookup(TOKENS, "never")
    wait_until(lambda: engine.started_ids() == ["never"])
    assert answer(client, "never", timeout=10) == 0  # the timeout: an answer, not a hang
    # The engine never reports: the watchdog releases its memory after deadline + grace.
    wait_until(lambda: _counts(server).get("watchdog") == 1, timeout=10)
    assert engine.released == ["never"]
    assert server.stats().running == 0
    client.clear_lookup_status("never")
    client.lookup(TOKENS, "never")  # a later generation of the same id is served normally
    wait_until(lambda: engine.started_ids() == ["never", "never"])
    engine.report("never", 24)
    assert answer(client, "never", timeout=10) == 24
    assert engine.released == ["never"]  # the new generation's pins are held


def test_watchdog_reports_zero_itself_and_a_late_report_only_releases_again(
    make_server: MakeServer,
) -> None:
    engine, server, ks, conn = make_server.lone(worker_watchdog_grace_ms=200)
    _submit(conn, ks, "d9", gen=1, budget_ms=300)
    wait_until(lambda: engine.started_ids() == ["d9"])
    # Reported 0 by the rank, not by the client's timeout (nothing else writes the hash).
    wait_until(lambda: _hash(conn, ks, "d9").get("result") == "0", timeout=10)
    assert _hash(conn, ks, "d9")["r0"] == "0"
    assert engine.released == ["d9"]
    engine.report("d9", 8)  # LMCache's engine answering after all: too late
    assert _counts(server)["report_late"] == 1
    assert _hash(conn, ks, "d9")["result"] == "0"
    # What it pinned when its prefetch ended, after the watchdog's release, is released.
    assert engine.released == ["d9", "d9"]


def test_an_idle_rank_sleeps_and_the_watchdog_still_fires_on_time(
    make_server: MakeServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweeper has no idle tick: with nothing due it sleeps (here up to a minute), and
    the lookup's watchdog timer rings it, so the engine's silence is still answered 0."""
    monkeypatch.setattr(server_module, "SWEEP_IDLE_S", 60.0)
    engine, server, ks, conn = make_server.lone(worker_watchdog_grace_ms=200)
    sweeper = server._sweeper
    before = sweeper.sweeps
    time.sleep(0.5)  # ten sweeps of the old 50 ms tick
    assert sweeper.sweeps - before <= 1
    _submit(conn, ks, "quiet", gen=1, budget_ms=300)
    wait_until(lambda: engine.started_ids() == ["quiet"])
    wait_until(lambda: _hash(conn, ks, "quiet").get("result") == "0", timeout=10)
    assert _counts(server)["watchdog"] == 1
    assert engine.released == ["quiet"]


def test_stale_answer_of_an_old_generation_never_releases_the_new_one(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, server, ks, conn = make_server.lone()
    gate = hold_reports(server, monkeypatch)  # holds gen 1's report between engine and Redis
    _submit(conn, ks, "race", gen=1)
    wait_until(lambda: engine.started_ids() == ["race"])
    engine.report("race", 8)  # gen 1 is now reporting
    _submit(conn, ks, "race", gen=2)  # the client reused the id: the hash holds gen 2
    wait_until(lambda: _counts(server).get("queued") == 1)
    assert engine.started_ids() == ["race"]  # gen 2 waits: gen 1 is still in the engine
    gate.set()
    wait_until(lambda: _counts(server).get("report_stale") == 1)
    wait_until(lambda: engine.started_ids() == ["race", "race"])
    assert engine.released == ["race"]  # gen 1 released before gen 2 reached the engine
    engine.report("race", 8)
    wait_until(lambda: _hash(conn, ks, "race").get("result") == "8")
    assert _hash(conn, ks, "race")["gen"] == "2"
    # The rank marks gen 2 held once report.lua's reply reaches it, just after the hash.
    wait_until(lambda: server.stats().held == 1)
    assert engine.released == ["race"]  # gen 2 is held, not freed by gen 1's answer


def test_clock_skew_between_client_and_rank_does_not_drop_work(make_server: MakeServer) -> None:
    engine, server, ks, conn = make_server.lone()
    # A client 3 s ahead: its deadline_ms looks far off, but the budget counts from the
    # server's stamp, which is 10 s old here (the stream's first entry): expired, dropped.
    old = f"{epoch_ms() - 10_000}-1"
    _submit(conn, ks, "ahead", 1, old, deadline_ms=epoch_ms() + 3000, budget_ms=1500)
    wait_until(lambda: _counts(server).get("expired") == 1, timeout=10)
    # A client whose clock is 3 s behind: its deadline_ms is already past for this host.
    _submit(conn, ks, "behind", gen=1, deadline_ms=epoch_ms() - 3000, budget_ms=1500)
    wait_until(lambda: engine.started_ids() == ["behind"])
    assert _counts(server)["expired"] == 1


def test_group_recreated_after_nogroup_starts_at_zero(make_server: MakeServer) -> None:
    engine, server, ks, conn = make_server.lone()
    # Gone, and an entry written in the same transaction, so before the rank can notice:
    # a group re-created at $ would skip it.
    pipe = conn.pipeline(transaction=True)
    pipe.xgroup_destroy(ks.requests, ks.group(0))
    _submit(pipe, ks, "window", gen=1)
    pipe.execute()
    wait_until(lambda: engine.started_ids() == ["window"], timeout=10)
    assert server.stats().consumer.nogroup >= 1
    engine.report("window", 8)
    wait_until(lambda: _hash(conn, ks, "window").get("result") == "8")
    wait_until(lambda: conn.xpending(ks.requests, ks.group(0))["pending"] == 0)
