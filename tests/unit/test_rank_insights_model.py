"""Rank insights without a server: the decoder, :class:`RankInsights`, the metric families
and ``inspect``'s per-rank table."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from msgspec.structs import replace
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.client.insights import SPREAD_BUCKETS, RankInsights, Sampler
from broker_lookup.errors import MalformedMessage
from broker_lookup.histogram import LATENCY_BUCKETS, Histogram
from broker_lookup.ops.inspect import render
from broker_lookup.ops.metrics import ClientCollector
from broker_lookup.ops.rank_latency import rank_latency
from broker_lookup.protocol.messages import DoneEvent, decode_done
from broker_lookup.protocol.stats import ClientStats, InsightsStats

LOG = "broker_lookup.client.insights"


def _event(
    lookup_id: str, hits: tuple[int, ...], lat: tuple[int | None, ...], last: int
) -> DoneEvent:
    return DoneEvent(
        lookup_id=lookup_id,
        gen=1,
        result=min(hits),
        last=last,
        ranks=tuple(range(len(hits))),
        hits=hits,
        latency_us=lat,
    )


# -- decode_done ----------------------------------------------------------------------


def test_decode_done_reads_the_insight_fields() -> None:
    ev = decode_done(
        {
            b"id": b"a",
            b"gen": b"7",
            b"result": b"4",
            b"last": b"1",
            b"ranks": b"0,1,2",
            b"hits": b"8,4,8",
            b"lat": b"120,,95",
        }
    )
    assert (ev.lookup_id, ev.gen, ev.result, ev.last) == ("a", 7, 4, 1)
    assert ev.ranks == (0, 1, 2) and ev.hits == (8, 4, 8) and ev.latency_us == (120, None, 95)


def test_decode_done_old_format_and_bad_insights_keep_the_completion() -> None:
    old = decode_done({b"id": b"a", b"gen": b"1", b"result": b"3"})
    assert old == DoneEvent(lookup_id="a", gen=1, result=3)
    assert old.last is None and old.hits == () and old.latency_us == ()
    for bad in (
        {b"last": b"0", b"ranks": b"0,1", b"hits": b"1", b"lat": b"1,2"},  # lengths differ
        {b"last": b"0", b"ranks": b"0", b"hits": b"x", b"lat": b""},
        {b"last": b"0"},  # the rest missing
    ):
        ev = decode_done({b"id": b"a", b"gen": b"1", b"result": b"3", **bad})
        assert ev == DoneEvent(lookup_id="a", gen=1, result=3), bad
    with pytest.raises(MalformedMessage):
        decode_done({b"id": b"a", b"gen": b"1", b"last": b"0"})


# -- RankInsights ---------------------------------------------------------------------


def test_latency_and_last_per_rank() -> None:
    ins = RankInsights((0, 1), warn_share=0.5)
    ins.record(_event("a", (8, 8), (400, 3000), last=1), tokens=8)
    ins.record(_event("b", (8, 8), (None, 20_000), last=1), tokens=8)
    snap = ins.snapshot()
    assert snap.recorded == 2
    zero, one = snap.ranks[0], snap.ranks[1]
    assert sum(zero.report_counts) == 1 and sum(one.report_counts) == 2
    assert zero.report_sum == pytest.approx(0.0004)
    assert one.report_sum == pytest.approx(0.023)
    # 0.4 ms falls in the 0.5 ms bucket, 3 ms in the 5 ms one, 20 ms in the 25 ms one.
    assert zero.report_counts[LATENCY_BUCKETS.index(0.0005)] == 1
    assert one.report_counts[LATENCY_BUCKETS.index(0.005)] == 1
    assert one.report_counts[LATENCY_BUCKETS.index(0.025)] == 1
    assert (zero.last, one.last) == (0, 2)
    assert snap.spread_counts[0] == 2  # agreed twice


def test_disagreement_counts_excess_and_spread() -> None:
    ins = RankInsights((0, 1, 2), warn_share=0.9)
    ins.record(_event("a", (40, 4, 20), (1, 1, 1), last=2), tokens=40)
    snap = ins.snapshot()
    assert [snap.ranks[r].excess_lookups for r in range(3)] == [1, 0, 1]
    assert [snap.ranks[r].excess_tokens for r in range(3)] == [36, 0, 16]
    spread = Histogram.of(snap.spread_counts, snap.spread_sum, SPREAD_BUCKETS)
    assert spread.total == 36
    assert spread.counts[SPREAD_BUCKETS.index(64)] == 1
    assert snap.spread_warnings == 0  # 36 / 40 = 0.9 is not over 0.9


def test_warning_names_the_lookup_and_every_rank_and_is_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ins = RankInsights((0, 1), warn_share=0.5, warn_every_s=3600)
    caplog.set_level(logging.WARNING, logger=LOG)
    ins.record(_event("req-42", (100, 10), (1, 1), last=0), tokens=100)
    ins.record(_event("req-43", (90, 0), (1, 1), last=0), tokens=100)
    ins.record(_event("req-44", (60, 50), (1, 1), last=0), tokens=100)  # 10%: no warning
    lines = [r.getMessage() for r in caplog.records if r.name == LOG]
    assert len(lines) == 1
    assert "'req-42'" in lines[0] and "rank 0=100" in lines[0] and "rank 1=10" in lines[0]
    assert "rank_spread_warn_share" in lines[0]
    assert ins.snapshot().spread_warnings == 2


def test_events_without_insights_and_foreign_ranks_are_ignored() -> None:
    ins = RankInsights((0, 1), warn_share=0.5)
    ins.record(DoneEvent(lookup_id="a", gen=1, result=3), tokens=8)
    assert ins.snapshot().recorded == 0
    ev = DoneEvent(
        lookup_id="b", gen=1, result=1, last=5, ranks=(0, 5), hits=(4, 1), latency_us=(10, 10)
    )
    ins.record(ev, tokens=8)
    snap = ins.snapshot()
    assert set(snap.ranks) == {0, 1}  # memory stays per expected rank
    assert snap.ranks[0].excess_tokens == 3
    assert sum(snap.ranks[0].report_counts) == 1
    assert sum(snap.ranks[1].report_counts) == 0


def test_sampler_times_at_most_its_rate_and_weighs_what_it_skipped() -> None:
    sampler = Sampler(max_per_s=100)  # one every 10 ms
    weights = [sampler.take(t / 1000) for t in (0, 1, 2, 3, 10, 25, 26, 40)]
    # 0 ms timed (1); 1-3 ms skipped; 10 ms stands for itself and the 3 before it; 25 ms
    # for itself; 26 ms skipped; 40 ms for itself and 26 ms.
    assert weights == [1, 0, 0, 0, 4, 1, 0, 2]
    assert sum(weights) == len(weights)  # every submit is counted exactly once


def test_sampler_at_zero_times_every_lookup() -> None:
    sampler = Sampler(max_per_s=0)
    assert [sampler.take(0.0) for _ in range(5)] == [1, 1, 1, 1, 1]


def test_a_timed_lookup_counts_for_its_weight() -> None:
    """Sampled figures estimate every lookup: a weight-3 event counts as three."""
    weighted, unweighted = RankInsights((0, 1), 0.9), RankInsights((0, 1), 0.9)
    ev = _event("a", (40, 10), (400, 3000), last=1)
    weighted.record(ev, tokens=40, weight=3)
    for _ in range(3):
        unweighted.record(ev, tokens=40)
    got, want = weighted.snapshot(), unweighted.snapshot()
    assert got.recorded == 1 and want.recorded == 3
    assert got.represented == want.represented == 3
    for rank in (0, 1):
        mine, theirs = got.ranks[rank], want.ranks[rank]
        assert mine.report_sum == pytest.approx(theirs.report_sum), rank
        assert replace(mine, report_sum=0) == replace(theirs, report_sum=0), rank
    assert got.spread_counts == want.spread_counts
    assert got.spread_sum == want.spread_sum
    assert got.ranks[0].excess_tokens == 90 and got.ranks[1].last == 3


# -- metrics --------------------------------------------------------------------------


class _Client:
    def __init__(self, insights: InsightsStats | None) -> None:
        self._insights = insights

    def stats(self) -> ClientStats:
        return ClientStats(rank_insights=self._insights)


def _samples(
    insights: InsightsStats | None,
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(ClientCollector(_Client(insights)))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_families_carry_one_series_per_rank() -> None:
    ins = RankInsights((0, 1), warn_share=0.5)
    ins.record(_event("a", (8, 4), (300, 7000), last=1), tokens=8)
    got = _samples(ins.snapshot())
    r0, r1 = (("rank", "0"),), (("rank", "1"),)
    assert got[("broker_lookup_client_rank_last_total", r1)] == 1
    assert got[("broker_lookup_client_rank_last_total", r0)] == 0
    assert got[("broker_lookup_client_rank_excess_lookups_total", r0)] == 1
    assert got[("broker_lookup_client_rank_excess_tokens_total", r0)] == 4
    assert got[("broker_lookup_client_rank_report_seconds_count", r1)] == 1
    assert got[("broker_lookup_client_rank_report_seconds_sum", r1)] == pytest.approx(0.007)
    assert got[("broker_lookup_client_rank_report_seconds_bucket", (("le", "0.01"), *r1))] == 1
    assert got[("broker_lookup_client_rank_report_seconds_bucket", (("le", "0.005"), *r1))] == 0
    assert got[("broker_lookup_client_rank_spread_tokens_count", ())] == 1
    assert got[("broker_lookup_client_rank_spread_tokens_sum", ())] == 4
    assert got[("broker_lookup_client_rank_spread_tokens_bucket", (("le", "16"),))] == 1
    assert got[("broker_lookup_client_rank_spread_tokens_bucket", (("le", "0"),))] == 0


def test_metric_families_are_empty_when_insights_are_off() -> None:
    names = {name for name, _ in _samples(None)}
    assert not {n for n in names if n.startswith("broker_lookup_client_rank_")}


# -- inspect --------------------------------------------------------------------------


def _entry(ms: int, last: int | None, lat: str = "", hits: str = "4,4") -> tuple[bytes, Any]:
    fields: dict[bytes, bytes] = {b"id": b"x", b"gen": b"1", b"result": b"4"}
    if last is not None:
        fields |= {b"last": str(last).encode(), b"ranks": b"0,1", b"hits": hits.encode()}
        fields[b"lat"] = lat.encode()
    return f"{ms}-0".encode(), fields


def test_inspect_rank_latency_reads_every_completion_of_a_multi_entry() -> None:
    """A rank's report batch writes its completions in one entry: each one is timed."""
    fields: dict[bytes, bytes] = {b"n": b"3"}
    for index, last in enumerate((1, None, 0)):
        suffix = b"" if not index else b".%d" % index
        fields |= {b"id" + suffix: b"x%d" % index, b"gen" + suffix: b"1"}
        fields[b"result" + suffix] = b"4"
        if last is not None:
            fields[b"last" + suffix] = str(last).encode()
            fields |= {b"ranks" + suffix: b"0,1", b"hits" + suffix: b"4,4"}
            fields[b"lat" + suffix] = b"100,2000"
    rl = rank_latency([(b"5000-0", fields)])
    assert rl["read"] == 3 and rl["timed"] == 2
    assert rl["ranks"][0]["samples"] == rl["ranks"][1]["samples"] == 2
    assert rl["ranks"][0]["last"] == rl["ranks"][1]["last"] == 1


def test_inspect_rank_latency_percentiles_and_last_share() -> None:
    entries = [
        _entry(10_000 + i, 1 if i % 4 else 0, f"{100 + i},{1000 + 10 * i}") for i in range(100)
    ]
    entries.append(_entry(9_000, None))  # insights off: read, not timed
    rl = rank_latency(entries)
    assert rl["read"] == 101 and rl["timed"] == 100
    assert rl["window_s"] == pytest.approx(1.099)
    zero, one = rl["ranks"][0], rl["ranks"][1]
    assert zero["samples"] == one["samples"] == 100
    assert zero["p50_ms"] == pytest.approx(0.150) and zero["p99_ms"] == pytest.approx(0.199)
    assert one["p50_ms"] == pytest.approx(1.5) and one["p99_ms"] == pytest.approx(1.99)
    assert zero["last_share"] == pytest.approx(0.25) and one["last_share"] == pytest.approx(0.75)


def test_inspect_renders_the_rank_latency_table() -> None:
    snap: dict[str, Any] = {
        "engine_id": "e",
        "time_ms": 0,
        "world_size": 2,
        "ranks": {},
        "groups": [],
        "streams": {},
        "lookups": {"total": 0, "shown": []},
        "dead_letters": [],
        "fingerprints": {},
        "rank_latency": rank_latency([_entry(1000, 1, "250,4000"), _entry(3000, 1, "350,6000")]),
    }
    text = render(snap, "redis://h:6379/0", None)
    assert (
        "RANK LATENCY (submit to report, server clock; 2 of the last 2 completions over 2.0s)"
        in text
    )
    table = text.split("RANK LATENCY", 1)[1].splitlines()
    assert table[1].split() == ["rank", "p50", "p99", "samples", "last", "to", "report"]
    row = next(line for line in table if line.strip().startswith("1 "))
    assert "6.00ms" in row and "100% (2)" in row
    snap["rank_latency"] = rank_latency([_entry(1000, None)])
    assert "none timed: rank_insights is off" in render(snap, "redis://h:6379/0", None)


def test_rate_limited_log_lives_in_broker_lookup() -> None:
    from broker_lookup.ratelimit import RateLimitedLog
    from workers.pipeline import sweeper

    assert RateLimitedLog.__module__ == "broker_lookup.ratelimit"
    assert not hasattr(sweeper, "RateLimitedLog")  # one owner, used by both sides
