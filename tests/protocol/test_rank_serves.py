"""A whole rank against a client, on fakeredis and on a real server: full and partial
hits, the minimum over ranks, a cancel that releases the engine's pins, an engine that
raises, a report out of range, and a batch of many lookups at once."""

from __future__ import annotations

from helpers import MakeClient, MakeServer, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer

TOKENS = list(range(40))  # 10 chunks of 4 tokens


def _ready(client: RedisAsyncLookupClient, *servers: RedisAsyncLookupServer) -> None:
    wait_until(lambda: all(s.ready and s.stats().last_heartbeat for s in servers))
    wait_until(lambda: not client.stats().dead_ranks)


def _answer(client: RedisAsyncLookupClient, lookup_id: str) -> int:
    result: list[int] = []

    def answered() -> bool:
        value = client.lookup_cache(lookup_id)
        if value is not None and value >= 0:
            result.append(value)
        return bool(result)

    wait_until(answered, message=f"{lookup_id} answered")
    return result[0]


def test_a_rank_serves_every_case(make_server: MakeServer, make_client: MakeClient) -> None:
    engines = [StubEngine("instant", hits=24), StubEngine("instant", hits=16)]
    servers = [make_server(e, rank=r, world_size=2) for r, e in enumerate(engines)]
    client = make_client(world_size=2)
    _ready(client, *servers)
    client.lookup(TOKENS, "partial")
    assert _answer(client, "partial") == 16  # the minimum over the two ranks
    client.clear_lookup_status("partial")
    # Many lookups at once: batches of several entries.
    for i in range(30):
        client.lookup(TOKENS, f"burst-{i}")
    assert [_answer(client, f"burst-{i}") for i in range(30)] == [16] * 30
    # An engine that raises is answered 0 (and counted), the other rank's answer aside.
    engines[0].fail_start = True
    client.lookup(TOKENS, "broken")
    assert _answer(client, "broken") == 0
    assert servers[0].stats().counts["engine_errors"] == 1
    engines[0].fail_start = False
    # Hits held until the scheduler is done, then released on a cancel.
    client.lookup(TOKENS, "held")
    assert _answer(client, "held") == 16
    client.cancel_lookup("held")
    wait_until(lambda: all("held" in e.released for e in engines), message="pins released")


def test_a_rank_answers_an_out_of_range_report_with_0(
    make_server: MakeServer, make_client: MakeClient
) -> None:
    engine = StubEngine("manual")
    server = make_server(engine)
    client = make_client()
    _ready(client, server)
    client.lookup(TOKENS, "r1")
    wait_until(lambda: engine.started_ids() == ["r1"])
    engine.report("r1", len(TOKENS) + 1)
    assert _answer(client, "r1") == 0
    assert server.stats().counts["engine_invalid_hits"] == 1
