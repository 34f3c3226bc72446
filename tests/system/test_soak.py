"""``python -m benchmarks.soak`` for 20 seconds: rank SIGKILLs, server restarts and every kind
of network fault (hold, reset, delay, lost replies of EVALSHA, XREADGROUP, XACK and
XREAD) at a short interval, then a calm stretch, under mixed traffic. No wrong result,
no hang, no key left without a TTL, and no hit answered 0 unless a fault explains it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import cast

import pytest

from benchmarks.soak.chaos import KINDS, Chaos, ChaosTiming
from benchmarks.soak.command import main, run_soak
from benchmarks.soak.faults import FaultLog
from benchmarks.soak.rig import Beats, Proxies, Ranks
from broker_lookup.config import LookupConfig


def test_fault_log_explains_a_lookup_until_the_quiet_time_after_the_fault() -> None:
    log = FaultLog(quiet_s=5.0, origin=0.0)
    hold = log.begin("hold", "rank0", 10.0)
    assert log.quiet(0.0, 9.9) and not log.quiet(9.0, 10.0)  # alive when it started
    assert not log.quiet(30.0, 31.0)  # not over yet: explains everything after its start
    log.end(hold, 12.0)
    assert not log.quiet(16.9, 17.5) and log.quiet(17.1, 18.0)  # 12 + 5 s of quiet time
    lose = log.begin("lose_xack", "rank1", 20.0)
    lose.took_effect = False  # armed, never triggered: explains, but did not occur
    log.end(lose, 20.5)
    log.instant("reset", "client", 40.0)
    assert log.counts() == {"hold": 1, "reset": 1} and log.unfired() == 1
    log.diagnose("lost_hits", {"id": "x"}, 30.0, 31.0)
    (example,) = log.examples["lost_hits"]
    assert example["faults_in_effect"] == [] and example["last_fault_before"]["kind"] == "lose_xack"
    assert example["next_fault_after"]["kind"] == "reset"


def test_a_lost_reply_that_never_happened_is_dealt_again() -> None:
    # No proxy is started, so no XACK ever passes: the armed loss gives up unfired.
    log = FaultLog(quiet_s=1.0, origin=0.0)
    proxies = Proxies("redis://127.0.0.1:1", ["client", "rank0"])
    chaos = Chaos(
        random.Random(0),
        log,
        proxies,
        cast(Ranks, SimpleNamespace(n=1)),
        None,
        cast(Beats, None),
        LookupConfig(),
        ChaosTiming(every_s=(1.0, 1.0), lose_wait_s=0.5),
    )
    chaos._deck = ["lose_xack"]
    chaos.tick(chaos.next_at)
    chaos.tick(1.0)  # given up: disarmed
    assert [(f.kind, f.took_effect) for f in log.faults] == [("lose_xack", False)]
    assert log.counts() == {} and log.unfired() == 1
    chaos.tick(chaos.next_at)
    assert [f.kind for f in log.faults] == ["lose_xack", "lose_xack"]  # the next card dealt


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.long
def test_soak_with_every_fault_kind() -> None:
    # A fault every 0.6-1.0 s from a shuffled deck of all ten kinds: every kind by ~12 s.
    # The last 7 s bring no new fault, so lookups after the last one are judged too.
    summary = run_soak(20, 2, seed=7, chaos_every_s=(0.6, 1.0), calm_s=7)
    bad = {k: summary[k] for k in ("wrong", "hangs", "leaked_keys", "lost_hits")}
    assert bad == dict.fromkeys(bad, 0), (bad, summary["diagnosis"], summary["fault_log"])
    assert set(summary["faults"]) == set(KINDS), summary["fault_log"]
    assert summary["quiet_hits"] > 0, summary  # lost hits were judged on something
    assert summary["right"] > 100 and summary["cancels"] > 0 and summary["reused_ids"] > 0
    assert summary["rank_exit_codes"] == [0, 0]  # SIGTERM at the end: ordered exits
    assert all(kb for kb in summary["rss_kb_start"].values()), summary["rss_kb_start"]
    assert all(kb for kb in summary["rss_kb_end"].values()), summary["rss_kb_end"]
    assert summary["p99_latency_ms"] > 0
    assert isinstance(summary["breaker_openings"], int) and isinstance(summary["rejected"], dict)


def test_soak_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--duration", "0"]) == 2
    assert "--duration" in capsys.readouterr().err
    assert main(["--duration", "5", "--calm", "5"]) == 2
    assert "--calm" in capsys.readouterr().err
    assert main(["--chaos-every", "3-1"]) == 2
    assert "MIN <= MAX" in capsys.readouterr().err
