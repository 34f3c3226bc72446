"""A whole rank against a client, on fakeredis and on a real server: full and partial
hits, the minimum over ranks, a cancel that releases the engine's pins, an engine that
raises, a report out of range, and a batch of many lookups at once."""

from __future__ import annotations

from faultkit import Serve, answer
from helpers import wait_until

from broker_lookup.stub_engine import StubEngine

TOKENS = list(range(40))  # 10 chunks of 4 tokens


def test_a_rank_serves_every_case(serve: Serve) -> None:
    engines, servers, client = serve.ranks(
        [StubEngine("instant", hits=24), StubEngine("instant", hits=16)]
    )
    client.lookup(TOKENS, "partial")
    assert answer(client, "partial", timeout=5) == 16  # the minimum over the two ranks
    client.clear_lookup_status("partial")
    # Many lookups at once: batches of several entries.
    for i in range(30):
        client.lookup(TOKENS, f"burst-{i}")
    assert [answer(client, f"burst-{i}", timeout=5) for i in range(30)] == [16] * 30
    # An engine that raises is answered 0 (and counted), the other rank's answer aside.
    engines[0].fail_start = True
    client.lookup(TOKENS, "broken")
    assert answer(client, "broken", timeout=5) == 0
    assert servers[0].stats().counts["engine_errors"] == 1
    engines[0].fail_start = False
    # Hits held until the scheduler is done, then released on a cancel.
    client.lookup(TOKENS, "held")
    assert answer(client, "held", timeout=5) == 16
    client.cancel_lookup("held")
    wait_until(lambda: all("held" in e.released for e in engines), message="pins released")


def test_a_rank_answers_an_out_of_range_report_with_0(serve: Serve) -> None:
    engine, server, client = serve(StubEngine("manual"))
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", len(TOKENS) + 1)
    assert answer(client, "r1", timeout=5) == 0
    assert server.stats().counts["engine_invalid_hits"] == 1
