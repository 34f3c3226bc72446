"""Bad input on both sides. The scheduler's path never raises: any str id is served, what
the protocol cannot carry is answered 0, counted by kind and logged once; ``validate`` is
the strict opt-in. A rank dead-letters what reaches its stream anyway (reason in
``bl:{E}:dead``, counted, acked) and goes on."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import pytest
from faultkit import CHUNK, MakeClient, MakeServer, Serve, alive, answer, prompt, ready
from helpers import Backend, lookup_request, stream_entries, stream_fields, wait_until

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.errors import ConfigError, InvalidRequest
from broker_lookup.protocol.keys import DIGEST_MARK, KeySpace
from broker_lookup.protocol.scripts import REPORT, Call, submit_call
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet

TOKENS = prompt(0, chunks=10)
LIMITS: dict[str, Any] = {"max_chunks_per_request": 16, "max_request_configs_bytes": 64}


#: Ids a client's X-Request-Id header can carry into vLLM's request id: all are served.
HOSTILE_IDS = [
    "has space",
    "héllo",
    "日本語",
    "tab\tid",
    "new\nline",
    "req-1\n",  # plain but for a trailing newline, which ``$`` would have let through
    "\x00",
    "{brace}",
    "x" * 300,
]


@pytest.mark.parametrize("lookup_id", HOSTILE_IDS)
def test_any_str_id_is_served(
    serve: Serve, backend: Backend, engine_id: str, lookup_id: str
) -> None:
    engine, _, client = serve(StubEngine("instant", hits=24))
    assert client.lookup(TOKENS, lookup_id) is None
    assert answer(client, lookup_id, timeout=10) == 24
    assert engine.started_ids() == [lookup_id]  # the engine sees the caller's plain id
    keys = KeySpace(engine_id)
    key = keys.lookup(lookup_id)
    assert backend.factory().hget(key, "id") == lookup_id.encode()  # redis-cli shows it
    # Keyed by its digest: no id a key should not hold reaches the server's key space.
    assert backend.factory().keys(keys.lookup_pattern) == [key.encode()]
    assert key.startswith(keys.lookup_pattern[:-1] + DIGEST_MARK)
    client.cancel_lookup(lookup_id)
    assert client.lookup_cache(lookup_id) == -1
    wait_until(lambda: lookup_id in engine.released, message="the abort reached the rank")


@pytest.mark.parametrize(
    ("lookup_id", "kind"),
    [("", "bad_id"), ("x" * 4097, "bad_id"), ("lone \udc80", "bad_id"), (42, "bad_id")],
)
def test_ids_the_wire_cannot_carry_answer_zero(
    make_client: MakeClient, backend: Backend, engine_id: str, lookup_id: Any, kind: str
) -> None:
    client = make_client()
    assert client.lookup(TOKENS, lookup_id) == 0
    if isinstance(lookup_id, str):
        assert client.lookup_cache(lookup_id) == 0  # recorded like any answer
        client.clear_lookup_status(lookup_id)
        assert client.lookup_cache(lookup_id) == -1
    assert client.stats().rejected == {kind: 1}
    assert not backend.factory().exists(KeySpace(engine_id).requests)


@pytest.mark.parametrize(
    ("tokens", "configs", "kind"),
    [
        (TOKENS, {"lmcache.tag.user": "x" * 100}, "configs_too_large"),
        (TOKENS, {1: "int key"}, "bad_configs"),
        (TOKENS, ["not", "a", "dict"], "bad_configs"),
        (TOKENS, {"k": object()}, "bad_configs"),
        (["a", "b", "c", "d"], None, "bad_tokens"),
        ([1.5] * 8, None, "bad_tokens"),
        (None, None, "bad_tokens"),
        ("a prompt", None, "bad_tokens"),
    ],
)
def test_bad_requests_answer_zero_count_and_log_once(
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
    tokens: Any,
    configs: Any,
    kind: str,
) -> None:
    client = make_client(**LIMITS)
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for i in range(5):
            assert client.lookup(tokens, f"r{i}", configs) == 0
            assert client.lookup_cache(f"r{i}") == 0
    assert client.stats().rejected == {kind: 5}
    assert client.stats().outcomes["rejected"] == 5
    logged = [r for r in caplog.records if kind in r.getMessage()]
    assert len(logged) == 1, "logged once, not once per request"
    assert not backend.factory().exists(KeySpace(engine_id).requests)


def test_a_prompt_over_the_chunk_limit_is_looked_up_by_its_prefix(serve: Serve) -> None:
    engine, _, client = serve(StubEngine("instant", hits=10_000), rank_config=LIMITS, **LIMITS)
    client.lookup(prompt(0, chunks=40), "long")
    # The first 16 chunks are a prefix: a hit on them is a right answer, not a guess.
    assert answer(client, "long", timeout=10) == 16 * CHUNK
    assert len(engine.started[0][1]) == 16
    assert client.stats().truncated == 1


def test_unhashable_ids_never_raise(make_client: MakeClient) -> None:
    client = make_client()
    client.lookup(TOKENS, "r0")  # a non-empty table: an empty dict does not hash its key
    assert client.lookup(TOKENS, ["a", "list"]) == 0  # type: ignore[arg-type]
    assert client.lookup_cache(["a", "list"]) == -1  # type: ignore[arg-type]
    client.clear_lookup_status({"a": 1})  # type: ignore[arg-type]
    client.cancel_lookup(["x"])  # type: ignore[arg-type]
    # Each call counted once: the lookup and the lookup_cache as bad ids.
    assert client.stats().rejected == {"bad_id": 2, "bad_clear": 1, "bad_cancel": 1}


def test_an_internal_error_answers_zero(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client()

    def broken(*args: Any) -> None:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(client._table, "add", broken)
    assert client.lookup(TOKENS, "r1") == 0
    assert client.stats().rejected == {"internal_error": 1}


@pytest.mark.parametrize(
    ("tokens", "lookup_id", "configs", "match"),
    [
        (TOKENS, "has space", None, "printable ASCII"),
        (TOKENS, "x" * 4097, None, "lookup_id length"),
        (prompt(0, chunks=17), "r1", None, "max_chunks_per_request=16"),
        (TOKENS, "r1", {"lmcache.tag.user": "x" * 100}, "max_request_configs_bytes=64"),
        (["a"] * 8, "r1", None, "tokens must be ints"),
    ],
)
def test_validate_is_the_strict_opt_in(
    make_client: MakeClient, tokens: Any, lookup_id: str, configs: Any, match: str
) -> None:
    client = make_client(**LIMITS)
    with pytest.raises(InvalidRequest, match=match):
        client.validate(tokens, lookup_id, configs)
    client.validate(TOKENS, "cmpl-1", {"lmcache.tag.user": "u"})  # a valid one passes


def test_client_refuses_unknown_ranks() -> None:
    meta = LookupMetadata(engine_id="e", world_size=2)
    from broker_lookup.config import expected_ranks

    with pytest.raises(ConfigError, match="outside world_size=2"):
        expected_ranks(LookupConfig(lookup_server_worker_ids=(0, 7)), meta)


_ENC = msgspec.msgpack.Encoder()


def _lookup(**changes: Any) -> bytes:
    fields = {
        "type": "lookup",
        "lookup_id": "bad",
        "gen": 1,
        "hashes": [1, 2],
        "offsets": [CHUNK, CHUNK],
        "expected": [0, 1],
        "deadline_ms": int(time.time() * 1000) + 60_000,
        "tokens": 2 * CHUNK,
    }
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
    ({"m": _lookup(lookup_id="x" * 4097)}, "length 4097"),
    ({"m": _lookup(lookup_id="")}, "length 0"),
    ({"m": _lookup(hashes=list(range(17)), offsets=[CHUNK] * 17, tokens=17 * CHUNK)}, "chunks"),
    ({"m": _lookup(hashes=[], offsets=[], tokens=0)}, "chunks"),
    ({"m": _lookup(offsets=[CHUNK])}, "offsets"),
    ({"m": _lookup(offsets=[-4, 12])}, "positive"),
    ({"m": _lookup(expected=[])}, "expected ranks"),
    ({"m": _lookup(expected=[0, 5])}, "world_size=2"),
    ({"m": _lookup(tokens=10**6)}, "sum of offsets"),
    ({"m": _lookup(request_configs={"k": "v" * 100})}, "max_request_configs_bytes=64"),
    ({"m": _ENC.encode({"type": "abort", "lookup_id": "", "gen": 1})}, "length 0"),
    # Batch entries that can't be split into parts: parked whole.
    ({"type": "batch", "m0": _lookup()}, "without a count"),
    ({"type": "batch", "n": "zero", "m0": _lookup()}, "without a count"),
    ({"type": "batch", "n": "0", "m0": _lookup()}, "outside 1..3"),
    ({"type": "batch", "n": "1000000", "m0": _lookup()}, "outside 1..3"),
]


def test_rank_dead_letters_bad_entries_and_goes_on(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    engines = [StubEngine("instant", hits=24), StubEngine("instant", hits=32)]
    servers = [make_server(e, rank=r, world_size=2, **LIMITS) for r, e in enumerate(engines)]
    ready(*servers)
    conn = backend.factory()
    want = {conn.xadd(ks.requests, stream_fields(fields)): why for fields, why in BAD_ENTRIES}
    n = len(BAD_ENTRIES)
    wait_until(lambda: all(s.stats().consumer.dead_letters == n for s in servers))
    # A dead letter is counted when its XADD is queued; it lands with the batch's round trip.
    wait_until(lambda: len(stream_entries(conn.xrange(ks.dead))) >= 2 * n)
    letters = stream_entries(conn.xrange(ks.dead))
    assert len(letters) == 2 * n  # every rank parks every bad entry, once
    for _, f in letters:
        assert want[f[b"entry"]] in f[b"reason"].decode(), (f[b"entry"], f[b"reason"])
    assert all(e.started_ids() == [] for e in engines)
    # Acked right after they were parked.
    wait_until(lambda: all(conn.xpending(ks.requests, ks.group(r))["pending"] == 0 for r in (0, 1)))
    client = make_client(world_size=2)
    alive(client)
    client.lookup(TOKENS, "good")
    assert answer(client, "good", timeout=10) == 24
    assert all(s.stats().alive for s in servers)


def test_a_batch_entry_serves_its_good_parts_and_parks_each_bad_one(
    make_server: MakeServer, backend: Backend, engine_id: str
) -> None:
    """A batch entry's part that can't be served costs only itself: every rank serves the
    others, parks each bad part in ``bl:{E}:dead`` named by its place, and acks the entry."""
    ks = KeySpace(engine_id)
    engines = [StubEngine("instant", hits=24), StubEngine("instant", hits=32)]
    servers = [make_server(e, rank=r, world_size=2, **LIMITS) for r, e in enumerate(engines)]
    ready(*servers)
    conn = backend.factory()
    parts: dict[str, bytes | int] = {
        "m0": _lookup(lookup_id="ok-1"),
        "m1": b"\xc1\xff\x00garbage",
        # m2 is missing
        "m3": _lookup(lookup_id="far", expected=[0, 5]),
        "m4": _ENC.encode({"type": "abort", "lookup_id": "ok-1", "gen": 1}),
        "m5": _lookup(lookup_id="ok-2", gen=3),
    }
    entry = conn.xadd(ks.requests, stream_fields({"type": "batch", "n": 6, **parts}))
    wait_until(lambda: all(sorted(e.started_ids()) == ["ok-1", "ok-2"] for e in engines))
    wait_until(lambda: len(stream_entries(conn.xrange(ks.dead))) >= 2 * 4)
    letters = stream_entries(conn.xrange(ks.dead))
    assert all(f[b"entry"] == entry for _, f in letters)
    reasons = sorted(f[b"reason"].decode() for _, f in letters)
    for rank_letters in (reasons[0::2], reasons[1::2]):  # each rank parks the same four
        assert [r.split(":")[0] for r in rank_letters] == [f"part {i} of 6" for i in (1, 2, 3, 4)]
    assert "undecodable 'm1'" in reasons[0] and "no 'm2' field" in reasons[2]
    assert "world_size=2" in reasons[4] and "not a lookup" in reasons[6]
    assert all(s.stats().consumer.dead_letters == 4 for s in servers)
    wait_until(lambda: all(conn.xpending(ks.requests, ks.group(r))["pending"] == 0 for r in (0, 1)))


def test_request_for_other_ranks_is_not_served(make_server: MakeServer) -> None:
    engine, server, ks, conn = make_server.lone(rank=0, world_size=2)
    conn.xadd(ks.requests, {"m": _lookup(expected=[1])})
    wait_until(lambda: server.stats().counts.get("not_expected") == 1)
    assert engine.started_ids() == []
    assert server.stats().consumer.dead_letters == 0  # valid, just not for rank 0


@pytest.mark.parametrize("hits", [-5, 10**9, 3.5, True, None, "12"])
def test_engine_reporting_nonsense_reports_zero(
    serve: Serve, caplog: pytest.LogCaptureFixture, hits: Any
) -> None:
    caplog.set_level(logging.ERROR, logger="workers")
    engine, server, client = serve(StubEngine())
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", hits)
    assert answer(client, "r1", timeout=10) == 0
    assert server.stats().counts["engine_invalid_hits"] == 1
    assert any("r1" in r.getMessage() and repr(hits) in r.getMessage() for r in caplog.records)
    client.lookup(TOKENS, "r2")
    wait_until(lambda: "r2" in engine.started_ids())
    engine.report("r2", 8)
    assert answer(client, "r2", timeout=10) == 8


def test_report_script_refuses_unknown_ranks_and_bad_counts(
    backend: Backend, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    scripts = ScriptSet()
    key = ks.lookup("s1")
    request = lookup_request("s1", 3, chunks=10, expected=[0, 1], deadline_ms=2)
    submit = submit_call(
        ks, request, expected="0,1", created_ms=1, ttl_ms=60_000, maxlen=100, engine_ttl_ms=60_000
    )
    scripts.call(conn, submit)

    def report(rank: int, hits: str | int) -> object:
        return scripts.call(
            conn, Call(REPORT, (key, ks.done), [rank, 3, hits, 100, "s1", 1000, 60_000])
        )

    assert report(5, 8) == b"unknown_rank"
    assert report(0, -1) == b"invalid"
    assert report(0, 41) == b"invalid"
    assert report(0, "2.5") == b"invalid"
    assert report(0, "NaN") == b"invalid"
    fields = conn.hgetall(key)
    assert b"r0" not in fields and b"r5" not in fields and fields[b"state"] == b"pending"
    assert report(0, 40) == b"recorded" and report(1, 16) == b"complete"
    assert conn.hget(key, "result") == b"16"
