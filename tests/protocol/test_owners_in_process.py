"""One owner per role with in-process ranks and clients, on fakeredis and a real server: a
second server for a served rank does not read, a second scheduler answers 0 without
submitting, and each takes over when the first goes."""

from __future__ import annotations

import logging

import pytest
from faultkit import MakeClient, MakeServer, alive, answer, prompt, ready
from helpers import Backend, wait_until

from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace
from broker_lookup.protocol.ownership import parse_holder
from broker_lookup.stub_engine import StubEngine

TOKENS = prompt(0, chunks=8)
RIGHT = len(TOKENS)


def test_a_second_server_for_a_served_rank_never_answers(
    make_server: MakeServer,
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner_engine, newcomer_engine = StubEngine("instant", hits=RIGHT), StubEngine("instant", hits=0)
    owner = make_server(owner_engine)
    ready(owner)
    caplog.set_level(logging.ERROR)
    newcomer = make_server(newcomer_engine)
    wait_until(lambda: newcomer.lease.counts["conflicts"] == 1, message="the newcomer sees it")
    assert not newcomer.ready and newcomer.stats().ownership.owner is False
    errors = [r.getMessage() for r in caplog.records if "already served by" in r.getMessage()]
    assert len(errors) == 1
    # Both processes are named: the owner (its host, pid, start) and this one.
    assert owner.lease.identity.describe() in errors[0]
    assert newcomer.lease.identity.describe() in errors[0]
    conn = backend.factory()
    ks = KeySpace(engine_id)
    assert parse_holder(conn.get(ks.owner("0"))).token == owner.lease.token  # type: ignore[union-attr]
    assert conn.exists(ks.contender("0"))  # the conflict is visible in Redis
    client = make_client()
    alive(client)
    for i in range(20):
        client.lookup(TOKENS, f"d-{i}")
        assert answer(client, f"d-{i}", timeout=30) == RIGHT
    assert newcomer_engine.started_ids() == []  # it never read a delivery
    # The owner stops cleanly (its lease released): the newcomer takes over at once.
    owner.close()
    wait_until(lambda: newcomer.ready, timeout=30, message="the newcomer took over")
    client.lookup(TOKENS, "after")
    assert answer(client, "after", timeout=30) == 0  # now the newcomer's engine answers
    assert newcomer.stats().ownership.epoch == 2


def test_a_second_scheduler_answers_zero_and_takes_over_after_the_first(
    make_server: MakeServer,
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ready(make_server(StubEngine("instant", hits=RIGHT)))
    first = make_client()
    assert first.lease.held()  # claimed at construction: its first lookup is served
    caplog.set_level(logging.ERROR)
    second = make_client()
    assert not second.lease.held() and second.stats().ownership.conflicts == 1
    conn = backend.factory()
    requests_before = conn.xlen(KeySpace(engine_id).requests)
    for i in range(10):
        assert second.lookup(TOKENS, f"s-{i}") == 0  # answered at once, never raised
        assert second.lookup_cache(f"s-{i}") == 0
    assert conn.xlen(KeySpace(engine_id).requests) == requests_before  # nothing submitted
    assert second.stats().outcomes["duplicate_scheduler"] == 10
    errors = [r for r in caplog.records if "the scheduler of engine" in r.getMessage()]
    assert len(errors) == 1 and first.lease.identity.describe() in errors[0].getMessage()
    alive(first)
    first.lookup(TOKENS, "f-1")
    assert answer(first, "f-1", timeout=30) == RIGHT
    first.close()  # releases the lease: the second one claims it at its next renewal
    ks = KeySpace(engine_id)
    wait_until(lambda: second.lease.held(), timeout=30, message="the second took over")
    holder = parse_holder(conn.get(ks.owner(SCHEDULER_ROLE)))
    assert holder is not None and holder.epoch == 2
    alive(second)
    second.lookup(TOKENS, "s-after")
    assert answer(second, "s-after", timeout=30) == RIGHT
