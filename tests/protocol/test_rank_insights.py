"""Rank insights: which rank was slow, and ranks that disagree (both backends).

The stamps come from the server's ``TIME`` inside ``submit.lua`` and ``report.lua``; the
client's listener turns each completion entry into per-rank figures
(:class:`broker_lookup.client.insights.RankInsights`). No timing is asserted: only that
each figure is recorded where it should be, and nothing when ``rank_insights`` is off.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from faultkit import Serve, ServedRanks
from helpers import Backend, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.client.insights import Sampler
from broker_lookup.ops.inspect import render, snapshot
from broker_lookup.protocol import lookup_hash
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import REPORT, SUBMIT, Call, submit_args
from broker_lookup.protocol.stats import InsightsStats
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.script_runner import ScriptSet

TOKENS = list(range(40))  # 10 chunks of 4 tokens
INSIGHTS_LOG = "broker_lookup.client.insights"


def _ranks(serve: Serve, world: int, **overrides: Any) -> ServedRanks[StubEngine]:
    # Every lookup timed, unless a test samples: these tests count lookup by lookup.
    overrides.setdefault("rank_insights_max_per_s", 0)
    return serve.ranks([StubEngine() for _ in range(world)], **overrides)


def _answer(
    client: RedisAsyncLookupClient,
    engines: list[StubEngine],
    lookup_id: str,
    hits: dict[int, int],
    order: list[int],
    redis: Any = None,
    key: str = "",
) -> int:
    """Look up, then make the ranks report ``hits`` in ``order``; the answer."""
    assert client.lookup(TOKENS, lookup_id) is None
    wait_until(lambda: all(lookup_id in e.started_ids() for e in engines))
    for i, rank in enumerate(order):
        engines[rank].report(lookup_id, hits[rank])
        if redis is not None and i < len(order) - 1:
            _written(redis, key, lookup_hash.rank_field(rank))
    assert wait_until(lambda: client.lookup_cache(lookup_id) is not None)
    result = client.lookup_cache(lookup_id)
    assert isinstance(result, int)
    return result


def _written(redis: Any, key: str, field: str) -> None:
    wait_until(lambda: redis.hget(key, field) is not None, message=f"{field} written")


def _insights(client: RedisAsyncLookupClient) -> InsightsStats:
    stats = client.stats().rank_insights
    assert stats is not None, "rank_insights is on"
    return stats


def test_per_rank_latency_and_last_to_report(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engines, _, client = _ranks(serve, 3)
    redis: Any = backend.factory()
    key = KeySpace(engine_id).lookup("slow1")
    # Rank 1 reports last on purpose, after the others are in the hash.
    assert _answer(client, engines, "slow1", {0: 40, 1: 40, 2: 40}, [0, 2, 1], redis, key) == 40
    fields = redis.hgetall(key)
    assert int(fields[lookup_hash.SUBMITTED_US.encode()]) > 1_600_000_000 * 10**6
    for rank in range(3):
        assert int(fields[lookup_hash.latency_field(rank).encode()]) >= 0
    wait_until(lambda: _insights(client).recorded == 1)
    ins = _insights(client)
    for rank in range(3):
        assert sum(ins.ranks[rank].report_counts) == 1, rank
    assert {r: ins.ranks[r].last for r in range(3)} == {0: 0, 1: 1, 2: 0}
    # The last rank's latency is at least every earlier one's: one server clock.
    lat = {r: int(fields[lookup_hash.latency_field(r).encode()]) for r in range(3)}
    assert lat[1] >= max(lat[0], lat[2])
    # The completion entry carries the insights in expected order.
    (_, done), *_ = redis.xrevrange(KeySpace(engine_id).done, count=1)
    assert done[b"last"] == b"1" and done[b"ranks"] == b"0,1,2" and done[b"hits"] == b"40,40,40"
    assert [int(v) for v in done[b"lat"].split(b",")] == [lat[0], lat[1], lat[2]]
    # Everyone agreed: no excess, one spread sample of 0.
    assert all(ins.ranks[r].excess_lookups == 0 for r in range(3))
    assert ins.spread_counts[0] == 1 and sum(ins.spread_counts) == 1


def test_ranks_that_disagree_are_counted_and_warned_about(
    serve: Serve,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines, _, client = _ranks(serve, 3, rank_spread_warn_share=0.5)
    caplog.set_level(logging.WARNING, logger=INSIGHTS_LOG)
    # Spread 36 of 40 tokens: over the share, warned.
    assert _answer(client, engines, "split1", {0: 40, 1: 4, 2: 20}, [0, 1, 2]) == 4
    wait_until(lambda: _insights(client).recorded == 1)
    ins = _insights(client)
    assert {r: ins.ranks[r].excess_lookups for r in range(3)} == {0: 1, 1: 0, 2: 1}
    assert {r: ins.ranks[r].excess_tokens for r in range(3)} == {0: 36, 1: 0, 2: 16}
    assert sum(ins.spread_counts) == 1 and ins.spread_sum == 36
    warned = [r for r in caplog.records if r.name == INSIGHTS_LOG]
    assert len(warned) == 1
    text = warned[0].getMessage()
    assert "split1" in text and "rank 0=40" in text and "rank 1=4" in text and "rank 2=20" in text
    # Spread 8 of 40 (20%): counted, not warned.
    assert _answer(client, engines, "split2", {0: 8, 1: 16, 2: 8}, [2, 0, 1]) == 8
    wait_until(lambda: _insights(client).recorded == 2)
    ins = _insights(client)
    assert ins.ranks[1].excess_tokens == 8 and ins.ranks[1].excess_lookups == 1
    assert ins.spread_warnings == 1
    # Another wide spread within the rate limit: counted as a warning, not logged.
    assert _answer(client, engines, "split3", {0: 0, 1: 40, 2: 40}, [0, 1, 2]) == 0
    wait_until(lambda: _insights(client).recorded == 3)
    assert _insights(client).spread_warnings == 2
    assert len([r for r in caplog.records if r.name == INSIGHTS_LOG]) == 1


def test_rank_insights_off_records_nothing(serve: Serve, backend: Backend, engine_id: str) -> None:
    engines, _, client = _ranks(serve, 2, rank_insights=False)
    assert _answer(client, engines, "off1", {0: 40, 1: 8}, [1, 0]) == 8
    assert client.stats().rank_insights is None
    redis: Any = backend.factory()
    fields = redis.hgetall(KeySpace(engine_id).lookup("off1"))
    assert fields[b"state"] == b"done"
    names = {k.decode() for k in fields}
    assert lookup_hash.SUBMITTED_US not in names
    assert not names & {lookup_hash.latency_field(r) for r in range(2)}
    (_, done), *_ = redis.xrevrange(KeySpace(engine_id).done, count=1)
    assert set(done) == {b"id", b"gen", b"result"}


def test_old_format_done_entries_still_complete(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    """An entry with only id, gen, result (an older report.lua) completes its lookup."""
    engines, _, client = _ranks(serve, 1)
    assert client.lookup(TOKENS, "old1") is None
    wait_until(lambda: "old1" in engines[0].started_ids())
    keys = KeySpace(engine_id)
    redis: Any = backend.factory()
    gen = int(redis.hget(keys.lookup("old1"), "gen") or 0)
    redis.xadd(keys.done, {"id": "old1", "gen": gen, "result": 12})
    assert wait_until(lambda: client.lookup_cache("old1") == 12)
    assert _insights(client).recorded == 0
    # An entry whose insight fields are garbage completes too, without insights.
    assert client.lookup(TOKENS, "old2") is None
    wait_until(lambda: "old2" in engines[0].started_ids())
    gen = int(redis.hget(keys.lookup("old2"), "gen") or 0)
    bad = {"id": "old2", "gen": gen, "result": 8, "last": "0", "ranks": "0", "hits": "x", "lat": ""}
    redis.xadd(keys.done, bad)
    assert wait_until(lambda: client.lookup_cache("old2") == 8)
    assert _insights(client).recorded == 0


def test_scripts_stamp_only_when_asked(backend: Backend, engine_id: str) -> None:
    """submit.lua's flag alone decides the stamps; report.lua times a stamped hash only."""
    redis: Any = backend.factory()
    scripts = ScriptSet()
    scripts.load(redis)
    keys = KeySpace(engine_id)
    for lookup_id, insights in (("s-on", True), ("s-off", False)):
        args = submit_args(
            gen=1,
            expected="0",
            created_ms=int(time.time() * 1000),
            deadline_ms=int(time.time() * 1000) + 5000,
            tokens=40,
            ttl_ms=10_000,
            engine_ttl_ms=60_000,
            maxlen=1000,
            lookup_id=lookup_id,
            fields={"type": "lookup", "id": lookup_id},
            insights=insights,
        )
        scripts.call(redis, Call(SUBMIT, (keys.lookup(lookup_id), keys.requests), args))
        stamp = redis.hget(keys.lookup(lookup_id), lookup_hash.SUBMITTED_US)
        assert (stamp is not None) is insights
        if stamp is not None:
            assert stamp.isdigit() and len(stamp) == 16  # exact digits, never 1.7e+15
        report: list[str | bytes | int] = [0, 1, 24, 1000, lookup_id, 10_000, 60_000]
        got = scripts.call(redis, Call(REPORT, (keys.lookup(lookup_id), keys.done), report))
        assert got == b"complete"
        latency = redis.hget(keys.lookup(lookup_id), lookup_hash.latency_field(0))
        assert (latency is not None) is insights


def test_inspect_shows_each_ranks_latency_and_last_share(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    engines, _, client = _ranks(serve, 2)
    redis: Any = backend.factory()
    keys = KeySpace(engine_id)
    for i in range(3):
        lookup_id = f"insp{i}"
        got = _answer(
            client, engines, lookup_id, {0: 8, 1: 8}, [0, 1], redis, keys.lookup(lookup_id)
        )
        assert got == 8
    snap = snapshot(redis, keys, None, 50, recent=100)
    rl = snap["rank_latency"]
    assert rl["read"] == 3 and rl["timed"] == 3 and rl["window_s"] is not None
    assert rl["ranks"][0]["samples"] == rl["ranks"][1]["samples"] == 3
    assert rl["ranks"][1]["last_share"] == 1.0 and rl["ranks"][0]["last_share"] == 0.0
    assert rl["ranks"][1]["p50_ms"] >= 0
    text = render(snap, "redis://h:6379/0", None)
    assert "RANK LATENCY" in text and "100% (3)" in text
    json.dumps(snap, default=str)  # the --json output


class _Scripted(Sampler):
    """A sampler answering set weights in turn (timing is not what this test is about)."""

    def __init__(self, weights: list[int]) -> None:
        super().__init__(0)
        self.weights = weights

    def take(self, now: float) -> int:
        return self.weights.pop(0)


def test_sampled_lookups_go_untimed_and_timed_ones_count_for_their_weight(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    """``rank_insights_max_per_s``: only the sampler's picks carry stamps on the wire."""
    engines, _, client = _ranks(serve, 2, rank_insights_max_per_s=50)
    assert client.insights is not None
    client.insights.sampler = _Scripted([1, 0, 0, 3])
    redis: Any = backend.factory()
    keys = KeySpace(engine_id)
    for i in range(4):
        key = keys.lookup(f"smp{i}")
        assert _answer(client, engines, f"smp{i}", {0: 40, 1: 40}, [0, 1], redis, key) == 40
    stamped = [
        redis.hget(keys.lookup(f"smp{i}"), lookup_hash.SUBMITTED_US) is not None for i in range(4)
    ]
    assert stamped == [True, False, False, True]
    done = [fields for _, fields in redis.xrange(keys.done)]
    assert [b"last" in f for f in done] == stamped  # untimed: the short entry
    wait_until(lambda: _insights(client).recorded == 2)
    ins = _insights(client)
    assert ins.represented == 4
    assert ins.ranks[1].last == 4  # rank 1 reported last each time: 1 + 3
    assert sum(ins.ranks[0].report_counts) == 4
    assert sum(ins.spread_counts) == 4 and ins.spread_counts[0] == 4


def test_the_default_sampler_times_the_first_lookup_and_at_most_its_rate(
    serve: Serve, backend: Backend, engine_id: str
) -> None:
    """One timed lookup every 1,000 s: of a run of lookups, the first alone is timed."""
    engines, _, client = _ranks(serve, 1, rank_insights_max_per_s=0.001)
    for i in range(3):
        assert _answer(client, engines, f"rate{i}", {0: 40}, [0]) == 40
    wait_until(lambda: _insights(client).recorded == 1)
    redis: Any = backend.factory()
    keys = KeySpace(engine_id)
    stamps = [redis.hget(keys.lookup(f"rate{i}"), lookup_hash.SUBMITTED_US) for i in range(3)]
    assert [s is not None for s in stamps] == [True, False, False]
    assert _insights(client).represented == 1  # the other two wait for the next pick
