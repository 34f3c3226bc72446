"""Liveness is a beat, not a batch, on fakeredis and on a real server, in-process: a rank
whose engine holds its read loop in one synchronous call longer than the lease keeps its
lease and its heartbeat (the beat renews them on its own thread), so the client answers
none of its lookups ``dead_rank``, none of its reports is fenced, and every hit is found.
A starting rank writes no heartbeat before its consumer group exists: the heartbeat is
what lets the scheduler submit, and a group made after the submit never delivers it.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from faultkit import MakeClient, MakeServer, Serve, alive, answer, beat, prompt
from helpers import Backend, holds_for, wait_until

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.link import Link
from workers.pipeline.reader import Reader

TOKENS = prompt(11_000, chunks=4)
FULL = len(TOKENS)
#: FAST's 1.5 s lease and heartbeat TTL, and deadlines with room for the stall.
PATIENT: dict[str, Any] = {"lookup_timeout_ms": 10_000, "lookup_timeout_max_ms": 10_000}
STALL_S = 2.5


class StallingEngine(StubEngine):
    """Answers each lookup inside the call, as a synchronous engine does; the first call
    blocks (the rank's read loop with it) until the test lets it go or STALL_S passed."""

    def __init__(self) -> None:
        super().__init__("manual")
        self.go = threading.Event()
        self.stalling = threading.Event()
        self._first = True

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        super().async_lookup_and_prefetch(lookup_id, hashes, offsets, pin, request_configs)
        if self._first:
            self._first = False
            self.stalling.set()
            self.go.wait(STALL_S)
        self.report(lookup_id, sum(offsets))


def test_an_engine_call_stalled_past_the_lease_lapses_neither_lease_nor_heartbeat(
    serve: Serve,
) -> None:
    engine = StallingEngine()
    _, server, client = serve(engine, rank_config=PATIENT, **PATIENT)
    beats = server.beat.last_beat
    client.lookup(TOKENS, "stalls")
    assert engine.stalling.wait(10)
    for i in range(5):  # read by the rank only once the stall ends
        client.lookup(TOKENS, f"behind-{i}")
    # Past the lease (1.5 s), the read loop still blocked in the engine: still the owner,
    # still beating, and no lookup answered for a dead rank.
    holds_for(
        lambda: server.lease.held() and not client.stats().dead_ranks,
        2.0,
        interval=0.05,
        message="the stalled rank holds its lease and looks alive",
    )
    assert not engine.go.is_set() and server.beat.last_beat > beats + 1.5
    engine.go.set()
    ids = ["stalls", *(f"behind-{i}" for i in range(5))]
    assert [answer(client, i, timeout=15) for i in ids] == [FULL] * len(ids)
    counts = server.stats().counts
    assert counts.get("report_fenced", 0) == 0 and counts["report_complete"] == len(ids)
    assert server.stats().ownership.claims == 1
    assert client.stats().outcomes.get("dead_rank", 0) == 0


def test_a_starting_rank_beats_only_once_its_group_exists(
    make_server: MakeServer,
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = Reader.ensure_group
    go = threading.Event()

    def slow_group(reader: Reader, link: Link) -> None:
        go.wait(30)  # a slow link or a busy server at the rank's first command
        made(reader, link)

    monkeypatch.setattr(Reader, "ensure_group", slow_group)
    server = make_server(StubEngine("instant"), rank=0, world_size=1)
    client = make_client(world_size=1, lookup_timeout_ms=10_000)
    conn = backend.factory()
    heartbeat = KeySpace(engine_id).heartbeat(0)
    wait_until(server.lease.held, message="the rank claimed its lease")
    holds_for(
        lambda: not beat(conn, heartbeat) and client.stats().dead_ranks == (0,),
        1.5,
        interval=0.05,
        message="no heartbeat while the rank has no group",
    )
    go.set()
    alive(client, timeout=30)
    client.lookup(TOKENS, "first")  # at once: the rank's group exists by now
    assert answer(client, "first", timeout=15) == FULL
