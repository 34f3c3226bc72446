"""``python -m benchmarks.soak --liveness`` for 30 seconds: two ranks around a synchronous
30 ms engine with 2.5 s stalls, rank 1's link 150-200 ms each way, bursts of 50 lookups.
0 wrong, 0 ``dead_rank`` answers (no rank process ever dies), 0 fenced reports (each rank
is its sole owner), 0 broken promises, 0 hangs; and the faults did happen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from benchmarks.soak.box_stalls import BoxStalls
from benchmarks.soak.command import main
from benchmarks.soak.slow_rank import SyncEngine


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(240)
def test_liveness_soak_short(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "liveness.json"
    argv = ["--liveness", "--duration", "30", "--seed", "5", "--json", str(out)]
    code = main([*argv, "--workdir", str(tmp_path / "work")])
    s: dict[str, Any] = json.loads(out.read_text())
    assert code == 0, capsys.readouterr().err
    assert s["passed"]
    for name in ("wrong", "dead_rank", "fenced", "broken_promises", "hangs", "unexpected_exits"):
        assert s[name] == 0, (name, s)
    assert s["right"] > 50 and s["bursts"] >= 1, s
    assert all(n >= 1 for n in s["stalls"]), s["stalls"]  # every rank stalled past its lease
    low, high = s["delays_drawn_ms"]
    assert s["slow_ranks"] == [1] and 150 <= low <= high <= 200, s
    assert s["leases_lost"] == [0, 0], s
    assert s["client_outcomes"].get("hit", 0) == s["right"], s
    # dead_rank answers of a stalled box are counted apart, and only in a stall
    assert s["box_stalls"] > 0 or s["dead_rank_in_box_stalls"] == 0, s


class _Sink:
    def __init__(self) -> None:
        self.reports: list[tuple[str, int]] = []

    def send_response_to_scheduler(self, lookup_id: str, hits: int) -> None:
        self.reports.append((lookup_id, hits))


def test_sync_engine_answers_full_hits_stalls_as_told_and_records_releases() -> None:
    engine = SyncEngine(0.0, stall_s=0.05, stall_at=2)
    sink = _Sink()
    engine.post_init(sink)
    for i in range(3):
        engine.async_lookup_and_prefetch(f"l{i}", [1, 2], [16, 16])
    assert sink.reports == [("l0", 32), ("l1", 32), ("l2", 32)]
    assert engine.calls == 3 and engine.stalls == 1
    engine.cleanup_memory_objs("l0")
    engine.stopping = True
    engine.cleanup_memory_objs("l1")  # at the stop: not early
    assert engine.released_early == ["l0"]


@pytest.mark.parametrize(("pin_ttl_s", "early"), [(0.0, []), (3600.0, ["l0"])])
def test_sync_engine_tells_a_release_at_the_pin_ttl_from_an_early_one(
    pin_ttl_s: float, early: list[str]
) -> None:
    engine = SyncEngine(0.0, pin_ttl_s=pin_ttl_s)
    engine.post_init(_Sink())
    engine.async_lookup_and_prefetch("l0", [1], [16])
    engine.cleanup_memory_objs("l0")
    assert engine.released_early == early
    assert engine.released_at_ttl == 1 - len(early)


def test_liveness_soak_cli_refuses_what_it_does_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--liveness", "--ranks", "1"]) == 2
    assert "--ranks >= 2" in capsys.readouterr().err
    for extra in (["--engines", "4"], ["--calm", "3"], ["--chaos-every", "2-3"]):
        assert main(["--liveness", *extra]) == 2
        assert "--liveness takes no" in capsys.readouterr().err


def test_box_stalls_are_the_late_steps_and_explain_what_follows_them() -> None:
    stalls = BoxStalls(redis.Redis(), threshold_s=1.0)  # never started: no ping
    stalls.step(100.0)  # the first step: 100 s on this fake clock
    for now in (100.5, 101.0, 103.0, 103.2):  # one step 2 s late: 101.0 -> 103.0
        stalls.step(now)
    assert stalls.stalls == [(101.0, 103.0)] and stalls.total_s() == 2.0
    assert stalls.explains(102.0, grace_s=3.0) and stalls.explains(105.9, grace_s=3.0)
    assert not stalls.explains(106.1, grace_s=3.0) and not stalls.explains(100.9, grace_s=3.0)
