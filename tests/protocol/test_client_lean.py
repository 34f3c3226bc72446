"""The client's sender and listener over the transport's lean link (transport/link.py).

On fakeredis and a real server they talk over a :class:`LeanLink`; on Redis Cluster
over a :class:`ClientLink` (redis-py's pipeline), through the same calls. These tests
pin what the client needs of the link (errors as values, NOSCRIPT recovery on the
sender's own connection, RESP3 replies, reconnect after a kill, no connection left at
close).
"""

from __future__ import annotations

import time
from typing import Any, cast

import fakeredis
import pytest
import redis
from faultkit import MakeServer, Serve, alive, config, ready
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.client.sender import HEALTHY_IDLE_S
from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import CANCEL, Call
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.link import ClientLink, LeanLink, open_link
from broker_lookup.transport.script_runner import ScriptSet

TOKENS = list(range(40))  # 10 chunks of 4 tokens
real_only = pytest.mark.parametrize("backend", ["real"], indirect=True)


def test_a_lean_link_wherever_the_client_has_a_plain_pool(backend: Backend) -> None:
    assert isinstance(open_link(fakeredis.FakeRedis()), LeanLink)
    assert isinstance(open_link(cast(redis.Redis, object())), ClientLink)
    link = open_link(backend.factory())
    assert isinstance(link, LeanLink)
    link.close()


def test_errors_come_back_as_values_and_the_rest_still_answers(backend: Backend) -> None:
    link = open_link(backend.factory())
    try:
        replies = link.call([("PING",), ("NO-SUCH-COMMAND",), ("ECHO", b"x")])
        assert replies[0] == b"PONG"
        assert isinstance(replies[1], redis.ResponseError)
        assert replies[2] == b"x"
    finally:
        link.close()


def test_scripts_are_reloaded_after_a_flush(backend: Backend, engine_id: str) -> None:
    admin = backend.factory()
    client = backend.factory()
    link = open_link(client)
    assert isinstance(link, LeanLink)
    ks = KeySpace(engine_id)
    call = Call(CANCEL, (ks.lookup("w1"), ks.requests), [1, 100, 60_000, "type", "abort"])
    try:
        admin.script_flush()
        assert ScriptSet().run(link, client, [call]) == [0]  # NOSCRIPT, loaded, run once
        assert admin.xlen(ks.requests) == 1
    finally:
        link.close()


@real_only
def test_lookups_complete_over_the_link_and_survive_a_killed_connection(
    serve: Serve, backend: Backend
) -> None:
    engine, _, client = serve(StubEngine())
    client.lookup(TOKENS, "w1")
    wait_until(lambda: engine.started_ids() == ["w1"])
    engine.report("w1", 12)
    assert wait_until(lambda: client.lookup_cache("w1") == 12)
    assert isinstance(client._sender._writes._link, LeanLink)  # the sender's one link
    backend.factory().client_kill_filter(_type="normal", skipme=True)
    wait_until(lambda: not client.stats().breaker_open, timeout=10)
    client.lookup(TOKENS, "w2")  # the sender's first write finds its connection dead
    wait_until(lambda: "w2" in engine.started_ids(), timeout=10, message="w2 reached the rank")
    engine.report("w2", 8)
    assert wait_until(lambda: client.lookup_cache("w2") == 8, timeout=10)


@real_only
def test_resp3_replies_are_read_too(
    make_server: MakeServer, backend: Backend, engine_id: str
) -> None:
    engine = StubEngine()
    ready(make_server(engine))
    assert backend.url is not None
    sep = "&" if "?" in backend.url else "?"
    url = f"{backend.url}{sep}protocol=3"
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    with RedisAsyncLookupClient(config(url), meta) as client:
        alive(client)
        client.lookup(TOKENS, "r3")
        wait_until(lambda: engine.started_ids() == ["r3"])
        engine.report("r3", 16)
        assert wait_until(lambda: client.lookup_cache("r3") == 16)


def test_an_idle_healthy_sender_sleeps_and_a_lookup_rings_it(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No idle ticks inside vLLM's scheduler process while Redis answers: the sender wakes
    for lookups, cancels and their replies, not for a clock (its tick probes only while
    the breaker is open, which the breaker tests cover)."""
    engine, _, client = serve(StubEngine(), submit_on_caller_thread=False)
    sender = client._sender
    wakes = 0
    idle = sender._idle

    def counting(link: Any, redis_client: Any) -> None:
        nonlocal wakes
        wakes += 1
        idle(link, redis_client)

    monkeypatch.setattr(sender, "_idle", counting)
    wait_until(lambda: sender._sleep_s == HEALTHY_IDLE_S, message="the sender's long sleep")
    wakes = 0
    time.sleep(0.5)  # five ticks of the Batcher's default
    assert wakes <= 1
    client.lookup(TOKENS, "rings")  # queued (not written by the caller): rings the sender
    wait_until(lambda: engine.started_ids() == ["rings"], timeout=5, message="the lookup sent")
