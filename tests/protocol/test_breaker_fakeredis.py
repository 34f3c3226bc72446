"""The client's circuit breaker on fakeredis (the real-server twin, through the fault
proxy, is in test_client_network.py): a failing Redis answers new lookups 0 at once,
nothing queues up, the breaker closes by itself, and hits come back."""

from __future__ import annotations

import pytest
from faultkit import Serve, prompt
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient, RedisLookupClient
from broker_lookup.stub_engine import StubEngine

TOKENS = prompt(0, chunks=10)
fake_only = pytest.mark.parametrize("backend", ["fake"], indirect=True)


@fake_only
@pytest.mark.parametrize("cls", ["async", "sync"])
def test_a_failing_redis_answers_zero_at_once_then_recovers(
    serve: Serve, backend: Backend, cls: str
) -> None:
    kind = RedisLookupClient if cls == "sync" else RedisAsyncLookupClient
    _, _, client = serve(StubEngine("instant", hits=24), lookup_timeout_ms=30_000, cls=kind)
    backend.fake.connected = False
    client.lookup(TOKENS, "trips")  # the submit that finds Redis gone
    wait_until(lambda: client.stats().breaker_open, message="the breaker opens")
    for i in range(200):
        assert client.lookup(TOKENS, f"down-{i}") == 0  # not after the 30 s timeout
        assert client.lookup_cache(f"down-{i}") == 0
    stats = client.stats()
    assert stats.outcomes["unavailable"] >= 200 and stats.queued == 0
    backend.fake.connected = True
    wait_until(lambda: not client.stats().breaker_open, message="it closes by itself")

    def served() -> bool:
        client.clear_lookup_status("up")
        result = client.lookup(TOKENS, "up")
        if result is None:  # the async client: poll as the scheduler does
            wait_until(lambda: client.lookup_cache("up") is not None)
            result = client.lookup_cache("up")
        return result == 24

    wait_until(served, timeout=10, message="hits come back")
