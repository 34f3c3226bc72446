"""What a lookup in flight leaves for the GC of the processes we run in.

The client runs in vLLM's scheduler process and a rank in a worker process, both with
large heaps that every full collection walks. A collection comes after so many tracked
objects were allocated and outlived the last one, so what a lookup keeps alive while it is
in flight (or held, on a rank: for the pins' TTL) sets how often vLLM's processes pause
for one. These tests count the tracked objects that lookups leave alive, after a
collection (which untracks tuples of plain values).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
from faultkit import Serve, prompt
from helpers import wait_until

import broker_lookup.client.table as lookup_table
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.stub_engine import Mode, StubEngine

if TYPE_CHECKING:
    from workers.server import RedisAsyncLookupServer

# A real server only: fakeredis keeps the server's data in this process, among the objects
# counted here.
# The counts depend on what other threads have under way at the moment they are taken
# (CI's earlier transients): in the long leg.
pytestmark = [
    pytest.mark.parametrize(
        "backend", [pytest.param("real", marks=pytest.mark.real, id="real")], indirect=True
    ),
    pytest.mark.long,
]

LOOKUPS = 300
WARM = 50
#: Counts taken on each side of a measure (see ``_least_kept``).
COUNTS = 3


def _answered(client: RedisAsyncLookupClient, lookup_id: str) -> bool:
    return client.lookup_cache(lookup_id) is not None


def _rank_and_client(
    serve: Serve, mode: Mode
) -> tuple[RedisAsyncLookupServer, RedisAsyncLookupClient]:
    """A rank whose engine answers as ``mode`` says, and a client that sees it; long
    budgets, so no lookup reaches its deadline on a loaded machine."""
    budget: dict[str, Any] = {"lookup_timeout_ms": 20_000}
    _, server, client = serve(StubEngine(mode, record=False), rank_config=budget, **budget)
    return server, client


def _kept_tracked() -> int:
    """How many objects the GC tracks through two collections in a row.

    The client's and the rank's threads run on while this counts: a tuple one of them
    makes between a collection and the count is tracked until the next collection
    untracks it. Such an object is not kept by anything, so only what stays tracked
    through the second collection counts.
    """
    gc.collect()
    first = gc.get_objects()  # holds them, so no id in it is reused by a new object
    gc.collect()
    still = {id(obj) for obj in gc.get_objects()}
    return sum(1 for obj in first if id(obj) in still)


def _least_kept() -> int:
    """The least of a few counts, each after the threads had a moment to run.

    A list stays tracked as long as it lives, so a batch a thread has under way across
    both collections of a count is in it: once in 100 loaded runs, the client's sender
    was still settling the replies to 88 submits its rank already ran (176 lists, 0.69
    per lookup). What the lookups keep is in every count; a batch under way only in the
    counts it overlaps.
    """
    least = _kept_tracked()
    for _ in range(COUNTS - 1):
        time.sleep(0.05)  # a switch: the other threads finish what they have under way
        least = min(least, _kept_tracked())
    return least


def _tracked_per_lookup(run: Callable[[], None]) -> float:
    before = _least_kept()
    run()
    return (_least_kept() - before) / LOOKUPS


def test_lookups_in_flight_keep_nothing_tracked(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A reconcile pass reads the hash of each lookup in flight for 0.5 s or more, one
    # reply list per lookup; passes come every 0.1 s, so one could overlap every count (265
    # of its lists were counted once, on a loaded machine). Not due within the test, the
    # reconcile queue's tuples are still counted.
    monkeypatch.setattr(lookup_table, "RECONCILE_AFTER_S", 3600.0)
    # A manual engine never answers by itself: every lookup stays in flight (running on
    # the rank, pending on the client) while the objects are counted.
    server, client = _rank_and_client(serve, "manual")
    prompts = [prompt(i * 1000) for i in range(WARM + LOOKUPS)]
    # Warm: the first lookups' one-time objects (caches, the connections' buffers).
    for i, tokens in enumerate(prompts[:WARM]):
        assert client.lookup(tokens, f"warm-{i}") is None
    wait_until(lambda: server.stats().running == WARM, message="warm lookups running")

    def run() -> None:
        for i, tokens in enumerate(prompts[WARM:]):
            assert client.lookup(tokens, f"gc-{i}") is None
        wait_until(
            lambda: server.stats().running == WARM + LOOKUPS,
            message="every lookup running on the rank",
        )

    per_lookup = _tracked_per_lookup(run)
    assert client.stats().inflight == WARM + LOOKUPS
    # The table's entry, the request (its lists go once the submit is written) and a
    # rank's running job are untracked; the code before kept 3.3 tracked objects each,
    # and an entry tracked again makes it 1.0.
    assert per_lookup < 0.5, per_lookup


def test_held_lookups_keep_nothing_tracked_on_the_rank(serve: Serve) -> None:
    # Long budgets: a lookup answered 0 at its deadline on a loaded machine is cancelled,
    # and its rank releases it instead of holding it.
    server, client = _rank_and_client(serve, "instant")
    prompts = [prompt(i * 1000) for i in range(LOOKUPS)]

    def answer_and_clear(lookup_ids: list[str]) -> None:
        # Cleared once the client has the answer: clearing a lookup still pending cancels
        # it, and its rank would release what it holds.
        for lookup_id, tokens in zip(lookup_ids, prompts, strict=False):
            client.lookup(tokens, lookup_id)
            wait_until(partial(_answered, client, lookup_id), message=f"{lookup_id} answered")
            client.clear_lookup_status(lookup_id)

    answer_and_clear([f"warm-{i}" for i in range(WARM)])  # the first lookups' one-time objects
    wait_until(lambda: server.stats().held == WARM, message="warm lookups held")

    def run() -> None:
        answer_and_clear([f"gc-{i}" for i in range(LOOKUPS)])
        wait_until(lambda: server.stats().held == WARM + LOOKUPS, message="all held")

    # Answered and cleared on the client; held on the rank (the pins' TTL is a minute).
    per_lookup = _tracked_per_lookup(run)
    # A held job and its timers are untracked; the code before kept 1.3 objects each.
    assert per_lookup < 0.5, per_lookup
