"""What ``broker-lookup inspect`` shows of one engine's lookups, and how ``--watch`` redraws.

A lookup id is shown whole (an operator pastes it into ``HGETALL``) with the lookup's result,
and ``--watch`` replaces the report on a terminal instead of appending to it.
"""

from __future__ import annotations

import io

import pytest
from faultkit import answer, prompt
from helpers import Backend, MakeClient, MakeServer, RealServer, wait_until

from broker_lookup.config import LookupConfig
from broker_lookup.ops.inspect import render as render_report
from broker_lookup.ops.inspect import run_inspect, snapshot
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine

#: Longer than any column: the old table cut ids at 27 characters.
LONG_ID = "cmpl-" + "0123456789abcdef" * 4
#: What the one rank holds of the prompt (a part of it: the result is not the prompt's size).
HITS = 12


def _one_answered_lookup(make_server: MakeServer, make_client: MakeClient) -> int:
    server = make_server(StubEngine("instant", hits=HITS))
    wait_until(lambda: server.ready)
    client = make_client()
    wait_until(lambda: not client.stats().dead_ranks)
    client.lookup(prompt(1024), LONG_ID)
    return answer(client, LONG_ID, timeout=10)


def test_a_lookup_is_shown_with_its_whole_id_and_its_result(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    hits = _one_answered_lookup(make_server, make_client)
    assert hits == HITS
    snap = snapshot(backend.factory(), KeySpace(engine_id), None, 50)
    text = render_report(snap, "redis://h:6379/0", None)
    [row] = [line for line in text.splitlines() if line.endswith(LONG_ID)]
    assert row.split()[:1] == ["done"] and str(HITS) in row.split()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _watched(url: str, engine_id: str, out: io.StringIO) -> str:
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the second wait

    code = run_inspect(LookupConfig(redis_url=url), engine_id, watch_s=0.5, out=out, sleep=sleep)
    assert code == 0 and sleeps == [0.5, 0.5]
    return out.getvalue()


# inspect connects by URL: the real server only.
@pytest.mark.parametrize("backend", ["real"], indirect=True)
def test_watch_redraws_on_a_terminal_and_appends_when_piped(
    make_server: MakeServer, make_client: MakeClient, real_server: RealServer, engine_id: str
) -> None:
    _one_answered_lookup(make_server, make_client)
    on_terminal = _watched(real_server.url, engine_id, _Terminal())
    assert on_terminal.count("\x1b[H\x1b[2J") == 1 and "-" * 72 not in on_terminal
    assert on_terminal.count(f"engine {engine_id}") == 2
    piped = _watched(real_server.url, engine_id, io.StringIO())
    assert "\x1b[" not in piped and piped.count("-" * 72) == 1
    assert piped.count(f"engine {engine_id}") == 2
