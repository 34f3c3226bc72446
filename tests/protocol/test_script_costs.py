"""The scripts' cheaper paths keep every rule: a report completes a lookup from its one
read (``owed``, ``lowest``), a retried report changes nothing, a hash an older submit
wrote still completes, and a stream's TTL is set by the XADD that creates it and left to
the beat otherwise. On fakeredis and on a real server."""

from __future__ import annotations

from typing import Any

from helpers import Backend, lookup_request

from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import (
    BatchItem,
    report_answers,
    report_batch_call,
    report_call,
    submit_call,
)
from broker_lookup.transport.script_runner import ScriptSet

ENGINE_TTL_MS = 600_000


def _submit(conn: object, ks: KeySpace, expected: str, gen: int = 7, lookup_id: str = "s") -> None:
    ranks = [int(r) for r in expected.split(",")]
    request = lookup_request(lookup_id, gen, chunks=10, expected=ranks)
    call = submit_call(
        ks,
        request,
        expected=expected,
        created_ms=1,
        ttl_ms=60_000,
        maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
    )
    assert ScriptSet().call(conn, call)  # type: ignore[arg-type]


def _report(conn: object, ks: KeySpace, rank: int, hits: int, gen: int = 7) -> bytes:
    call = report_call(
        ks,
        "s",
        rank=rank,
        gen=gen,
        hits=hits,
        done_maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
    )
    answer: bytes = ScriptSet().call(conn, call)  # type: ignore[arg-type]
    return answer


def test_the_last_report_completes_with_the_fewest_hits(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1,2")
    key = ks.lookup("s")
    assert conn.hmget(key, lookup_hash.OWED, lookup_hash.LOWEST) == [b"3", b"40"]
    assert _report(conn, ks, 0, 30) == b"recorded"
    assert _report(conn, ks, 2, 12) == b"recorded"
    assert conn.hmget(key, lookup_hash.OWED, lookup_hash.LOWEST) == [b"1", b"12"]
    assert conn.hget(key, "state") == b"pending"
    assert _report(conn, ks, 1, 20) == b"complete"
    assert conn.hmget(key, "state", "result", "r0", "r1", "r2") == [
        b"done",
        b"12",
        b"30",
        b"20",
        b"12",
    ]
    # The TTL its submit gave it: a completion pays no PEXPIRE.
    assert 5000 < conn.pttl(key) <= 60_000
    done: Any = conn.xrange(ks.done)
    [(_, fields)] = done
    assert fields[b"result"] == b"12" and fields[b"gen"] == b"7"


def test_a_report_sent_again_after_a_lost_reply_changes_nothing(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1")
    assert _report(conn, ks, 0, 8) == b"recorded"
    assert _report(conn, ks, 0, 8) == b"duplicate"  # its first reply was lost
    assert conn.hmget(ks.lookup("s"), lookup_hash.OWED, "state") == [b"1", b"pending"]
    assert _report(conn, ks, 1, 16) == b"complete"
    assert _report(conn, ks, 1, 16) == b"duplicate"
    assert conn.xlen(ks.done) == 1  # one answer, not two
    assert conn.hget(ks.lookup("s"), "result") == b"8"


def test_a_stale_generation_does_not_count_towards_the_owed_reports(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1", gen=8)
    assert _report(conn, ks, 0, 8, gen=7) == b"stale"
    assert conn.hget(ks.lookup("s"), lookup_hash.OWED) == b"2"
    assert _report(conn, ks, 0, 40, gen=8) == b"recorded"
    assert _report(conn, ks, 1, 40, gen=8) == b"complete"
    assert conn.hget(ks.lookup("s"), "result") == b"40"


def test_a_hash_an_older_submit_wrote_still_completes(backend: Backend, engine_id: str) -> None:
    """No ``owed`` field (a client from before it): the ranks' fields are read again."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    key = ks.lookup("s")
    conn.hset(key, mapping={"state": "pending", "gen": 7, "expected": "0,1", "tokens": 40})
    conn.pexpire(key, 60_000)
    assert _report(conn, ks, 1, 24) == b"recorded"
    assert _report(conn, ks, 0, 32) == b"complete"
    assert conn.hmget(key, "state", "result") == [b"done", b"24"]
    assert conn.xlen(ks.done) == 1


def test_a_stream_s_ttl_is_left_to_the_beat_once_the_stream_is_there(
    backend: Backend, engine_id: str
) -> None:
    """The XADD that creates a stream sets its TTL; later ones leave it (every live
    process's beat refreshes it), so a submit or a completion pays no PEXPIRE for it."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0")
    assert ENGINE_TTL_MS - 60_000 < conn.pttl(ks.requests) <= ENGINE_TTL_MS
    conn.pexpire(ks.requests, 100_000)
    conn.delete(ks.lookup("s"))
    _submit(conn, ks, "0", gen=8)
    assert conn.xlen(ks.requests) == 2
    assert 0 < conn.pttl(ks.requests) <= 100_000  # not set again
    conn.xadd(ks.done, {"x": "1"})
    conn.pexpire(ks.done, 100_000)
    assert _report(conn, ks, 0, 4, gen=8) == b"complete"
    assert conn.xlen(ks.done) == 2
    assert 0 < conn.pttl(ks.done) <= 100_000


def _batch(
    conn: object, ks: KeySpace, items: list[BatchItem], fence: tuple[str, str] | None = None
) -> list[bytes]:
    call = report_batch_call(
        ks,
        items,
        rank=0,
        done_maxlen=100,
        engine_ttl_ms=ENGINE_TTL_MS,
        fence=fence,
    )
    result = ScriptSet().call(conn, call)  # type: ignore[arg-type]
    answers = report_answers(result, len(items))
    assert all(isinstance(a, bytes) for a in answers)
    return [a for a in answers if isinstance(a, bytes)]


def test_a_batch_mixing_generations_and_cancelled_lookups_answers_each(
    backend: Backend, engine_id: str
) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1", gen=7, lookup_id="a")
    _submit(conn, ks, "0,1", gen=9, lookup_id="b")
    _submit(conn, ks, "0", gen=3, lookup_id="c")
    _submit(conn, ks, "0", gen=4, lookup_id="gone")
    conn.delete(ks.lookup("gone"))  # cancelled before the batch
    items = [
        BatchItem("a", 7, 8),
        BatchItem("b", 8, 40),  # an older generation of b
        BatchItem("gone", 4, 40),
        BatchItem("c", 3, 16),
        BatchItem("a", 7, 8),  # the same report twice in one batch
        BatchItem("c", 3, 99),  # more hits than tokens: c is answered already anyway
    ]
    assert _batch(conn, ks, items) == [
        b"recorded",
        b"stale",
        b"dropped",
        b"complete",
        b"duplicate",
        b"invalid",
    ]
    assert not conn.exists(ks.lookup("gone"))  # no key resurrected
    assert conn.hmget(ks.lookup("b"), "r0", lookup_hash.OWED) == [None, b"2"]
    assert conn.hmget(ks.lookup("a"), "r0", lookup_hash.OWED, "state") == [b"8", b"1", b"pending"]
    assert conn.hmget(ks.lookup("c"), "state", "result") == [b"done", b"16"]
    done: Any = conn.xrange(ks.done)
    [(_, entry)] = done
    assert entry[b"id"] == b"c" and entry[b"result"] == b"16"


def test_a_batch_sent_again_changes_nothing(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1", gen=7, lookup_id="a")
    _submit(conn, ks, "0", gen=7, lookup_id="b")
    items = [BatchItem("a", 7, 8), BatchItem("b", 7, 12)]
    assert _batch(conn, ks, items) == [b"recorded", b"complete"]
    before = {k: conn.hgetall(ks.lookup(k)) for k in ("a", "b")}
    assert _batch(conn, ks, items) == [b"duplicate", b"duplicate"]  # its reply was lost
    assert {k: conn.hgetall(ks.lookup(k)) for k in ("a", "b")} == before
    assert conn.xlen(ks.done) == 1


def test_a_fenced_batch_records_nothing(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1", gen=7, lookup_id="a")
    _submit(conn, ks, "0", gen=7, lookup_id="b")
    lease = ks.owner("0")
    conn.set(lease, "new-token holder", px=60_000)  # another process took the rank over
    before = {k: conn.hgetall(ks.lookup(k)) for k in ("a", "b")}
    items = [BatchItem("a", 7, 8), BatchItem("b", 7, 12)]
    assert _batch(conn, ks, items, fence=(lease, "old-token")) == [b"fenced", b"fenced"]
    assert _batch(conn, ks, items, fence=(lease, "")) == [b"fenced", b"fenced"]  # no token
    assert {k: conn.hgetall(ks.lookup(k)) for k in ("a", "b")} == before
    assert not conn.exists(ks.done)
    assert _batch(conn, ks, items, fence=(lease, "new-token")) == [b"recorded", b"complete"]


def test_a_single_report_and_a_batch_of_one_agree(backend: Backend, engine_id: str) -> None:
    conn, ks = backend.factory(), KeySpace(engine_id)
    _submit(conn, ks, "0,1", gen=7, lookup_id="s")
    _submit(conn, ks, "0,1", gen=7, lookup_id="t")
    assert _report(conn, ks, 0, 8) == b"recorded"
    assert _batch(conn, ks, [BatchItem("t", 7, 8)]) == [b"recorded"]
    strip = {b"id", b"created_ms"}
    seen = [{k: v for k, v in conn.hgetall(ks.lookup(i)).items() if k not in strip} for i in "st"]
    assert seen[0] == seen[1]
