"""Nothing outlives its engine: every key it makes has a TTL of at most ``engine_ttl_ms``,
set by the very write that may create it, and refreshed while any of its processes lives
(so an idle engine loses nothing); a stream that expired anyway comes back with its group."""

from __future__ import annotations

from typing import Any

import pytest
from faultkit import MakeClient, MakeServer, Serve, answer, config, prompt, ready
from helpers import Backend, engine_keys, holds_for, wait_until
from redis.typing import EncodableT, FieldT

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest
from broker_lookup.protocol.scripts import (
    Call,
    cancel_call,
    deadline_call,
    keep_call,
    report_call,
    submit_call,
)
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.link import open_link
from broker_lookup.transport.script_runner import ScriptSet
from workers.pipeline.clock import ServerClock
from workers.pipeline.reader import Reader
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(0, chunks=10)
#: Distinct from every other TTL of the FAST config, so a key carrying it is recognised.
TTL_MS = 30_000
#: Short enough to wait through: the FAST lookup hashes (deadline plus 500 ms) fit under it.
SHORT: dict[str, Any] = {"engine_ttl_ms": 3000, "key_grace_ms": 500}


def _bounded(keys: dict[str, int], ttl_ms: int) -> dict[str, int]:
    """The keys whose TTL is missing or above ``ttl_ms`` (none, when all is well)."""
    return {key: ttl for key, ttl in keys.items() if not 0 < ttl <= ttl_ms}


def test_every_key_of_a_run_expires_within_the_engine_ttl(
    backend: Backend, serve: Serve, engine_id: str
) -> None:
    """Hits, a cancel, a timeout and a dead letter, while the engine lives and after it stopped."""
    conn = backend.factory()
    ttl: dict[str, Any] = {"engine_ttl_ms": TTL_MS}
    (_, slow), _, client = serve.ranks(
        [StubEngine("instant", hits=24), StubEngine()], rank_config=ttl, **ttl
    )
    client.lookup(TOKENS, "hit")
    wait_until(lambda: "hit" in slow.started_ids())
    slow.report("hit", 40)
    assert answer(client, "hit", timeout=10) == 24
    client.lookup(TOKENS, "cancel")
    wait_until(lambda: "cancel" in slow.started_ids())
    client.cancel_lookup("cancel")
    client.lookup(TOKENS, "timeout")  # rank 1 never answers it
    assert answer(client, "timeout", timeout=10) == 0
    conn.xadd(KeySpace(engine_id).requests, {"m": b"junk"})  # dead-lettered by both ranks
    wait_until(lambda: conn.exists(KeySpace(engine_id).dead))

    live = engine_keys(conn, engine_id)
    assert set(KeySpace(engine_id).lasting) <= set(live)
    assert _bounded(live, TTL_MS) == {}
    client.close()
    assert _bounded(engine_keys(conn, engine_id), TTL_MS) == {}


@pytest.mark.parametrize("script", ["submit", "cancel", "deadline", "keep", "report"])
def test_a_script_that_creates_a_stream_sets_its_ttl(
    backend: Backend, engine_id: str, script: str
) -> None:
    """No process beats for this engine: the TTL comes from the script's own write, so a
    process that dies right after it leaves no key without one."""
    conn, scripts, ks = backend.factory(), ScriptSet(), KeySpace(engine_id)
    abort, ttl = Abort(lookup_id="s", gen=7), TTL_MS
    request = LookupRequest(
        lookup_id="s", gen=7, hashes=[1, 2], offsets=[4, 4], expected=[0], deadline_ms=2, tokens=8
    )
    calls: dict[str, Call] = {
        "submit": submit_call(
            ks, request, expected="0", created_ms=1, ttl_ms=60_000, maxlen=100, engine_ttl_ms=ttl
        ),
        "cancel": cancel_call(ks, abort, maxlen=100, engine_ttl_ms=ttl),
        "deadline": deadline_call(ks, abort, maxlen=100, ttl_ms=1000, engine_ttl_ms=ttl),
        "keep": keep_call(ks, Keep(lookup_id="s", gen=7, tokens=4), maxlen=100, engine_ttl_ms=ttl),
        "report": report_call(ks, "s", rank=0, gen=7, hits=8, done_maxlen=100, engine_ttl_ms=ttl),
    }
    if script in ("keep", "report"):  # they write only for a lookup in the right state
        partial = 1 if script == "keep" else 0
        state: dict[FieldT, EncodableT] = {"state": "pending", "gen": 7, "expected": "0"}
        state.update(tokens=8, partial=partial)
        conn.hset(ks.lookup("s"), mapping=state)
    stream = ks.done if script == "report" else ks.requests
    assert not conn.exists(stream)
    scripts.call(conn, calls[script])
    assert conn.exists(stream)
    assert 0 < conn.pttl(stream) <= TTL_MS


def test_the_rank_sets_the_ttl_of_the_streams_it_creates(backend: Backend, engine_id: str) -> None:
    """The group's MKSTREAM and a dead letter's XADD each come with the stream's PEXPIRE."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    reader = Reader(config(engine_ttl_ms=TTL_MS), ks, 0, ServerClock())
    link = open_link(backend.factory())
    reader.ensure_group(link)
    assert 0 < conn.pttl(ks.requests) <= TTL_MS
    conn.xadd(ks.requests, {"m": b"junk"})
    reader.parse(link.call([reader.read_command()])[0])  # its own pending entries: none
    batch = reader.parse(link.call([reader.read_command()])[0])
    assert len(batch.dead) == 2
    for reply in link.call(batch.dead):
        assert not isinstance(reply, Exception)
    assert 0 < conn.pttl(ks.dead) <= TTL_MS


def test_an_idle_live_engine_keeps_its_keys_past_the_ttl(
    backend: Backend, make_server: MakeServer, make_client: MakeClient, engine_id: str
) -> None:
    """No lookup for twice the TTL: the beats keep every lasting key, and lookups still work."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    ready(make_server(StubEngine("instant", hits=24), **SHORT))
    client = make_client(**SHORT)
    client.lookup(TOKENS, "before")
    assert answer(client, "before", timeout=10) == 24
    conn.xadd(ks.dead, {"reason": "made by the test"})  # so every lasting key exists

    def all_there() -> bool:
        return all(conn.exists(key) for key in ks.lasting)

    holds_for(all_there, 2 * SHORT["engine_ttl_ms"] / 1000, message="every lasting key there")
    client.lookup(TOKENS, "after")
    assert answer(client, "after", timeout=10) == 24
    assert _bounded(engine_keys(conn, engine_id), SHORT["engine_ttl_ms"]) == {}


def test_a_rank_recreates_its_group_when_the_streams_expired(
    backend: Backend, make_server: MakeServer, make_client: MakeClient, engine_id: str
) -> None:
    """The streams expire under a live engine (as if every process had been paused past
    the TTL): the rank's read finds no group, creates it again, and lookups are answered."""
    conn, ks = backend.factory(), KeySpace(engine_id)
    server = make_server(StubEngine("instant", hits=24))
    ready(server)
    client = make_client()
    client.lookup(TOKENS, "before")
    assert answer(client, "before", timeout=10) == 24
    for key in ks.lasting:
        conn.pexpire(key, 1)
    # The rank's next read finds no group and creates it again (the stream with it), so
    # "every key gone" may last a few ms only: wait for the rank to have seen it instead
    # (NOGROUP from a real server; fakeredis answers a read of a missing stream otherwise).
    wait_until(lambda: _noticed(server) >= 1, message="the rank saw its group gone")
    client.lookup(TOKENS, "after")
    assert answer(client, "after", timeout=10) == 24
    assert 0 < conn.pttl(ks.requests) <= client.config.engine_ttl_ms


def _noticed(server: RedisAsyncLookupServer) -> int:
    consumer = server.stats().consumer
    return consumer.nogroup + consumer.redis_errors
