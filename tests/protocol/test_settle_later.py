"""A rank's acks and reports on a connection of their own, settled on the next turn.

On a real server the read loop writes each batch's XACK and reports on a second
connection and reads their replies when its next read returns, so their arrival wakes
no thread. The reports still settle (held pins, released ones), a replay never reads
an entry whose XACK is in flight, and a broken acks connection loses nothing. On
fakeredis (and Redis Cluster) the loop keeps one connection: the same behaviour.
"""

from __future__ import annotations

import time
from typing import Any

from faultkit import answer, prompt, ready
from helpers import Backend, MakeClient, MakeServer, wait_until

from broker_lookup.tools.stub_engine import StubEngine

TOKENS = prompt(0, chunks=6)
FULL = len(TOKENS)


def _rank_clients(conn: Any, commands: set[str]) -> list[str]:
    """Ids of the server's clients whose last command is one of ``commands``."""
    return [c["id"] for c in conn.client_list() if c.get("cmd") in commands]


def test_reports_settle_and_pins_are_held_a_turn_later(
    make_server: MakeServer, make_client: MakeClient, backend: Backend
) -> None:
    server = make_server(StubEngine("instant"))
    ready(server)
    assert server.stats()["settles_later"] is (backend.kind == "real")
    client = make_client()
    for i in range(5):
        client.lookup(TOKENS, f"s{i}")
        assert answer(client, f"s{i}", 10) == FULL
    # Each generation is held once its report's answer is read: at the latest on the turn
    # the next BLOCK ends, with no lookup coming.
    wait_until(lambda: server.stats()["held"] == 5, message="every answered lookup held")
    assert server.stats()["reporting"] == 0
    counts = server.stats()["counts"]
    assert counts.get("report_complete", 0) == 5, counts


def test_a_replay_read_follows_the_acks_it_could_see(
    make_server: MakeServer, make_client: MakeClient
) -> None:
    """Replays (once a second) never re-serve an entry whose XACK was still in flight."""
    server = make_server(StubEngine("instant"))
    ready(server)
    client = make_client()
    for i in range(40):  # spans at least two replays at block_ms 50
        client.lookup(TOKENS, f"r{i}")
        assert answer(client, f"r{i}", 10) == FULL
        client.clear_lookup_status(f"r{i}")

        def served(n: int = i + 1) -> bool:
            return bool(server.stats()["consumer"]["entries"] >= n)

        wait_until(served, timeout=10)
        time.sleep(0.03)  # let replays interleave
    assert server.stats()["consumer"]["replayed"] == 0
    assert server.stats()["counts"].get("duplicate", 0) == 0


def test_a_killed_acks_connection_loses_no_report(
    make_server: MakeServer, make_client: MakeClient, backend: Backend
) -> None:
    server = make_server(StubEngine("instant"))
    ready(server)
    first = make_client()
    first.lookup(TOKENS, "before")
    assert answer(first, "before", 10) == FULL
    first.close()  # only the rank's connections are left to kill
    conn = backend.factory()
    if backend.kind == "real":  # the acks connection last ran XACK or the report's script
        killed = _rank_clients(conn, {"xack", "evalsha"})
        assert killed
        for client_id in killed:
            conn.client_kill_filter(_id=client_id)
    client = make_client()
    client.lookup(TOKENS, "after")
    assert answer(client, "after", 10) == FULL
    # Both generations end held: a report whose reply was lost with the connection is
    # queued and sent again, never left reporting.
    wait_until(lambda: server.stats()["held"] == 2, timeout=10, message="both lookups held")
    stats = server.stats()
    assert stats["reporting"] == 0 and stats["unexpected_errors"] == 0
    if backend.kind == "real":  # the loss was seen, and recovered from
        assert stats["consumer"]["redis_errors"] >= 1
