"""``stats()`` as typed structs: what a metrics snapshot holds of them, and how the exporter
reads snapshots of this version, of older ones, and malformed ones."""

from __future__ import annotations

from typing import Any

import fakeredis
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.errors import MalformedMessage
from broker_lookup.ops.exporter import FleetCollector, render_once
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.snapshot import MetricsSnapshot, encode_snapshot
from broker_lookup.protocol.stats import (
    ClientStats,
    ConsumerStats,
    InsightsStats,
    Ownership,
    RankInsightRow,
    RankStats,
    as_json_object,
    client_stats,
    rank_stats,
)

CLIENT = ClientStats(
    outcomes={"hit": 2, "timeout": 1},
    dead_ranks=(1,),
    latency_counts=(1, 0, 2),
    ownership=Ownership(owner=True, epoch=4, conflicts=1),
    rank_insights=InsightsStats(recorded=3, ranks={0: RankInsightRow(last=2), 1: RankInsightRow()}),
)
RANK = RankStats(
    rank=1,
    counts={"requests": 5},
    held=2,
    engine_seconds=(0, 1),
    consumer=ConsumerStats(pending=3),
    alive=True,
)


def _through_json(values: dict[str, Any]) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(values))
    return decoded


def test_stats_survive_the_snapshot_json() -> None:
    assert client_stats(_through_json(as_json_object(CLIENT))) == CLIENT
    assert rank_stats(_through_json(as_json_object(RANK))) == RANK


def test_the_snapshot_holds_field_names_as_before() -> None:
    """The JSON a snapshot holds is keyed by the field names the dicts had."""
    values = _through_json(as_json_object(CLIENT))
    assert values["dead_ranks"] == [1] and values["ownership"]["owner"] is True
    assert values["rank_insights"]["ranks"]["0"]["last"] == 2
    assert _through_json(as_json_object(ClientStats()))["rank_insights"] is None
    assert _through_json(as_json_object(RANK))["consumer"]["pending"] == 3


def test_older_snapshots_read_with_defaults_and_unknown_fields_ignored() -> None:
    # rank_insights off was {} before it was None; a field may be missing or unknown.
    old = client_stats({"outcomes": {"hit": 1}, "rank_insights": {}, "retired_field": 7})
    assert old.outcomes == {"hit": 1} and old.inflight == 0
    assert old.rank_insights is not None and not old.rank_insights.ranks
    assert rank_stats({"rank": 2, "consumer": {"lag": 4}}).consumer.lag == 4


def test_a_field_of_the_wrong_type_is_malformed() -> None:
    with pytest.raises(MalformedMessage, match=r"ClientStats.*\$\.outcomes"):
        client_stats({"outcomes": "many"})


def _exporter_with(stats: dict[str, Any]) -> dict[str, float]:
    conn = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    snap = MetricsSnapshot(
        kind="client", role="sched", host="h", pid=1, started_ms=0, ts_ms=0, stats=stats
    )
    conn.set(KeySpace("e1").metrics("sched"), encode_snapshot(snap), px=60_000)
    text = render_once(FleetCollector(lambda: conn)).decode()
    return {
        s.name + str(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "broker_lookup_exporter_snapshots"
    }


def test_the_exporter_counts_a_snapshot_with_malformed_stats_and_scrapes_on() -> None:
    assert _exporter_with(as_json_object(CLIENT)) == {
        "broker_lookup_exporter_snapshots[('state', 'read')]": 1.0,
        "broker_lookup_exporter_snapshots[('state', 'malformed')]": 0.0,
        "broker_lookup_exporter_snapshots[('state', 'denied')]": 0.0,
    }
    assert _exporter_with({"dead_ranks": "none"}) == {
        "broker_lookup_exporter_snapshots[('state', 'read')]": 0.0,
        "broker_lookup_exporter_snapshots[('state', 'malformed')]": 1.0,
        "broker_lookup_exporter_snapshots[('state', 'denied')]": 0.0,
    }
