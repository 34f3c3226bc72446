"""The rank's reporter routes each report by the read loop's window, not by thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import fakeredis
import pytest
from helpers import wait_until
from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import request_configs_problem
from workers.pipeline.reporter import SCRIPT_BATCH_MAX, Report, Reporter, _spread


def _reporter(settled: list[tuple[Report, str]]) -> Reporter:
    def no_connection() -> Any:  # the thread is never started here
        raise AssertionError("no connection expected")

    return Reporter(
        LookupConfig(), KeySpace("e"), 0, no_connection, lambda r, a: settled.append((r, a))
    )


def test_a_report_made_while_a_batch_is_served_rides_with_it_from_any_thread() -> None:
    reporter = _reporter([])
    with reporter.riding() as reports:
        reporter.put(Report("a", 1, 4))
        other = threading.Thread(target=reporter.put, args=(Report("b", 1, 0),))
        other.start()
        other.join(5)
    assert reports == [Report("a", 1, 4), Report("b", 1, 0)]
    assert reporter.queued == 0


def test_a_report_made_outside_a_batch_is_queued() -> None:
    reporter = _reporter([])
    with reporter.riding():
        pass
    reporter.put(Report("late", 2, 8))
    assert reporter.queued == 1


def test_reports_of_a_batch_that_failed_to_serve_are_queued() -> None:
    reporter = _reporter([])
    with pytest.raises(RuntimeError), reporter.riding() as reports:
        reporter.put(Report("a", 1, 4))
        raise RuntimeError("bug while serving")
    assert reports == [] and reporter.queued == 1


def test_a_report_beyond_the_bounded_queue_is_answered_overflow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settled: list[tuple[Report, str]] = []
    reporter = _reporter(settled)
    monkeypatch.setattr(reporter, "_max_queue", 1)
    reporter.put(Report("a", 1, 4))
    reporter.put(Report("b", 1, 4))
    assert settled == [(Report("b", 1, 4), "overflow")] and reporter.overflows == 1


@pytest.mark.parametrize(
    ("configs", "kind"),
    [
        (None, None),
        ({"lmcache.tag.user": "x"}, None),
        ({"k": "x" * 100}, "configs_too_large"),
        ({1: "int key"}, "bad_configs"),
        (["not", "a", "dict"], "bad_configs"),
        ({"k": object()}, "bad_configs"),
    ],
)
def test_one_request_configs_rule_for_client_and_ranks(configs: object, kind: str | None) -> None:
    problem = request_configs_problem(configs, 64)
    assert (problem.kind if problem else None) == kind


def test_an_idle_reporter_thread_sleeps_until_a_report_rings_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No idle ticks inside a vLLM worker: the thread wakes for reports, not for a clock."""
    fake = fakeredis.FakeServer()
    settled: list[tuple[Report, str]] = []
    reporter = Reporter(
        LookupConfig(),
        KeySpace("e"),
        0,
        lambda: fakeredis.FakeRedis(server=fake),
        lambda r, a: settled.append((r, a)),
    )
    wakes = 0

    def counting(link: Any, client: Any) -> None:
        nonlocal wakes
        wakes += 1

    monkeypatch.setattr(reporter, "_idle", counting)
    reporter.start()
    try:
        time.sleep(0.5)  # five ticks of the Batcher's default
        assert wakes <= 1
        reporter.put(Report("late", 1, 4))  # queued: rings the sleeping thread
        wait_until(lambda: bool(settled), timeout=5, message="the queued report sent")
    finally:
        assert reporter.stop(5)
    assert settled[0][0] == Report("late", 1, 4)


def test_final_reports_of_one_round_trip_go_as_one_batch_and_each_gets_its_answer() -> None:
    reporter = _reporter([])
    reports = [
        Report("a", 1, 4),
        Report("p", 1, 8, progress=True),
        Report("b", 2, 0),
        Report("c", 3, 12),
    ]
    calls, plan = reporter._calls(reports)
    assert [c.script for c in calls] == ["report", "progress"]
    batch = calls[0]
    assert batch.args[0] == "batch" and list(batch.args[6:]) == [1, 4, "a", 2, 0, "b", 3, 12, "c"]
    assert list(batch.keys) == [KeySpace("e").done, *(KeySpace("e").lookup(i) for i in "abc")]
    answers = _spread([[b"recorded", b"stale", b"complete"], b"recorded"], plan)
    assert answers == [b"recorded", b"recorded", b"stale", b"complete"]
    failed = ResponseError("BUSY")
    assert _spread([failed, b"behind"], plan) == [failed, b"behind", failed, failed]
    # One final report alone keeps the single call.
    single, _ = reporter._calls([Report("a", 1, 4)])
    assert single[0].args[0] == 0 and len(single[0].keys) == 2


def test_a_turn_of_many_reports_goes_in_script_calls_of_bounded_size() -> None:
    """A read of batch entries can hand a rank thousands of lookups in one turn: their
    reports go in ``report.lua`` calls of at most SCRIPT_BATCH_MAX, each report's answer
    found in its own call's list."""
    reporter = _reporter([])
    n = 2 * SCRIPT_BATCH_MAX + 5
    reports = [Report(f"l{i}", 1, i % 7) for i in range(n)]
    reports.insert(3, Report("p", 1, 8, progress=True))
    calls, plan = reporter._calls(reports)
    assert [c.script for c in calls] == ["report"] * 3 + ["progress"]
    assert [len(c.keys) - 1 for c in calls[:3]] == [SCRIPT_BATCH_MAX, SCRIPT_BATCH_MAX, 5]
    ids = [str(k).rsplit(":", 1)[-1] for c in calls[:3] for k in c.keys[1:]]
    assert ids == [f"l{i}" for i in range(n)]  # in order, each once
    results: list[Any] = [
        [f"{c}-{p}".encode() for p in range(len(call.keys) - 1)] for c, call in enumerate(calls[:3])
    ]
    answers = _spread([*results, b"behind"], plan)
    assert answers[3] == b"behind"
    finals = answers[:3] + answers[4:]
    assert finals == [f"{i // SCRIPT_BATCH_MAX}-{i % SCRIPT_BATCH_MAX}".encode() for i in range(n)]
