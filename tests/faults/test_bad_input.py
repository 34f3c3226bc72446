"""Bad input on both sides: the client refuses it with InvalidRequest; a rank dead-letters
what reaches its stream anyway (reason in ``bl:{E}:dead``, counted, acked) and goes on."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
from engines import InstantEngine, ManualEngine
from faultkit import CHUNK, answer, prompt, ready
from helpers import wait_until

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.errors import ConfigError, InvalidRequest
from broker_lookup.keys import KeySpace
from broker_lookup.scripts import REPORT, SUBMIT, Call, ScriptSet

TOKENS = prompt(0, chunks=10)
LIMITS = {"max_chunks_per_request": 16, "max_request_configs_bytes": 64}


@pytest.mark.parametrize(
    "lookup_id",
    ["", "x" * 257, "héllo", "has space", "tab\tid", "new\nline", "\x00", 42, None, b"bytes"],
)
def test_client_refuses_bad_lookup_ids(make_client, backend, engine_id, lookup_id):
    client = make_client()
    with pytest.raises(InvalidRequest, match="lookup_id"):
        client.lookup(TOKENS, lookup_id)
    assert client.stats()["entries"] == 0
    assert not backend.factory().exists(KeySpace(engine_id).requests)


@pytest.mark.parametrize(
    ("tokens", "configs", "match"),
    [
        (prompt(0, chunks=17), None, "max_chunks_per_request=16"),
        (TOKENS, {"lmcache.tag.user": "x" * 100}, "max_request_configs_bytes=64"),
        (TOKENS, {1: "int key"}, "str keys"),
        (TOKENS, ["not", "a", "dict"], "dict"),
        (TOKENS, {"k": object()}, "JSON-serialisable"),
        (["a", "b", "c", "d"], None, "tokens must be ints"),
        ([1.5] * 8, None, "tokens must be ints"),
        (None, None, "tokens must be"),
        ("a prompt", None, "tokens must be"),
    ],
)
def test_client_refuses_oversized_or_mistyped_requests(
    make_client, backend, engine_id, tokens, configs, match
):
    client = make_client(**LIMITS)
    with pytest.raises(InvalidRequest, match=match):
        client.lookup(tokens, "r1", configs)
    assert client.stats()["entries"] == 0
    assert not backend.factory().exists(KeySpace(engine_id).requests)


def test_client_refuses_unknown_ranks():
    meta = LookupMetadata(engine_id="e", world_size=2)
    from broker_lookup.config import expected_ranks

    with pytest.raises(ConfigError, match="outside world_size=2"):
        expected_ranks(LookupConfig(lookup_server_worker_ids=(0, 7)), meta)


_ENC = msgspec.msgpack.Encoder()


def _lookup(**changes: Any) -> bytes:
    fields = {
        "type": "lookup", "lookup_id": "bad", "gen": 1, "hashes": [1, 2],
        "offsets": [CHUNK, CHUNK], "expected": [0, 1],
        "deadline_ms": int(time.time() * 1000) + 60_000, "tokens": 2 * CHUNK,
    }  # fmt: skip
    return _ENC.encode({**fields, **changes})


#: Stream entries a rank must refuse, and a word of the reason it must give.
BAD_ENTRIES: list[tuple[dict[str, Any], str]] = [
    ({"type": "lookup", "id": "x"}, "no 'm' field"),
    ({"m": b"\xc1\xff\x00garbage"}, "undecodable"),
    ({"m": _ENC.encode({"x": 1})}, "undecodable"),
    ({"m": _ENC.encode([1, 2, 3])}, "undecodable"),
    ({"m": _lookup(type="explode")}, "undecodable"),
    ({"m": _lookup(gen="one")}, "undecodable"),
    ({"m": _lookup(hashes="not a list")}, "undecodable"),
    ({"m": _lookup(lookup_id="x" * 300)}, "length 300"),
    ({"m": _lookup(lookup_id="has space")}, "printable ASCII"),
    ({"m": _lookup(hashes=list(range(17)), offsets=[CHUNK] * 17, tokens=17 * CHUNK)}, "chunks"),
    ({"m": _lookup(hashes=[], offsets=[], tokens=0)}, "chunks"),
    ({"m": _lookup(offsets=[CHUNK])}, "offsets"),
    ({"m": _lookup(offsets=[-4, 12])}, "positive"),
    ({"m": _lookup(expected=[])}, "expected ranks"),
    ({"m": _lookup(expected=[0, 5])}, "world_size=2"),
    ({"m": _lookup(tokens=10**6)}, "sum of offsets"),
    ({"m": _lookup(request_configs={"k": "v" * 100})}, "max_request_configs_bytes=64"),
    ({"m": _ENC.encode({"type": "abort", "lookup_id": "has space", "gen": 1})}, "printable"),
]


def test_rank_dead_letters_bad_entries_and_goes_on(make_server, make_client, backend, engine_id):
    ks = KeySpace(engine_id)
    engines = [InstantEngine(hits=24), InstantEngine(hits=32)]
    servers = [make_server(e, rank=r, world_size=2, **LIMITS) for r, e in enumerate(engines)]
    ready(*servers)
    conn = backend.factory()
    want = {conn.xadd(ks.requests, fields): why for fields, why in BAD_ENTRIES}
    n = len(BAD_ENTRIES)
    wait_until(lambda: all(s.stats()["consumer"]["dead_letters"] == n for s in servers))
    letters = conn.xrange(ks.dead)
    assert len(letters) == 2 * n  # every rank parks every bad entry
    for _, f in letters:
        assert want[f[b"entry"]] in f[b"reason"].decode(), (f[b"entry"], f[b"reason"])
    assert all(e.started_ids() == [] for e in engines)
    for rank in (0, 1):
        assert conn.xpending(ks.requests, ks.group(rank))["pending"] == 0
    client = make_client(world_size=2)
    wait_until(lambda: not client.stats()["dead_ranks"])
    client.lookup(TOKENS, "good")
    assert answer(client, "good", timeout=10) == 24
    assert all(s.stats()["alive"] for s in servers)


def test_request_for_other_ranks_is_not_served(make_server, backend, engine_id):
    ks = KeySpace(engine_id)
    engine = ManualEngine()
    server = make_server(engine, rank=0, world_size=2)
    ready(server)
    backend.factory().xadd(ks.requests, {"m": _lookup(expected=[1])})
    wait_until(lambda: server.stats()["counts"].get("not_expected") == 1)
    assert engine.started_ids() == []
    assert server.stats()["consumer"]["dead_letters"] == 0  # valid, just not for rank 0


@pytest.mark.parametrize("hits", [-5, 10**9, 3.5, True, None, "12"])
def test_engine_reporting_nonsense_reports_zero(make_server, make_client, caplog, hits):
    caplog.set_level(logging.ERROR, logger="workers")
    engine = ManualEngine()
    server = make_server(engine)
    ready(server)
    client = make_client()
    wait_until(lambda: not client.stats()["dead_ranks"])
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", hits)
    assert answer(client, "r1", timeout=10) == 0
    assert server.stats()["counts"]["engine_invalid_hits"] == 1
    assert any("r1" in r.getMessage() and repr(hits) in r.getMessage() for r in caplog.records)
    client.lookup(TOKENS, "r2")
    wait_until(lambda: "r2" in engine.started_ids())
    engine.report("r2", 8)
    assert answer(client, "r2", timeout=10) == 8


def test_report_script_refuses_unknown_ranks_and_bad_counts(backend, engine_id):
    ks = KeySpace(engine_id)
    conn = backend.factory()
    scripts = ScriptSet()
    key = ks.lookup("s1")
    scripts.call(
        conn, Call(SUBMIT, (key, ks.requests), [3, "0,1", 1, 2, 40, 60_000, 100, "m", "x"])
    )

    def report(rank: int, hits: object) -> bytes:
        return scripts.call(conn, Call(REPORT, (key, ks.done), [rank, 3, hits, 100, "s1", 1000]))

    assert report(5, 8) == b"unknown_rank"
    assert report(0, -1) == b"invalid"
    assert report(0, 41) == b"invalid"
    assert report(0, "2.5") == b"invalid"
    assert report(0, "NaN") == b"invalid"
    fields = conn.hgetall(key)
    assert b"r0" not in fields and b"r5" not in fields and fields[b"state"] == b"pending"
    assert report(0, 40) == b"recorded" and report(1, 16) == b"complete"
    assert conn.hget(key, "result") == b"16"
