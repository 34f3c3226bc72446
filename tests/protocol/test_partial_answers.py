"""Partial answers at the deadline and deadlines that scale with the prompt,
on fakeredis and on a real server.

One rank holds the whole prompt in memory; the other holds its first chunks in memory
and the rest on a slow disk tier, so at the deadline it has confirmed only a prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import CHUNK, MakeClient, MakeServer, alive, answer, prompt
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient, RedisLookupClient
from broker_lookup.ops.inspect import render, snapshot
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, LookupRequest, decode_entry
from broker_lookup.protocol.scripts import deadline_call, progress_call, report_call, submit_call
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(5000)  # 8 chunks
FULL = len(TOKENS)
MEMORY_PREFIX = 2 * CHUNK  # what the slow rank holds in memory
#: The slow rank loads a chunk every 0.6 s: by a 1 s deadline it confirmed 2-4 chunks.
SLOW_LOAD_S = 0.6
PARTIAL: dict[str, Any] = {
    "partial_answers": True,
    "lookup_timeout_ms": 1000,
    "lookup_timeout_per_1k_tokens_ms": 0,
}


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[ReferenceEngine]]:
    fast = ReferenceEngine()
    slow = ReferenceEngine(disk_dir=tmp_path / "slow", load_delay_s=SLOW_LOAD_S)
    yield [fast, slow]
    for engine in (fast, slow):
        engine.close(timeout_s=1.0)


def _stage(client: RedisAsyncLookupClient, engines: list[ReferenceEngine]) -> None:
    hashes, offsets = client.hasher.hashes_and_offsets(TOKENS)
    fast, slow = engines
    fast.store(hashes, offsets)
    slow.store(hashes[:2], offsets[:2])
    slow.store_to_disk(hashes, offsets)


def _ranks(
    make_server: MakeServer, engines: list[ReferenceEngine], **overrides: Any
) -> list[RedisAsyncLookupServer]:
    servers = [make_server(e, rank=r, world_size=2, **overrides) for r, e in enumerate(engines)]
    wait_until(lambda: all(s.ready for s in servers), message="ranks ready")
    return servers


def _pinned(engine: ReferenceEngine) -> int:
    return engine.stats()["pinned_chunks"]


def _started(
    make_server: MakeServer,
    make_client: MakeClient,
    engines: list[ReferenceEngine],
    cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
    **overrides: Any,
) -> RedisAsyncLookupClient:
    settings = {**PARTIAL, **overrides}
    client = make_client(world_size=2, cls=cls, **settings)
    _stage(client, engines)
    _ranks(make_server, engines, **settings)
    alive(client)
    return client


def test_the_deadline_answers_the_prefix_every_rank_confirmed_and_ranks_keep_exactly_it(
    make_server: MakeServer,
    make_client: MakeClient,
    engines: list[ReferenceEngine],
    backend: Backend,
    engine_id: str,
) -> None:
    client = _started(make_server, make_client, engines)
    assert client.lookup(TOKENS, "long") is None
    got = answer(client, "long", timeout=10)
    assert MEMORY_PREFIX <= got < FULL and got % CHUNK == 0
    assert client.stats().outcomes["partial"] == 1
    raw: Any = backend.factory().hgetall(KeySpace(engine_id).lookup("long"))
    fields = lookup_hash.decode(raw)
    assert (fields.state, fields.result, fields.partial) == ("done", got, True)
    assert fields.hits[0] == FULL  # the fast rank's final report counted as confirmed
    # Every rank keeps exactly the answered prefix pinned; the slow one stops loading.
    chunks = got // CHUNK
    wait_until(lambda: [_pinned(e) for e in engines] == [chunks, chunks], message="kept prefix")
    wait_until(lambda: engines[1].stats()["inflight"] == 0, message="slow prefetch stopped")
    assert [_pinned(e) for e in engines] == [chunks, chunks]
    assert client.lookup_cache("long") == got  # terminal until cleared
    client.cancel_lookup("long")
    wait_until(lambda: [_pinned(e) for e in engines] == [0, 0], message="cancel releases all")


def test_clear_then_cancel_after_a_partial_answer_releases_everything(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    client = _started(make_server, make_client, engines)
    client.lookup(TOKENS, "long")
    got = answer(client, "long", timeout=10)
    wait_until(lambda: _pinned(engines[0]) == got // CHUNK, message="fast rank trimmed")
    client.clear_lookup_status("long")  # vLLM clears on allocation, cancels on abort
    assert client.lookup_cache("long") == -1
    client.cancel_lookup("long")
    wait_until(lambda: [_pinned(e) for e in engines] == [0, 0], message="everything released")


def test_clear_while_in_flight_releases_everything_on_every_rank(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    client = _started(make_server, make_client, engines, lookup_timeout_ms=5000)
    client.lookup(TOKENS, "long")
    wait_until(lambda: _pinned(engines[1]) >= 2, message="slow rank pinned its memory prefix")
    client.clear_lookup_status("long")
    wait_until(lambda: [_pinned(e) for e in engines] == [0, 0], message="everything released")


def test_sync_client_returns_the_partial_answer(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    client = _started(make_server, make_client, engines, cls=RedisLookupClient)
    got = client.lookup(TOKENS, "sync")
    assert isinstance(got, int) and MEMORY_PREFIX <= got < FULL
    assert client.lookup_cache("sync") == got


def test_without_partial_answers_the_deadline_answers_0_and_releases_everything(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    client = _started(make_server, make_client, engines, partial_answers=False)
    client.lookup(TOKENS, "long")
    assert answer(client, "long", timeout=10) == 0
    assert client.stats().outcomes["timeout"] == 1
    wait_until(lambda: [_pinned(e) for e in engines] == [0, 0], message="everything released")


def test_a_rank_that_confirmed_nothing_makes_it_0(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    """An engine that reports only once (LMCache's) behaves as today: 0 at the deadline."""
    client = make_client(world_size=2, **PARTIAL)
    _stage(client, engines)
    once = StubEngine("mute")
    servers = [
        make_server(engines[0], rank=0, world_size=2, **PARTIAL),
        make_server(once, rank=1, world_size=2, **PARTIAL),
    ]
    wait_until(lambda: all(s.ready for s in servers))
    alive(client)
    client.lookup(TOKENS, "long")
    assert answer(client, "long", timeout=10) == 0
    assert client.stats().outcomes["timeout"] == 1
    wait_until(lambda: _pinned(engines[0]) == 0, message="the full rank released its pins")
    wait_until(lambda: "long" in once.released, message="the mute rank released too")


# -- the scripts, one by one ----------------------------------------------------------


def _submitted(backend: Backend, engine_id: str, gen: int = 7) -> tuple[Any, KeySpace]:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    request = LookupRequest(
        lookup_id="s",
        gen=gen,
        hashes=[1, 2, 3],
        offsets=[4, 4, 4],
        expected=[0, 1],
        deadline_ms=0,
        tokens=12,
        budget_ms=1000,
    )
    call = submit_call(
        ks, request, expected="0,1", created_ms=0, ttl_ms=60_000, maxlen=100, engine_ttl_ms=60_000
    )
    ScriptSet().call(conn, call)
    return conn, ks


def _progress(conn: Any, ks: KeySpace, rank: int, tokens: int, gen: int = 7) -> str:
    call = progress_call(ks, "s", rank=rank, gen=gen, tokens=tokens)
    return str(ScriptSet().call(conn, call), "ascii")


def _report(conn: Any, ks: KeySpace, rank: int, hits: int = 8, gen: int = 7) -> Any:
    """Rank ``rank``'s report of ``hits`` for lookup "s" (report.lua); the script's answer."""
    call = report_call(
        ks,
        "s",
        rank=rank,
        gen=gen,
        hits=hits,
        done_maxlen=100,
        engine_ttl_ms=60_000,
    )
    return ScriptSet().call(conn, call)


def _deadline(conn: Any, ks: KeySpace, gen: int = 7, answer: bool = True) -> tuple[int, str, str]:
    abort = Abort(lookup_id="s", gen=gen)
    call = deadline_call(ks, abort, maxlen=100, ttl_ms=5000, engine_ttl_ms=60_000, answer=answer)
    value, how, late = ScriptSet().call(conn, call)
    return int(value), how.decode(), late.decode()


def test_progress_is_monotone_respects_generations_and_never_creates_a_key(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = _submitted(backend, engine_id)
    assert _progress(conn, ks, 0, 4) == "recorded"
    assert _progress(conn, ks, 0, 4) == "behind"  # a re-sent report changes nothing
    assert _progress(conn, ks, 0, 0) == "behind"  # a reordered, older one neither
    assert _progress(conn, ks, 0, 8) == "recorded"
    assert _progress(conn, ks, 0, 8, gen=6) == "stale"
    assert _progress(conn, ks, 5, 4) == "unknown_rank"
    assert _progress(conn, ks, 1, 13) == "invalid"  # more than the prompt
    assert conn.hget(ks.lookup("s"), "p0") == b"8"
    _report(conn, ks, 0, hits=12)
    assert _progress(conn, ks, 0, 12) == "reported"
    conn.delete(ks.lookup("s"))
    assert _progress(conn, ks, 1, 4) == "dropped"
    assert not conn.exists(ks.lookup("s"))  # no resurrection


def test_deadline_takes_the_minimum_of_what_each_rank_confirmed(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = _submitted(backend, engine_id)
    _progress(conn, ks, 0, 8)
    _progress(conn, ks, 1, 4)
    assert _deadline(conn, ks) == (4, "partial", "0,1")  # neither rank had reported
    fields = lookup_hash.decode(conn.hgetall(ks.lookup("s")))
    assert (fields.state, fields.result, fields.partial) == ("done", 4, True)
    assert 0 < conn.pttl(ks.lookup("s")) <= 5000
    assert _deadline(conn, ks)[:2] == (4, "partial")  # re-run after a lost reply: same answer
    assert _report(conn, ks, 1, hits=12) == b"settled:4"  # changes nothing; says the answer
    assert _progress(conn, ks, 1, 12) == "settled"
    assert conn.hget(ks.lookup("s"), "result") == b"4"


def test_deadline_with_a_rank_that_confirmed_nothing_cancels(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = _submitted(backend, engine_id)
    _progress(conn, ks, 0, 8)
    before = conn.xlen(ks.requests)
    assert _deadline(conn, ks) == (0, "none", "0,1")
    assert not conn.exists(ks.lookup("s"))
    assert conn.xlen(ks.requests) == before + 1  # the abort: ranks release their pins
    assert _deadline(conn, ks) == (0, "none", "")  # idempotent: still nothing, no key made
    assert not conn.exists(ks.lookup("s"))


def test_deadline_of_a_completed_or_newer_lookup(backend: Backend, engine_id: str) -> None:
    conn, ks = _submitted(backend, engine_id)
    for rank in (0, 1):
        _report(conn, ks, rank)
    assert _deadline(conn, ks) == (8, "complete", "")
    conn, ks = _submitted(backend, engine_id, gen=9)  # a newer attempt holds the key
    assert _deadline(conn, ks, gen=7) == (0, "none", "")
    assert conn.hget(ks.lookup("s"), "gen") == b"9"  # the newer attempt is untouched


def test_a_deadline_without_an_answer_cancels_and_names_the_late_ranks(
    backend: Backend, engine_id: str
) -> None:
    """The client answered 0 at the deadline (partial answers off, or their wait ran out):
    the script cancels even a lookup that completed meanwhile, and names the stragglers."""
    conn, ks = _submitted(backend, engine_id)
    _report(conn, ks, 0)
    _progress(conn, ks, 1, 8)  # confirmed, but the client answers 0 anyway
    before = conn.xlen(ks.requests)
    assert _deadline(conn, ks, answer=False) == (0, "none", "1")
    assert not conn.exists(ks.lookup("s"))
    assert conn.xlen(ks.requests) == before + 1
    conn, ks = _submitted(backend, engine_id, gen=8)
    for rank in (0, 1):
        _report(conn, ks, rank, gen=8)
    assert _deadline(conn, ks, gen=8, answer=False) == (0, "none", "")  # nobody was late
    assert not conn.exists(ks.lookup("s"))  # but its pins are released: the client said 0


def test_the_rank_that_missed_the_deadline_is_counted(
    make_server: MakeServer, make_client: MakeClient
) -> None:
    engines = [StubEngine("instant"), StubEngine()]
    servers = [make_server(e, rank=r, world_size=2) for r, e in enumerate(engines)]
    wait_until(lambda: all(s.ready for s in servers))
    client = make_client(world_size=2, lookup_timeout_ms=500)
    alive(client)
    client.lookup(TOKENS, "late")
    assert answer(client, "late", timeout=5) == 0  # rank 1 never reports

    def late() -> dict[int, int]:
        ins = client.stats().rank_insights
        assert ins is not None
        return {r: v.late for r, v in ins.ranks.items()}

    wait_until(lambda: late() == {0: 0, 1: 1}, message="rank 1 counted late")
    wait_until(lambda: "late" in engines[1].released, message="the cancel still released it")


# -- deadlines that scale with the prompt -----------------------------------------------


def test_a_long_prompt_gets_a_longer_deadline_on_the_wire_and_in_the_key_ttl(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    engine = StubEngine()
    server = make_server(engine, lookup_timeout_per_1k_tokens_ms=500)
    wait_until(lambda: server.ready)
    client = make_client(lookup_timeout_ms=1000, lookup_timeout_per_1k_tokens_ms=500)
    alive(client)
    long = list(range(4000))  # 1,000 chunks: 1000 + 4 x 500 = 3000 ms
    client.lookup(long, "long")
    client.lookup(list(range(32)), "short")
    ks = KeySpace(engine_id)
    conn = backend.factory()
    wait_until(lambda: engine.started_ids() == ["long", "short"])
    entries: Any = conn.xrange(ks.requests)  # the two may ride one batch entry
    sent = [m for _, f in entries for m in decode_entry(f) if isinstance(m, LookupRequest)]
    budgets = {m.lookup_id: m.deadline_ms for m in sent}
    assert budgets["long"] - budgets["short"] >= 1900  # 3000 vs 1000 ms, sent ~together
    assert conn.pttl(ks.lookup("long")) > 3000 + 2000 - 1000  # its deadline + grace, less slack
    wait_until(lambda: client.lookup_cache("short") == 0, timeout=5)  # the base deadline
    assert client.lookup_cache("long") is None  # still within its own
    engine.report("long", 4000)
    assert answer(client, "long", timeout=5) == 4000


def test_inspect_shows_each_ranks_progress_then_the_partial_answer(
    make_server: MakeServer,
    make_client: MakeClient,
    engines: list[ReferenceEngine],
    backend: Backend,
    engine_id: str,
) -> None:
    client = _started(make_server, make_client, engines, lookup_timeout_ms=3000)
    conn = backend.factory()
    ks = KeySpace(engine_id)
    client.lookup(TOKENS, "long")
    wait_until(lambda: conn.hexists(ks.lookup("long"), "p1"), message="the slow rank's progress")
    snap = snapshot(conn, ks, None, 50)
    [item] = snap["lookups"]["shown"]
    loaded = item["progress"][1]
    assert item["missing"] == [1] and MEMORY_PREFIX <= loaded < FULL
    assert f"1(loaded {loaded})" in render(snap, "redis://h:6379/0", None)
    answer(client, "long", timeout=10)
    snap = snapshot(conn, ks, None, 50)
    assert snap["lookups"]["shown"][0]["partial"] is True
    assert "partial" in render(snap, "redis://h:6379/0", None)


def test_a_partial_answer_read_by_reconciliation_counts_as_partial(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    """The listener's reconciliation may read a hash the deadline script just answered
    before the sender reads its reply: the lookup still ends as a partial answer."""
    engines = [StubEngine(), StubEngine()]
    servers = [make_server(e, rank=r, world_size=2) for r, e in enumerate(engines)]
    wait_until(lambda: all(s.ready for s in servers))
    client = make_client(world_size=2, lookup_timeout_ms=5000)
    alive(client)
    client.lookup(TOKENS, "r")
    ks = KeySpace(engine_id)
    conn = backend.factory()
    wait_until(lambda: conn.hget(ks.lookup("r"), "gen") is not None)
    gen = int(conn.hget(ks.lookup("r"), "gen") or 0)
    for rank, tokens in ((0, 8), (1, 4)):
        ScriptSet().call(conn, progress_call(ks, "r", rank=rank, gen=gen, tokens=tokens))
    abort = Abort(lookup_id="r", gen=gen)
    ScriptSet().call(conn, deadline_call(ks, abort, maxlen=100, ttl_ms=5000, engine_ttl_ms=60_000))
    assert answer(client, "r", timeout=3) == 4  # well before its own 5 s deadline
    assert client.stats().outcomes["partial"] == 1
