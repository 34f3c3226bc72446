"""``python -m benchmarks.soak --liveness`` for 30 seconds: two ranks around a synchronous
30 ms engine with 2.5 s stalls, rank 1's link 150-200 ms each way, bursts of 50 lookups.
0 wrong, 0 ``dead_rank`` answers (no rank process ever dies), 0 fenced reports (each rank
is its sole owner), 0 broken promises, 0 hangs; and the faults did happen."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

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


def test_liveness_soak_cli_refuses_what_it_does_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--liveness", "--ranks", "1"]) == 2
    assert "--ranks >= 2" in capsys.readouterr().err
    for extra in (["--engines", "4"], ["--calm", "3"], ["--chaos-every", "2-3"]):
        assert main(["--liveness", *extra]) == 2
        assert "--liveness takes no" in capsys.readouterr().err
