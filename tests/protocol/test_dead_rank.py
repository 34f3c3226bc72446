"""A rank that never starts, or stops heart-beating: its lookups answer 0 at once (LMCache D8),
with one ERROR line naming it, far under the timeout; lookups recover when it is back."""

from __future__ import annotations

import logging

import pytest
from faultkit import MakeClient, MakeServer, answer, prompt, ready
from helpers import wait_until

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine

TOKENS = prompt(0, chunks=10)
LONG = 30_000  # a timeout no assertion below ever gets near


def _errors_about(caplog: pytest.LogCaptureFixture, rank: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR and f"rank {rank} " in r.getMessage()
    ]


def test_rank_that_never_starts(
    make_server: MakeServer,
    make_client: MakeClient,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="broker_lookup")
    first = StubEngine("instant", hits=40)
    ready(make_server(first, rank=0, world_size=2))
    client = make_client(world_size=2, lookup_timeout_ms=LONG)
    wait_until(lambda: client.stats().dead_ranks == (1,), message="rank 1 seen dead")
    for i in range(3):
        assert client.lookup(TOKENS, f"d{i}") == 0  # answered at once, never sent
        assert client.lookup_cache(f"d{i}") == 0
    assert first.started_ids() == []
    assert client.stats().outcomes["dead_rank"] == 3
    errors = _errors_about(caplog, 1)
    assert len(errors) == 1, errors
    assert KeySpace(engine_id).heartbeat(1) in errors[0]
    assert _errors_about(caplog, 0) == []

    ready(make_server(StubEngine("instant", hits=24), rank=1, world_size=2))
    wait_until(lambda: client.stats().dead_ranks == (), message="rank 1 back")
    client.lookup(TOKENS, "back")
    assert answer(client, "back", timeout=10) == 24
    assert len(_errors_about(caplog, 1)) == 1
    assert any(
        "rank 1 of engine" in r.getMessage() and "alive" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO
    )


def test_rank_that_stops_heartbeating_mid_lookup(
    make_server: MakeServer, make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker_lookup")
    engines = [StubEngine(), StubEngine()]
    servers = [make_server(e, rank=r, world_size=2) for r, e in enumerate(engines)]
    ready(*servers)
    client = make_client(world_size=2, lookup_timeout_ms=LONG)
    wait_until(lambda: client.stats().dead_ranks == ())
    client.lookup(TOKENS, "inflight")
    wait_until(lambda: all(e.started_ids() == ["inflight"] for e in engines))
    engines[0].report("inflight", 40)
    servers[1].close()  # its heartbeat goes; rank 1 never reports
    assert answer(client, "inflight", timeout=10) == 0
    assert client.stats().outcomes["dead_rank"] == 1
    assert len(_errors_about(caplog, 1)) == 1
    wait_until(lambda: engines[0].released == ["inflight"], message="rank 0 told to release")

    engines.append(StubEngine("instant", hits=36))
    ready(make_server(engines[2], rank=1, world_size=2))
    wait_until(lambda: client.stats().dead_ranks == ())
    client.lookup(TOKENS, "back")
    wait_until(lambda: "back" in engines[0].started_ids())
    engines[0].report("back", 40)
    assert answer(client, "back", timeout=10) == 36
