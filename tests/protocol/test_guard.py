"""A bug inside a background loop is counted and logged; the loop survives it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from faultkit import Serve
from helpers import wait_until

from broker_lookup.stub_engine import StubEngine

TOKENS = list(range(40))


def test_rank_loop_survives_an_unexpected_error(
    serve: Serve, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, server, client = serve(StubEngine("instant", hits=20))
    original = server.lifecycle.on_request  # the first step of every lookup
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bug in the lifecycle")
        return original(*args)

    monkeypatch.setattr(server.lifecycle, "on_request", flaky)
    with caplog.at_level(logging.ERROR):
        client.lookup(TOKENS, "first")
        wait_until(lambda: server.stats().unexpected_errors == 1)
    assert any("unexpected error #1" in r.getMessage() for r in caplog.records)
    assert server.stats().alive
    client.lookup(TOKENS, "second")
    assert wait_until(lambda: client.lookup_cache("second") == 20)


def test_client_listener_survives_an_unexpected_error(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, client = serve(StubEngine("instant", hits=20))
    table = client._table
    original = table.finish
    calls = {"n": 0}

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bug in the table")
        return original(*args)

    monkeypatch.setattr(table, "finish", flaky)
    client.lookup(TOKENS, "first")
    wait_until(lambda: client.stats().unexpected_errors == 1)
    client.lookup(TOKENS, "second")
    assert wait_until(lambda: client.lookup_cache("second") == 20)
    assert client._listener._thread.is_alive()
