"""``python -m benchmarks.route``: the event-fed index applies events only after its lag,
and a quick run measures every arm and the query end to end.

No timing thresholds (CI boxes are loaded): the run's checks are what must hold whatever
the load: round robin expects nothing so never false-hits; a reservation that pinned all
it was asked keeps its route from false-hitting unless the engine restarted; engines
evict; every query is answered.
"""

from __future__ import annotations

import argparse

import pytest
import redis
from helpers import RealServer

from benchmarks.route.__main__ import _defaults, parser, run
from benchmarks.route.policies import EventIndex
from benchmarks.route.report import render
from benchmarks.route.trace import Request


def _request(hashes: list[int]) -> Request:
    return Request(0, [], hashes, [256] * len(hashes))


def test_the_index_sees_each_event_only_after_its_lag() -> None:
    index = EventIndex(3, lag_s=0.1)
    prompt = _request([11, 22, 33])
    index.emitted(0.0, [(2, "stored", 11), (2, "stored", 22)])
    assert index.route(prompt, 0.09)[1] == 0  # not yet: round robin's turn, no expectation
    assert index.route(prompt, 0.1) == (2, 512)
    index.emitted(0.2, [(2, "evicted", 22), (1, "stored", 11)])
    assert index.route(prompt, 0.25) == (2, 512)  # stale: the eviction is still in flight
    assert index.route(prompt, 0.31)[1] == 256
    index.emitted(0.4, [(2, "cleared", 0)])
    assert index.route(prompt, 0.5) == (1, 256)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--engines", "0", ">= 1"),
        ("--restarts", "-1", ">= 0"),
        ("--rate", "nan", "> 0"),
        ("--lags-ms", "10,x", "integers"),
    ],
)
def test_bad_options_are_refused_by_name(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err and says in err


def test_quick_shrinks_only_what_was_not_given() -> None:
    quick = _args("--engines", "6")
    assert (quick.engines, quick.requests, quick.latency_engines) == (6, 150, [4])
    full = parser().parse_args([])
    _defaults(full)
    assert (full.engines, full.requests, full.latency_engines) == (8, 2000, [4, 8, 16])


def _args(*argv: str) -> argparse.Namespace:
    args = parser().parse_args(["--quick", *argv])
    _defaults(args)
    return args


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_quick_run_measures_every_arm_and_the_query(real_server: RealServer) -> None:
    args = _args("--requests", "120", "--queries", "40", "--lags-ms", "10,1000")
    result = run(args, real_server.url)
    arms = result["arms"]
    assert list(arms) == [
        "fleet query, reserve 2000 ms",
        "fleet query, no reservation",
        "event index, lag 10 ms",
        "event index, lag 1000 ms",
        "round robin",
    ]
    for name, arm in arms.items():
        assert arm["requests"] == 120, name
        assert arm["evictions"] > 0, name  # finite capacity: the trace overflows it
        assert arm["false_hits"] <= arm["routed_expecting"], name
    rr = arms["round robin"]
    assert (rr["routed_expecting"], rr["false_hits"]) == (0, 0)
    reserved = arms["fleet query, reserve 2000 ms"]
    assert reserved["queries_failed"] == 0 and reserved["query"]["n"] == 120
    assert reserved["routed_expecting"] > 0 and reserved["reservations_reserved"] > 0
    # Every false hit of a reserved route is a restart or a reservation that fell short.
    assert reserved["false_hits_unexplained"] == 0
    assert reserved["false_hits_reserved_short"] <= reserved["reserved_short"]
    for arm in arms.values():
        assert arm["false_hits"] == (
            arm["false_hits_restart"]
            + arm["false_hits_reserved_short"]
            + arm["false_hits_unexplained"]
        )
    assert arms["fleet query, no reservation"].get("reservations_reserved", 0) == 0
    (cost,) = result["query_cost"]
    assert cost["engines"] == 4 and cost["latency"]["n"] == 40
    assert cost["commands_per_query"]["blpop"] >= 1
    assert cost["redis_cpu_us_per_query_gross"] > 0 and cost["commandstats_us_per_query"] > 0
    result.update(settings=vars(args), load_average=[(1.0, 1.0, 1.0)] * 2, cpus=2, seconds=1.0)
    table = render(result)
    assert "round robin" in table and "4 engines" in table
    server = redis.Redis.from_url(real_server.url)
    try:  # the run's keys are gone: a shared server keeps no litter
        assert list(server.scan_iter(match=f"bl:{{bench-{result['run_id']}-*")) == []
    finally:
        server.close()
