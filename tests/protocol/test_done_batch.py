"""A ``report.lua`` batch that completes several lookups writes one done entry for them all
(one XADD a batch), the client answers each of them, and the rules hold as they did for an
entry a lookup: a batch sent again after a lost reply writes no second completion, a fenced
batch writes nothing, insights travel per lookup, a completed hash keeps its submit's TTL,
and an entry that does not decode whole completes what it can. On fakeredis and on a real
server."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from faultkit import Serve
from helpers import Backend, lookup_request, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import DoneEvent, decode_completions
from broker_lookup.protocol.scripts import (
    BatchItem,
    report_answers,
    report_batch_call,
    report_call,
    submit_call,
)
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet
from workers.pipeline.reporter import MAX_BATCH

ENGINE_TTL_MS = 600_000
SUBMIT_TTL_MS = 60_000
TOKENS = list(range(40))  # 10 chunks of 4 tokens


def _submit(
    conn: Any, ks: KeySpace, lookup_id: str, expected: str = "0", *, insights: bool = False
) -> None:
    ranks = [int(r) for r in expected.split(",")]
    request = lookup_request(lookup_id, 7, chunks=10, expected=ranks)
    call = submit_call(
        ks,
        request,
        expected=expected,
        created_ms=1,
        ttl_ms=SUBMIT_TTL_MS,
        maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
        insights=insights,
    )
    assert ScriptSet().call(conn, call)


def _batch(
    conn: Any,
    ks: KeySpace,
    items: list[BatchItem],
    fence: tuple[str, str] | None = None,
    done_maxlen: int = 100,
) -> list[bytes]:
    call = report_batch_call(
        ks,
        items,
        rank=0,
        done_maxlen=done_maxlen,
        engine_ttl_ms=ENGINE_TTL_MS,
        fence=fence,
    )
    answers = report_answers(ScriptSet().call(conn, call), len(items))
    assert all(isinstance(a, bytes) for a in answers), answers
    return [a for a in answers if isinstance(a, bytes)]


def _entries(conn: Any, ks: KeySpace) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in conn.xrange(ks.done)]


def _events(conn: Any, ks: KeySpace) -> list[DoneEvent]:
    out: list[DoneEvent] = []
    for fields in _entries(conn, ks):
        events, problem = decode_completions(fields)
        assert problem is None, problem
        out += events
    return out


def test_a_batch_completing_several_lookups_writes_one_entry(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    for lookup_id in "abc":
        _submit(conn, ks, lookup_id)
    _submit(conn, ks, "w", "0,1")  # still owed rank 1's report
    items = [BatchItem("a", 7, 8), BatchItem("w", 7, 4), BatchItem("b", 7, 0)]
    items.append(BatchItem("c", 7, 40))
    assert _batch(conn, ks, items) == [b"complete", b"recorded", b"complete", b"complete"]
    [entry] = _entries(conn, ks)
    # Readable in redis-cli: the count, the first as a lone entry has it, then by index.
    assert entry == {
        b"n": b"3",
        b"id": b"a",
        b"gen": b"7",
        b"result": b"8",
        b"id.1": b"b",
        b"gen.1": b"7",
        b"result.1": b"0",
        b"id.2": b"c",
        b"gen.2": b"7",
        b"result.2": b"40",
    }
    assert _events(conn, ks) == [
        DoneEvent(lookup_id="a", gen=7, result=8),
        DoneEvent(lookup_id="b", gen=7, result=0),
        DoneEvent(lookup_id="c", gen=7, result=40),
    ]
    # A completed hash keeps the TTL its submit gave it: it never goes without one, and
    # its completion costs no PEXPIRE.
    for lookup_id in "abcw":
        assert 5000 < conn.pttl(ks.lookup(lookup_id)) <= SUBMIT_TTL_MS, lookup_id
    # A single report that completes still writes today's entry.
    _submit(conn, ks, "s")
    single = report_call(ks, "s", rank=0, gen=7, hits=12, done_maxlen=100, engine_ttl_ms=1000)
    assert ScriptSet().call(conn, single) == b"complete"
    assert _entries(conn, ks)[-1] == {b"id": b"s", b"gen": b"7", b"result": b"12"}


def test_a_batch_sent_again_after_a_lost_reply_writes_no_second_completion(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    for lookup_id in "ab":
        _submit(conn, ks, lookup_id)
    items = [BatchItem("a", 7, 8), BatchItem("b", 7, 12)]
    assert _batch(conn, ks, items) == [b"complete", b"complete"]
    before = {k: conn.hgetall(ks.lookup(k)) for k in "ab"}
    assert _batch(conn, ks, items) == [b"duplicate", b"duplicate"]  # its reply was lost
    assert {k: conn.hgetall(ks.lookup(k)) for k in "ab"} == before
    assert [(e.lookup_id, e.result) for e in _events(conn, ks)] == [("a", 8), ("b", 12)]


def test_a_fenced_batch_writes_no_completion(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    for lookup_id in "ab":
        _submit(conn, ks, lookup_id)
    lease = ks.owner("0")
    conn.set(lease, "new-token holder", px=60_000)  # another process took the rank over
    items = [BatchItem("a", 7, 8), BatchItem("b", 7, 12)]
    assert _batch(conn, ks, items, fence=(lease, "old-token")) == [b"fenced", b"fenced"]
    assert not conn.exists(ks.done)
    assert conn.hget(ks.lookup("a"), "state") == b"pending"
    assert _batch(conn, ks, items, fence=(lease, "new-token")) == [b"complete", b"complete"]
    assert [e.lookup_id for e in _events(conn, ks)] == ["a", "b"]
    assert len(_entries(conn, ks)) == 1


def test_insights_travel_per_lookup_in_a_multi_completion_entry(
    backend: Backend, engine_id: str
) -> None:
    """A stamped lookup's completion carries its own ranks, hits and latency under its
    index; an unstamped one beside it carries none."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "t0", insights=True)
    _submit(conn, ks, "u1")
    _submit(conn, ks, "t2", insights=True)
    items = [BatchItem("t0", 7, 8), BatchItem("u1", 7, 12), BatchItem("t2", 7, 16)]
    assert _batch(conn, ks, items) == [b"complete"] * 3
    [entry] = _entries(conn, ks)
    assert entry[b"last"] == b"0" and entry[b"ranks"] == b"0" and entry[b"hits"] == b"8"
    assert b"last.1" not in entry
    assert entry[b"last.2"] == b"0" and entry[b"hits.2"] == b"16"
    t0, u1, t2 = _events(conn, ks)
    assert (t0.lookup_id, t0.last, t0.ranks, t0.hits) == ("t0", 0, (0,), (8,))
    assert (u1.lookup_id, u1.last, u1.ranks) == ("u1", None, ())
    assert (t2.lookup_id, t2.last, t2.ranks, t2.hits) == ("t2", 0, (0,), (16,))
    for ev, lookup_id in ((t0, "t0"), (t2, "t2")):
        stored: Any = conn.hget(ks.lookup(lookup_id), lookup_hash.latency_field(0))
        assert ev.latency_us == (int(stored),)


def _report_as_rank0(conn: Any, ks: KeySpace, hits: dict[str, int]) -> list[bytes]:
    """Rank 0's batch for lookups the client sent (their generations read from the hashes)."""
    items = [BatchItem(i, int(conn.hget(ks.lookup(i), "gen")), h) for i, h in hits.items()]
    return _batch(conn, ks, items)


def test_the_client_answers_every_lookup_of_a_multi_completion_entry(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engines, _, client = serve.ranks([StubEngine()], rank_insights_max_per_s=0)
    conn, ks = backend.factory(), KeySpace(engine_id)
    hits = {"m0": 40, "m1": 0, "m2": 12}
    for lookup_id in hits:
        assert client.lookup(TOKENS, lookup_id) is None
    wait_until(lambda: set(hits) <= set(engines[0].started_ids()))
    assert _report_as_rank0(conn, ks, hits) == [b"complete"] * 3
    assert len(_entries(conn, ks)) == 1
    assert wait_until(lambda: all(client.lookup_cache(i) is not None for i in hits))
    assert {i: client.lookup_cache(i) for i in hits} == hits
    assert client.stats().outcomes.get("hit") == 2 and client.stats().outcomes.get("miss") == 1
    insights = client.stats().rank_insights
    assert insights is not None and insights.recorded == 3  # each lookup's own figures


def test_a_malformed_multi_entry_completes_what_it_can(
    serve: Serve,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines, _, client = serve.ranks([StubEngine()])
    assert isinstance(client, RedisAsyncLookupClient)
    conn, ks = backend.factory(), KeySpace(engine_id)
    for lookup_id in ("g0", "bad", "g2"):
        assert client.lookup(TOKENS, lookup_id) is None
    wait_until(lambda: {"g0", "bad", "g2"} <= set(engines[0].started_ids()))
    gen: dict[str, Any] = {i: conn.hget(ks.lookup(i), "gen") for i in ("g0", "bad", "g2")}
    caplog.set_level(logging.ERROR, logger="broker_lookup.client.listener")
    entry: dict[Any, Any] = {
        "n": 3,
        "id": "g0",
        "gen": gen["g0"],
        "result": 8,
        "id.1": "bad",
        "gen.1": gen["bad"],
        "result.1": "not a number",
        "id.2": "g2",
        "gen.2": gen["g2"],
        "result.2": 4,
    }
    conn.xadd(ks.done, entry)
    assert wait_until(lambda: client.lookup_cache("g2") is not None)
    assert (client.lookup_cache("g0"), client.lookup_cache("g2")) == (8, 4)
    listener: Any = client._listener  # the counter lives on the listener
    assert listener.bad_entries == 1
    assert any("completion 1 of 3" in r.getMessage() for r in caplog.records)
    # The one that did not decode is answered from its hash, once a rank completes it.
    assert _report_as_rank0(conn, ks, {"bad": 16}) == [b"complete"]
    assert wait_until(lambda: client.lookup_cache("bad") == 16)


def test_a_rank_s_largest_batch_of_timed_completions_fits_one_entry(
    backend: Backend, engine_id: str
) -> None:
    """Every completion timed (the longest entry), as many as a rank sends in one call:
    the entry stays within what the script can pass to XADD."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    ids = [f"big{i}" for i in range(MAX_BATCH)]
    for lookup_id in ids:
        _submit(conn, ks, lookup_id, insights=True)
    assert _batch(conn, ks, [BatchItem(i, 7, 4) for i in ids]) == [b"complete"] * MAX_BATCH
    [entry] = _entries(conn, ks)
    assert entry[b"n"] == str(MAX_BATCH).encode() and len(entry) == 1 + 7 * MAX_BATCH
    events = _events(conn, ks)
    assert [e.lookup_id for e in events] == ids
    assert all(e.last == 0 and e.hits == (4,) for e in events)


def test_the_done_streams_cap_counts_completions_not_entries(
    backend: Backend, engine_id: str
) -> None:
    """``done_maxlen`` bounds the completions the done stream holds: an entry of n trims it
    to about done_maxlen / n entries."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    cap, size = 128, 64
    for b in range(10):
        ids = [f"cap-{b}-{i}" for i in range(size)]
        for lookup_id in ids:
            _submit(conn, ks, lookup_id)
        items = [BatchItem(lookup_id, 7, 4) for lookup_id in ids]
        assert _batch(conn, ks, items, done_maxlen=cap) == [b"complete"] * size
    events = _events(conn, ks)
    assert [e.lookup_id for e in events[-size:]] == [f"cap-9-{i}" for i in range(size)]
    # Trimming is approximate (whole nodes): at most about twice the cap, not 640.
    assert len(events) <= 2 * cap
