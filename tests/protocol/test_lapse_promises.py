"""A lapse never costs a promise, on fakeredis and on a real server, in-process ranks:

* a report fenced while this process holds the rank's lease again (Redis holds a newer
  token of its own, one whose claim's reply it never got) is sent again under that token
  once the beat learns it, and recorded;
* a report fenced because another process took the rank over is not sent again; but a job
  whose progress reached Redis keeps that prefix pinned (a partial answer may stand on
  it), while one without progress is released.

The beat is stopped in these tests, and renewed by hand, so each step is decided by the
test and not by a timer.
"""

from __future__ import annotations

import json
from typing import Any

from faultkit import CHUNK, Serve, answer, prompt
from helpers import Backend, wait_until

from broker_lookup.protocol.keys import rank_role
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(7000, chunks=4)
FULL = len(TOKENS)
PARTIAL: dict[str, Any] = {
    "partial_answers": True,
    "lookup_timeout_ms": 1000,
    "lookup_timeout_per_1k_tokens_ms": 0,
}


def _count(server: RedisAsyncLookupServer, name: str) -> int:
    return server.stats().counts.get(name, 0)


def _owner_key(server: RedisAsyncLookupServer) -> str:
    return server.keys.owner(rank_role(server.rank))


def test_a_report_fenced_by_a_lapse_is_sent_again_under_the_token_held_then(
    serve: Serve, backend: Backend
) -> None:
    engine, server, client = serve(StubEngine("manual"))
    conn = backend.factory()
    client.lookup(TOKENS, "lapse")
    wait_until(lambda: "lapse" in engine.started_ids(), message="the engine started it")
    assert server.beat.stop(5.0)  # renewals by hand from here
    old = server.lease.token
    assert old is not None
    epoch = int(old.split(".", 1)[0])
    newer = f"{epoch + 1}.{old.split('.', 1)[1]}"
    # A claim of this process whose reply it never got: Redis holds a newer token of ours.
    conn.set(_owner_key(server), f"{newer} {server.lease.identity.encode()}", px=60_000)
    engine.report("lapse", FULL)
    wait_until(lambda: _count(server, "reports_resent") == 1, message="fenced, queued again")
    assert client.lookup_cache("lapse") is None  # nothing recorded under the old token
    server.beat.renew(conn, None)  # the beat's next renewal learns the token
    assert server.lease.token == newer
    assert answer(client, "lapse", timeout=10) == FULL
    wait_until(lambda: server.lifecycle.sizes()["held"] == 1, message="its pins held")
    assert _count(server, "report_complete") == 1
    assert _count(server, "report_fenced") == 0
    assert "lapse" not in engine.released


def test_a_report_fenced_by_a_takeover_keeps_the_progress_that_reached_redis(
    serve: Serve, backend: Backend
) -> None:
    engine, server, client = serve(StubEngine("manual"), rank_config=PARTIAL, **PARTIAL)
    conn = backend.factory()
    for lookup_id in ("progressed", "silent"):
        client.lookup(TOKENS, lookup_id)
    wait_until(lambda: len(engine.started_ids()) == 2, message="the engine started both")
    server.send_progress_to_scheduler("progressed", 2 * CHUNK)
    wait_until(lambda: _count(server, "progress_recorded") == 1, message="progress in Redis")
    assert server.beat.stop(5.0)
    # Another process took the rank over (this one was cut off past its lease).
    other = {"host": "elsewhere", "pid": 1, "started_ms": 1, "nonce": "other"}
    conn.set(_owner_key(server), f"99.other {json.dumps(other)}", px=60_000)
    server.beat.renew(conn, None)
    assert server.lease.holder is not None
    engine.report("progressed", FULL)
    engine.report("silent", FULL)
    wait_until(lambda: _count(server, "report_fenced") == 2, message="both fenced")
    assert _count(server, "reports_resent") == 0  # another process's: its answer stands
    # The promise may stand on the progress: that prefix is held, as a keep holds it.
    assert server.lifecycle.sizes()["held"] == 1
    assert engine.released == ["silent"]
