"""``python -m benchmarks.soak --engines 4`` for 40 seconds: engines stopping (SIGTERM and SIGKILL)
and new ones starting throughout, rank kills and network faults on one engine, and, where
the build has one owner per rank, a second scheduler and a second rank process on the
steady engine. No wrong result, no hang, no lost hit, no key without a TTL; and where
the build has an engine TTL, no key of a gone engine past it and memory bounded.
"""

from __future__ import annotations

import pytest

from benchmarks.soak.command import main
from benchmarks.soak.fleet import FleetOptions, run_fleet


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)  # startup of 4 engines on a loaded box takes its time
def test_fleet_soak_short() -> None:
    options = FleetOptions(
        engines=4,
        duration_s=40.0,
        seed=3,
        churn_every_s=(3.0, 5.0),
        chaos_every_s=(3.0, 6.0),
        calm_s=8.0,
        faulty=1,
        stream_cap=500,  # live engines' streams full within seconds: memory's plateau
    )
    s = run_fleet(options)
    failing = {k: c for k, c in s["checks"].items() if c["enforced"] and c["value"]}
    assert not failing, (failing, s["diagnosis"], s["keys"], s["memory"])
    assert s["passed"]
    engines = s["engines"]
    assert engines["stopped_term"] >= 1 and engines["stopped_kill"] >= 1, s["engine_log"]
    assert engines["started"] == 4 + engines["stopped_term"] + engines["stopped_kill"]
    assert engines["stopped_at_end"] == 4 and engines["faulty"] == [1]
    assert s["faults"].get("engine_kill") == engines["stopped_kill"], s["faults"]
    assert len(s["faults"]) >= 3, s["faults"]  # the faulty engine's faults too
    assert s["quiet_hits"] > 100 and s["right"] > 1000  # lost hits were judged on something
    assert s["term_exit_codes"] == {0: s["term_exit_codes"][0]}  # ordered stops exit 0
    assert s["lookups_per_s"] > 0 and s["redis_cpu_us_per_lookup"] > 0
    per_core = 1e6 / s["redis_cpu_us_per_lookup"]  # what one core serves at that cost
    assert abs(s["lookups_per_s_per_redis_core"] - per_core) <= 0.01 * per_core + 1
    assert len(s["memory_series"]) >= 15 and s["memory"]["judged"], s["memory_series"]
    # Every engine that ran is gone, and what it left has a TTL (streams too, with one).
    # An engine stopped early may have nothing left at all by the end: its keys expired
    # within the engine TTL, as they must.
    assert 0 < s["keys"]["gone_engines_with_keys"] <= engines["started"]
    assert s["keys"]["no_ttl"] == []
    if s["features"]["engine_ttl"]:
        assert s["keys"]["streams_without_ttl"] == [] and s["keys"]["overdue"] == []
        assert s["keys"]["gone_max_pttl_ms"] <= s["engine_ttl_ms"]
    dups = s["duplicates"]
    assert dups["ran"] == s["features"]["ownership"]
    if dups["ran"]:
        assert dups["scheduler_lookups"] > 0 and dups["scheduler_answered_not_0"] == 0, dups


def test_fleet_soak_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--engines", "4", "--ranks", "2"]) == 2
    assert "--ranks is not for --engines" in capsys.readouterr().err
    assert main(["--engines", "1"]) == 2
    assert "--engines must be >= 2" in capsys.readouterr().err
    assert main(["--engines", "4", "--duration", "10"]) == 2  # calm 10 s by default
    assert "--calm" in capsys.readouterr().err
    assert main(["--engines", "4", "--churn-every", "5-2"]) == 2
    assert "MIN <= MAX" in capsys.readouterr().err
