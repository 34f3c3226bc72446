"""The dispatcher on its own: an engine that records every call, a clock the test moves,
and a reporter whose thread never starts (its queue and batch window are read directly)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from helpers import lookup_request

from broker_lookup.config import LookupConfig
from broker_lookup.histogram import LATENCY_BUCKETS
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, Request
from workers.pipeline import dispatch as dispatch_module
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.lifecycle import Lifecycle
from workers.pipeline.reporter import Report

RANK = 1
EXPECTED = [0, RANK]  #: the ranks of every lookup
TOKENS = 8  #: of every lookup: lookup_request's two chunks of 4
GRACE_S = 0.5
PIN_TTL_S = 4.0


class Engine:
    """Records every call; answers at once, later (a test step), or raises, per lookup."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.modes: dict[str, str] = {}
        self.report: Any = None  # the dispatcher's report, once built

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = False,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        self.calls.append(("start", lookup_id))
        mode = self.modes.get(lookup_id, "instant")
        if mode == "raise":
            raise RuntimeError(f"engine broke on {lookup_id}")
        if mode == "instant":
            self.report(lookup_id, sum(offsets))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        self.calls.append(("cleanup", lookup_id))

    def keep_memory_objs(self, lookup_id: str, tokens: int) -> None:
        self.calls.append(("keep", lookup_id, tokens))

    def released(self, lookup_id: str) -> int:
        """How many times ``lookup_id`` was cleaned up."""
        return self.calls.count(("cleanup", lookup_id))


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Rank:
    """One dispatcher and everything it touches."""

    def __init__(self) -> None:
        config = LookupConfig(
            redis_url="redis://127.0.0.1:1/0",
            worker_pin_ttl_ms=int(PIN_TTL_S * 1000),
            worker_watchdog_grace_ms=int(GRACE_S * 1000),
            partial_answers=True,
        )
        self.clock = Clock()
        self.engine = Engine()
        self.life = Lifecycle(100, PIN_TTL_S, 3.0, GRACE_S)
        self.dispatcher = Dispatcher(
            self.engine, self.life, config, KeySpace("d"), RANK, _no_connection, self.clock
        )
        self.engine.report = self.dispatcher.report
        self.reporter = self.dispatcher.reporter

    def queued(self) -> list[Report]:
        """The reports waiting for the reporter's thread (never started here)."""
        return list(vars(self.reporter)["_queue"])

    def start(self, lookup_id: str, mode: str = "later", budget_ms: float = 1_000.0) -> None:
        self.engine.modes[lookup_id] = mode
        self.dispatcher.handle(lookup_request(lookup_id, 0, expected=EXPECTED), budget_ms)

    def sweep_at(self, dt: float) -> None:
        """Move the clock ``dt`` seconds on, then sweep."""
        self.clock.now += dt
        self.dispatcher.sweep(self.clock.now)


def _no_connection() -> Any:
    raise AssertionError("the reporter's thread is not started in these tests")


def test_an_engine_that_raises_is_answered_0_with_its_traceback_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rank = Rank()
    with caplog.at_level(logging.ERROR, logger=dispatch_module.__name__):
        rank.start("a", mode="raise")
    assert rank.queued() == [Report("a", 0, 0)]
    assert rank.dispatcher.counts()["engine_errors"] == 1
    (record,) = caplog.records
    assert record.exc_info is not None and "engine broke on a" in str(record.exc_info[1])
    assert "engine failed to start a" in record.getMessage()


def test_a_base_exception_from_the_engine_is_not_swallowed() -> None:
    rank = Rank()

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    rank.engine.async_lookup_and_prefetch = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        rank.dispatcher.handle(lookup_request("a", 0, expected=EXPECTED), 250.0)
    assert "engine_errors" not in rank.dispatcher.counts()


def test_a_batch_that_raises_queues_its_reports() -> None:
    """An engine's BaseException ends the batch: the window closes failed, the reports
    made so far go to the queue (the batch is not acked), and the exception propagates."""
    rank = Rank()
    original = rank.engine.async_lookup_and_prefetch

    def interrupted(lookup_id: str, *args: Any, **kw: Any) -> None:
        if lookup_id == "b":
            raise KeyboardInterrupt
        original(lookup_id, *args, **kw)

    rank.engine.async_lookup_and_prefetch = interrupted  # type: ignore[method-assign]
    batch: list[tuple[Request, float]] = [
        (lookup_request(i, 0, expected=EXPECTED), 250.0) for i in ("a", "b", "c")
    ]
    with pytest.raises(KeyboardInterrupt):
        rank.dispatcher.serve(batch)
    assert rank.queued() == [Report("a", 0, TOKENS)]
    assert vars(rank.reporter)["_riding"] is None
    assert rank.engine.calls == [("start", "a")]  # c never reached the engine


def test_engine_times_on_a_bucket_edge_land_in_that_bucket() -> None:
    rank = Rank()
    clock = rank.clock
    edges = [edge for edge in LATENCY_BUCKETS if (clock.now + edge) - clock.now == edge]
    assert len(edges) >= 4  # 0.5, 1.0, 2.5, 5.0 are exact in binary
    for i, edge in enumerate(edges):
        started = clock.now
        rank.start(f"e{i}", budget_ms=10_000.0)
        clock.now = started + edge
        rank.dispatcher.report(f"e{i}", 1)
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    for edge in edges:
        expected[LATENCY_BUCKETS.index(edge)] += 1
    assert rank.dispatcher.engine_seconds == expected


def test_one_lookup_reported_then_held_then_released_on_abort() -> None:
    rank = Rank()
    with rank.reporter.riding() as riding:
        rank.start("a", mode="instant")
    assert riding == [Report("a", 0, TOKENS)]
    rank.dispatcher.settle(riding[0], "complete")
    assert rank.life.sizes()["held"] == 1
    rank.dispatcher.handle(Abort(lookup_id="a", gen=0), float("inf"))
    assert rank.engine.released("a") == 1
    assert rank.dispatcher.counts() == {
        "start": 1,
        "requests": 1,
        "report_complete": 1,
        "aborts": 1,
        "released": 1,
    }


def test_a_report_that_lands_after_the_deadline_answered_keeps_the_promised_prefix() -> None:
    """The deadline answered 4 tokens from the rank's progress; the rank's final report (8)
    reached Redis before the rank read the keep: ``settled:4``. The rank keeps 4 pinned."""
    rank = Rank()
    rank.start("a")
    rank.clock.now += 1.2
    rank.dispatcher.report("a", TOKENS)
    [report] = rank.queued()
    rank.dispatcher.settle(report, "settled:4")
    assert rank.engine.calls == [("start", "a"), ("keep", "a", 4)]
    assert rank.life.sizes()["held"] == 1
    assert rank.dispatcher.counts()["report_settled"] == 1
    rank.dispatcher.handle(Keep(lookup_id="a", gen=0, tokens=4), float("inf"))
    rank.sweep_at(PIN_TTL_S - 0.1)
    assert rank.engine.released("a") == 0
    rank.sweep_at(0.2)
    assert rank.engine.released("a") == 1


def test_the_watchdog_leaves_a_kept_prefix_of_an_engine_still_loading() -> None:
    rank = Rank()
    rank.start("a")  # deadline 1 s, the watchdog's time 1.5 s
    rank.clock.now += 1.05
    rank.dispatcher.handle(Keep(lookup_id="a", gen=0, tokens=4), float("inf"))
    rank.sweep_at(1.0)
    assert rank.engine.released("a") == 0 and rank.queued() == []  # no 0 reported
    rank.dispatcher.report("a", TOKENS)  # the slow tier finishes: held, not sent
    assert rank.queued() == [] and rank.life.sizes()["held"] == 1
    rank.sweep_at(PIN_TTL_S)
    assert rank.engine.released("a") == 1


def test_a_late_report_after_the_watchdog_and_close_release_what_the_engine_pinned() -> None:
    """The watchdog released ``a`` while its prefetch ran; the engine pinned when it ended:
    its late report releases again. ``b`` is released by the watchdog and never reports:
    close releases it again. ``c`` runs at close: its report after close releases it."""
    rank = Rank()
    rank.start("a")
    rank.start("b")
    rank.sweep_at(1.6)
    assert rank.queued() == [Report("a", 0, 0), Report("b", 0, 0)]  # the watchdog's 0s
    assert rank.engine.released("a") == rank.engine.released("b") == 1
    rank.dispatcher.report("a", TOKENS)
    assert rank.engine.released("a") == 2
    assert rank.dispatcher.counts()["report_late"] == 1
    rank.start("c")
    rank.dispatcher.release_all()
    assert (rank.engine.released("b"), rank.engine.released("c")) == (2, 1)
    assert rank.engine.released("a") == 2  # its late report released it already
    rank.dispatcher.report("c", TOKENS)
    assert rank.engine.released("c") == 2
