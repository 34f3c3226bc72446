"""The client's sender sends the submits of one round trip as one ``submit.lua`` batch,
which appends one batch entry for the lookups it registers: each lookup is still
idempotent per its generation (a batch sent again after a lost reply changes nothing, a
duplicate is left out of the entry), an older generation's hash is replaced, the stream's
TTL is set by the write that creates it, and a batch writes what the same submits sent
one by one write. On fakeredis and on a real server."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
from faultkit import MakeServer, Serve, ready
from helpers import Backend, lookup_request, stream_fields, wait_until

from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import (
    Abort,
    LookupRequest,
    batch_field,
    decode_entry,
    decode_request,
    encode_request,
)
from broker_lookup.protocol.scripts import (
    SUBMIT,
    Call,
    cancel_call,
    report_call,
    submit_answers,
    submit_batches,
    submit_call,
)
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet

ENGINE_TTL_MS = 600_000


def _call(ks: KeySpace, lookup_id: str, gen: int, *, insights: bool = False) -> Call:
    request = lookup_request(lookup_id, gen, chunks=10, expected=[0, 1])
    return submit_call(
        ks,
        request,
        expected="0,1",
        created_ms=1,
        ttl_ms=60_000,
        maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
        insights=insights,
    )


def _send(conn: object, calls: list[Call]) -> list[Any]:
    """``calls`` as the sender sends them: packed, run in one round trip, unpacked."""
    packed = submit_batches(calls)
    scripts = ScriptSet()
    results = [scripts.call(conn, call) for call, _ in packed]  # type: ignore[arg-type]
    return submit_answers(results, [n for _, n in packed])


def _parts(conn: Any, ks: KeySpace) -> list[list[tuple[str, int]]]:
    """(lookup id, generation) of each lookup of each lookup entry, in stream order."""
    out = []
    for _, fields in conn.xrange(ks.requests):
        parts = decode_entry(fields)
        if fields[b"type"] in (b"lookup", b"batch"):
            assert all(isinstance(p, LookupRequest) for p in parts), parts
            out.append([(p.lookup_id, p.gen) for p in parts if isinstance(p, LookupRequest)])
    return out


def _report(conn: object, ks: KeySpace, lookup_id: str, rank: int, gen: int) -> Any:
    call = report_call(
        ks,
        lookup_id,
        rank=rank,
        gen=gen,
        hits=8,
        done_maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
    )
    return ScriptSet().call(conn, call)  # type: ignore[arg-type]


def test_consecutive_submits_ride_one_call_and_the_order_is_kept() -> None:
    ks = KeySpace("e")
    cancel = cancel_call(ks, Abort(lookup_id="x", gen=1), maxlen=100, engine_ttl_ms=1)
    calls = [_call(ks, "a", 1), _call(ks, "b", 1), cancel, _call(ks, "c", 1)]
    packed = submit_batches(calls)
    assert [(call.script, n) for call, n in packed] == [(SUBMIT, 2), ("cancel", 1), (SUBMIT, 1)]
    assert packed[0][0].keys == (ks.requests, ks.lookup("a"), ks.lookup("b"))
    assert packed[2][0] is calls[3]  # a run of one goes as the single call it is
    assert [n for _, n in submit_batches([_call(ks, str(i), 1) for i in range(5)], 2)] == [2, 2, 1]
    error = ConnectionError("lost")
    answers = submit_answers([[b"1-0", b"duplicate"], error, b"2-0"], [2, 1, 1])
    assert answers == [b"1-0", b"duplicate", error, b"2-0"]
    assert submit_answers([error], [3]) == [error] * 3  # the whole batch failed


def test_a_batch_sent_again_after_a_lost_reply_changes_nothing(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    calls = [_call(ks, "a", 7), _call(ks, "b", 7), _call(ks, "c", 3)]
    first = _send(conn, calls)
    assert all(isinstance(a, bytes) and a != b"duplicate" for a in first)
    assert len(set(first)) == 1  # one entry carries the three
    assert _parts(conn, ks) == [[("a", 7), ("b", 7), ("c", 3)]]
    assert _report(conn, ks, "a", 0, 7) == b"recorded"  # a fast rank, before the retry
    before = {k: conn.hgetall(ks.lookup(k)) for k in "abc"}
    assert _send(conn, calls) == [b"duplicate"] * 3  # its reply was lost: sent again
    assert {k: conn.hgetall(ks.lookup(k)) for k in "abc"} == before
    assert _parts(conn, ks) == [[("a", 7), ("b", 7), ("c", 3)]]  # no second entry
    assert _report(conn, ks, "a", 1, 7) == b"complete"  # the reports kept still count


def test_a_batch_mixing_generations_and_cancelled_lookups_answers_each(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    assert _send(conn, [_call(ks, "old", 6), _call(ks, "same", 7), _call(ks, "gone", 2)])
    assert _report(conn, ks, "old", 0, 6) == b"recorded"
    ScriptSet().call(
        conn, cancel_call(ks, Abort(lookup_id="gone", gen=2), maxlen=100, engine_ttl_ms=1000)
    )
    assert not conn.exists(ks.lookup("gone"))
    entries = conn.xlen(ks.requests)
    batch = [_call(ks, "old", 7), _call(ks, "same", 7), _call(ks, "gone", 3), _call(ks, "new", 1)]
    answers = _send(conn, batch)
    assert answers[1] == b"duplicate"
    assert all(a != b"duplicate" for i, a in enumerate(answers) if i != 1)
    assert conn.xlen(ks.requests) == entries + 1  # one entry, without the duplicate
    assert _parts(conn, ks)[-1] == [("old", 7), ("gone", 3), ("new", 1)]
    # The older generation's hash is gone with its report: its late reports are stale.
    assert conn.hmget(ks.lookup("old"), "gen", "r0", lookup_hash.OWED) == [b"7", None, b"2"]
    assert _report(conn, ks, "old", 1, 6) == b"stale"
    assert conn.hmget(ks.lookup("gone"), "gen", "state") == [b"3", b"pending"]
    for lookup_id in ("old", "same", "gone", "new"):
        assert 0 < conn.pttl(ks.lookup(lookup_id)) <= 60_000  # nothing without a TTL


def test_a_batch_creating_the_stream_sets_its_ttl_once(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    assert not conn.exists(ks.requests)
    _send(conn, [_call(ks, str(i), 1) for i in range(4)])
    assert conn.xlen(ks.requests) == 1
    assert ENGINE_TTL_MS - 60_000 < conn.pttl(ks.requests) <= ENGINE_TTL_MS
    conn.pexpire(ks.requests, 100_000)
    _send(conn, [_call(ks, str(i), 2) for i in range(4)])
    assert _parts(conn, ks)[1] == [(str(i), 2) for i in range(4)]
    assert 0 < conn.pttl(ks.requests) <= 100_000  # there already: left to the beat


def test_a_batch_writes_what_single_submits_write(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    scripts = ScriptSet()
    for lookup_id, insights in (("s1", False), ("s2", True)):
        scripts.call(conn, _call(ks, lookup_id, 4, insights=insights))
    _send(conn, [_call(ks, "b1", 4), _call(ks, "b2", 4, insights=True)])
    strip = {b"id", lookup_hash.SUBMITTED_US.encode()}

    def seen(lookup_id: str) -> dict[Any, Any]:
        raw: dict[Any, Any] = conn.hgetall(ks.lookup(lookup_id))
        return {k: v for k, v in raw.items() if k not in strip}

    assert seen("s1") == seen("b1") and seen("s2") == seen("b2")
    stamps = conn.hmget(ks.lookup("b1"), lookup_hash.SUBMITTED_US)
    assert stamps == [None]  # no insights, no stamp
    stamp = conn.hget(ks.lookup("b2"), lookup_hash.SUBMITTED_US)
    assert stamp is not None and stamp.isdigit() and len(stamp) >= 16
    entries: Any = conn.xrange(ks.requests)
    assert len(entries) == 3  # s1, s2 alone; b1 and b2 in one batch entry
    # The same requests, their lookup ids aside (s1 sent alone, b1 in the batch).
    alone = [decode_request(fields) for _, fields in entries[:2]]
    assert [(m.lookup_id, m.gen) for m in alone] == [("s1", 4), ("s2", 4)]
    assert entries[2][1][b"type"] == b"batch" and entries[2][1][b"n"] == b"2"
    batched = decode_entry(entries[2][1])
    renamed = zip(alone, ["b1", "b2"], strict=True)
    assert batched == [msgspec.structs.replace(m, lookup_id=b) for m, b in renamed]


def test_a_burst_the_sender_queued_goes_as_one_batch_and_every_lookup_is_answered(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, backend: Backend, engine_id: str
) -> None:
    engine, _, client = serve(StubEngine(), submit_on_caller_thread=False)
    sender = client._sender
    gate, send, run = threading.Event(), sender._send_batch, sender._scripts.run
    sent: list[list[Call]] = []

    def gated(link: Any, redis_client: Any, batch: Any) -> None:
        gate.wait(20)  # the first round trip waits: the rest of the burst queues behind it
        send(link, redis_client, batch)

    def recorded(link: Any, redis_client: Any, calls: Any, *args: Any, **kw: Any) -> Any:
        sent.append(list(calls))
        return run(link, redis_client, calls, *args, **kw)

    monkeypatch.setattr(sender, "_send_batch", gated)
    monkeypatch.setattr(sender._scripts, "run", recorded)
    ids = [f"burst-{i}" for i in range(6)]
    for lookup_id in ids:
        client.lookup(list(range(40)), lookup_id)
    gate.set()
    wait_until(lambda: sorted(engine.started_ids()) == sorted(ids), message="all sent")
    submits = [c for calls in sent for c in calls if c.script == SUBMIT]
    assert len(submits) < len(ids)  # one script call carried several lookups
    assert sum(len(c.keys) - 1 if c.args[0] == "batch" else 1 for c in submits) == len(ids)
    # The rank served them from fewer entries than lookups: a batch entry carried several.
    entries: Any = backend.factory().xrange(KeySpace(engine_id).requests)
    assert len(entries) < len(ids)
    served = [p for _, f in entries for p in decode_entry(f)]
    assert sorted(p.lookup_id for p in served if isinstance(p, LookupRequest)) == sorted(ids)
    for i, lookup_id in enumerate(ids):
        engine.report(lookup_id, 4 * i)
    answers = {lookup_id: 4 * i for i, lookup_id in enumerate(ids)}
    wait_until(lambda: {i: client.lookup_cache(i) for i in ids} == answers, message="every answer")


def test_a_batch_entry_read_before_a_crash_is_served_whole_after_the_restart(
    make_server: MakeServer, backend: Backend, engine_id: str
) -> None:
    """A rank that read a batch entry and died before its ack replays it on restart: every
    lookup the entry carries is served, once, and the entry is acked."""
    ks, conn = KeySpace(engine_id), backend.factory()
    requests = [lookup_request(f"crash-{i}", 1, chunks=4, budget_ms=60_000) for i in range(3)]
    parts: dict[str, bytes | int] = {
        batch_field(i): encode_request(r) for i, r in enumerate(requests)
    }
    conn.xgroup_create(ks.requests, ks.group(0), "$", mkstream=True)
    conn.xadd(ks.requests, stream_fields({"type": "batch", "n": len(parts), **parts}))
    # The rank that died: it read the entry and never acked it.
    assert conn.xreadgroup(ks.group(0), ks.consumer(0), {ks.requests: ">"})
    assert conn.xpending(ks.requests, ks.group(0))["pending"] == 1
    engine = StubEngine("instant", hits=4)
    ready(make_server(engine, rank=0, world_size=1))
    wait_until(lambda: sorted(engine.started_ids()) == [r.lookup_id for r in requests])
    wait_until(lambda: conn.xpending(ks.requests, ks.group(0))["pending"] == 0)
    assert sorted(engine.started_ids()) == [r.lookup_id for r in requests]  # each once


def test_a_batch_trims_the_entries_no_rank_can_serve_any_more(
    backend: Backend, engine_id: str
) -> None:
    """A batch entry counts as one against the stream's cap, and the batch trims the
    entries older than the horizon (the longest a lookup hash lives) by the server's
    clock, so a stream of batch entries holds what can still be served, not 64 times a
    lone submit's stream. Entries within the horizon, and the batch's own, stay."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    now_ms = int(conn.time()[0]) * 1000
    # Two full macro nodes (100 entries each) of old entries, then some within the horizon.
    for i in range(200):
        conn.xadd(ks.requests, {"type": "old"}, id=f"{now_ms - 600_000}-{i}")
    for i in range(5):
        conn.xadd(ks.requests, {"type": "young"}, id=f"{now_ms - 1_000}-{i}")

    def calls(prefix: str) -> list[Call]:
        return [
            submit_call(
                ks,
                lookup_request(f"{prefix}-{i}", 1, chunks=10, expected=[0, 1]),
                expected="0,1",
                created_ms=1,
                ttl_ms=60_000,
                maxlen=10_000,
                engine_ttl_ms=ENGINE_TTL_MS,
            )
            for i in range(3)
        ]

    _send(conn, calls("h"))  # no horizon: nothing trimmed
    assert conn.xlen(ks.requests) == 206
    packed = submit_batches(calls("h2"), horizon_ms=60_000)
    ScriptSet().call(conn, packed[0][0])
    entries: Any = conn.xrange(ks.requests)
    kinds = [f[b"type"] for _, f in entries]
    # Trimming is by whole nodes: the old nodes go, nothing within the horizon does.
    assert kinds.count(b"old") < 200
    assert kinds[-7:] == [b"young"] * 5 + [b"batch"] * 2
