"""The dispatcher's C path (``workers/pipeline/_dispatch.c``) against its Python path.

Two dispatchers, each with its own lifecycle, engine, reporter and clock, take the same
random requests (fresh, duplicate, of other ranks, expired, with odd budgets), aborts,
keeps, engine reports (valid, out of range, not an int, from an engine that raised),
Redis answers, batch windows, progress and sweeps. One is built with the extension, the
other without. After every step both must hold the same: counters, the engine-time
histogram and its sum, the engine's calls, the reports riding or queued, the
lifecycle's maps and the log lines. And the C path must have served most calls itself,
so the comparison is not vacuous. Without the extension built these skip, except under
``CI``, which must build it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import ModuleType
from typing import Any
from unittest import mock

import pytest
from helpers import optional_extension
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from lifecycle_state import lifecycle_state

from broker_lookup.config import LookupConfig
from broker_lookup.ops.histogram import LATENCY_BUCKETS
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, LookupRequest, Request
from workers.pipeline import dispatch as dispatch_module
from workers.pipeline import reporter as reporter_module
from workers.pipeline.dispatch import Dispatcher
from workers.pipeline.lifecycle import Lifecycle
from workers.pipeline.reporter import Report

RANK = 1
IDS = st.sampled_from(("a", "b", "c", "d"))
GENS = st.integers(min_value=-1, max_value=3)
TOKENS = 8
#: Budgets the reader may hand over: ints and floats, past the pin TTL, 0, negative,
#: infinite, past what a double holds exactly (the reader makes none NaN).
BUDGETS = st.sampled_from((-5, 0, 0.0, 3, 250.0, 2_500, 1e12, 2**60, float("inf"), -float("inf")))
HITS = st.sampled_from((0, 4, TOKENS, TOKENS + 1, -1, True, 4.0, "4", 2**70))
ANSWERS = st.sampled_from(
    ("complete", "recorded", "duplicate", "dropped", "stale", "error", "overflow")
)
MODES = st.sampled_from(("instant", "later", "raise"))
#: The Python methods the C path hands each entry point's other cases to.
HANDED_TO = {
    "handle": ("_handle", "_handle_otherwise"),
    "report": ("_report_otherwise",),
    "settle": ("_settle", "_settle_otherwise"),
    "serve": ("_serve",),
}


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
        self.calls.append(("start", lookup_id, tuple(hashes), tuple(offsets), pin, request_configs))
        mode = self.modes.get(lookup_id, "instant")
        if mode == "raise":
            raise RuntimeError(f"engine broke on {lookup_id}")
        if mode == "instant":
            self.report(lookup_id, sum(offsets))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        self.calls.append(("cleanup", lookup_id))

    def keep_memory_objs(self, lookup_id: str, tokens: int) -> None:
        self.calls.append(("keep", lookup_id, tokens))


class Clock:
    """A monotonic clock the test moves; read as often as either path likes."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """The dispatcher's log lines, for one of the two."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()} {bool(record.exc_info)}")


class Side:
    """One dispatcher and everything it touches."""

    def __init__(self, clock: Clock) -> None:
        config = LookupConfig(
            redis_url="redis://127.0.0.1:1/0",
            worker_pin_ttl_ms=4_000,
            worker_dedupe_capacity=3,
            partial_answers=True,
        )
        self.engine = Engine()
        self.life = Lifecycle(3, 4.0, 3.0, 0.5)
        self.dispatcher = Dispatcher(
            self.engine, self.life, config, KeySpace("eq"), RANK, _no_connection, clock
        )
        self.engine.report = self.dispatcher.report
        self.reporter = self.dispatcher.reporter
        #: What serve returned: the reports a batch's write sends with its XACK.
        self.sent: list[Report] = []
        # How many calls C handed to the Python methods that take the other cases.
        self.handed = dict.fromkeys(HANDED_TO, 0)
        self._inside = False
        for entry, methods in HANDED_TO.items():
            for method in methods:
                self._watch(entry, method)

    def _watch(self, entry: str, method: str) -> None:
        python = getattr(self.dispatcher, method)

        def counted(*args: Any) -> Any:
            if self._inside:  # called by another Python method: handed over already
                return python(*args)
            self.handed[entry] += 1
            self._inside = True
            try:
                return python(*args)
            finally:
                self._inside = False

        setattr(self.dispatcher, method, counted)

    def state(self) -> dict[str, Any]:
        d = self.dispatcher
        riding = vars(self.reporter)["_riding"]
        return {
            "counts": d.counts(),
            "histogram": list(d.engine_seconds),
            "histogram_sum": d.engine_seconds_sum,
            "engine": list(self.engine.calls),
            "riding": None if riding is None else list(riding),
            "sent": list(self.sent),
            "queued": list(vars(self.reporter)["_queue"]),
            "overflows": self.reporter.overflows,
            "lifecycle": lifecycle_state(self.life),
        }


def _made(state: dict[str, Any]) -> list[Report]:
    """The reports a side made and Redis has not answered: sent, riding, then queued."""
    return [*state["sent"], *(state["riding"] or []), *state["queued"]]


def _no_connection() -> Any:
    raise AssertionError("the reporter's thread is not started in these tests")


@contextmanager
def _python_only() -> Iterator[None]:
    with (
        mock.patch.object(dispatch_module, "_dispatch", None),
        mock.patch.object(reporter_module, "_dispatch", None),
    ):
        yield


def _req(lookup_id: str, gen: int, here: bool, configs: dict[str, Any] | None = None) -> Request:
    return LookupRequest(
        lookup_id=lookup_id,
        gen=gen,
        hashes=[11, 12],
        offsets=[TOKENS // 2, TOKENS - TOKENS // 2],
        expected=[0, RANK] if here else [0],
        deadline_ms=0,
        tokens=TOKENS,
        request_configs=configs,
    )


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return optional_extension("workers.pipeline._dispatch")


class Twins(RuleBasedStateMachine):
    """The same inputs to a dispatcher with the C path and to one without."""

    served: dict[str, int]

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.fast = Side(self.clock)
        with _python_only():
            self.slow = Side(self.clock)
        assert isinstance(self.fast.dispatcher.handle, partial)
        assert not isinstance(self.slow.dispatcher.handle, partial)
        self.lines = {"fast": Lines(), "slow": Lines()}
        self._logger = logging.getLogger(dispatch_module.__name__)
        self._logger.setLevel(logging.DEBUG)

    def _both(self, call: str, *args: Any) -> None:
        """``call`` on both dispatchers, each with its own log lines."""
        for name, side in (("fast", self.fast), ("slow", self.slow)):
            self._logger.addHandler(self.lines[name])
            try:
                getattr(side.dispatcher, call)(*args)
            finally:
                self._logger.removeHandler(self.lines[name])

    @rule(dt=st.floats(min_value=0.0, max_value=1.5))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt

    @rule(
        lookup_id=IDS,
        gen=GENS,
        here=st.booleans(),
        budget=BUDGETS,
        mode=MODES,
        configs=st.sampled_from((None, {"lmcache.tag": "x"})),
    )
    def request(
        self,
        lookup_id: str,
        gen: int,
        here: bool,
        budget: float,
        mode: str,
        configs: dict[str, Any] | None,
    ) -> None:
        for side in (self.fast, self.slow):
            side.engine.modes[lookup_id] = mode
        self._both("handle", _req(lookup_id, gen, here, configs), budget)

    @rule(lookup_id=IDS, gen=GENS, mode=MODES)
    def fresh_request(self, lookup_id: str, gen: int, mode: str) -> None:
        """The usual request: for this rank, in time (random ones often are not)."""
        self.request(lookup_id, gen, True, 250.0, mode, None)

    @rule(lookup_id=IDS, gen=GENS, answer=ANSWERS)
    def usual_lookup(self, lookup_id: str, gen: int, answer: str) -> None:
        """A rank's usual lookup: it arrives, the engine answers, Redis keeps its report."""
        self.window_opens()
        self.request(lookup_id, gen, True, 250.0, "instant", None)
        riding = vars(self.slow.reporter)["_riding"]
        if riding:
            self._answer(len(riding) - 1, "complete" if gen % 2 else answer)

    @rule(
        entries=st.lists(
            st.tuples(IDS, GENS, st.sampled_from(("request", "abort", "keep")), BUDGETS, MODES),
            max_size=4,
        )
    )
    def batch_served(self, entries: list[tuple[str, int, str, float, str]]) -> None:
        """A batch the reader made, served in the reporter's window (closed first, as the
        read loop's always is)."""
        self.window_closes(False)
        batch: list[tuple[Request, float]] = []
        for lookup_id, gen, kind, budget, mode in entries:
            for side in (self.fast, self.slow):
                side.engine.modes[lookup_id] = mode
            if kind == "request":
                batch.append((_req(lookup_id, gen, True), budget))
            elif kind == "abort":
                batch.append((Abort(lookup_id=lookup_id, gen=gen), math.inf))
            else:
                batch.append((Keep(lookup_id=lookup_id, gen=gen, tokens=gen + 1), math.inf))
        for name, side in (("fast", self.fast), ("slow", self.slow)):
            self._logger.addHandler(self.lines[name])
            try:
                side.sent += side.dispatcher.serve(list(batch))
            finally:
                self._logger.removeHandler(self.lines[name])

    @rule(lookup_id=IDS, gen=GENS)
    def abort(self, lookup_id: str, gen: int) -> None:
        self._both("handle", Abort(lookup_id=lookup_id, gen=gen), 100.0)

    @rule(lookup_id=IDS, gen=GENS, tokens=st.integers(min_value=0, max_value=TOKENS))
    def keep(self, lookup_id: str, gen: int, tokens: int) -> None:
        self._both("handle", Keep(lookup_id=lookup_id, gen=gen, tokens=tokens), 100.0)

    @rule(lookup_id=IDS, hits=HITS)
    def engine_reports(self, lookup_id: str, hits: object) -> None:
        self._both("report", lookup_id, hits)

    @rule(lookup_id=IDS, tokens=st.integers(min_value=-1, max_value=TOKENS))
    def engine_progress(self, lookup_id: str, tokens: int) -> None:
        self._both("progress", lookup_id, tokens)

    @rule()
    def window_opens(self) -> None:
        for side in (self.fast, self.slow):
            if vars(side.reporter)["_riding"] is None:
                side.reporter.riding().__enter__()

    @rule(failed=st.booleans())
    def window_closes(self, failed: bool) -> None:
        for side in (self.fast, self.slow):
            if vars(side.reporter)["_riding"] is not None:
                error = RuntimeError("turn failed") if failed else None
                kind = None if error is None else RuntimeError
                side.reporter.riding().__exit__(kind, error, None)

    @rule(data=st.data(), answer=ANSWERS)
    def redis_answers(self, data: st.DataObject, answer: str) -> None:
        """Redis answers one report made so far (riding or queued), as the reporter would."""
        reports = _made(self.slow.state())
        if not reports:
            return
        self._answer(data.draw(st.integers(min_value=0, max_value=len(reports) - 1)), answer)

    def _answer(self, index: int, answer: str) -> None:
        """Redis answers the report at ``index`` of those sent, riding, then queued."""
        for side in (self.fast, self.slow):
            report = _made(side.state())[index]
            riding = vars(side.reporter)["_riding"]
            if report in side.sent:
                side.sent.remove(report)
            elif riding is not None and report in riding:
                riding.remove(report)
            else:
                vars(side.reporter)["_queue"].remove(report)
        self._both("settle", report, answer)

    @rule(lookup_id=IDS, gen=GENS, hits=st.integers(0, TOKENS), answer=ANSWERS)
    def stray_answer(self, lookup_id: str, gen: int, hits: int, answer: str) -> None:
        """An answer for a report of another generation, or for progress."""
        self._both("settle", Report(lookup_id, gen, hits), answer)
        self._both("settle", Report(lookup_id, gen, hits, progress=True), answer)

    @rule()
    def sweep(self) -> None:
        self._both("sweep", self.clock.now)

    @invariant()
    def the_same_everywhere(self) -> None:
        assert self.fast.state() == self.slow.state()
        assert self.lines["fast"].lines == self.lines["slow"].lines
        for name, handed in self.fast.handed.items():
            Twins.served[name + "_handed"] += handed
        self.fast.handed = dict.fromkeys(self.fast.handed, 0)

    def teardown(self) -> None:
        Twins.served["calls"] += len(self.fast.engine.calls)


def test_the_c_path_serves_as_the_python_path(native: ModuleType) -> None:
    Twins.served = {
        "calls": 0,
        "handle_handed": 0,
        "report_handed": 0,
        "settle_handed": 0,
        "serve_handed": 0,
    }
    counted: dict[str, int] = {"handle": 0, "report": 0, "settle": 0, "serve": 0}
    originals = {name: getattr(native, name) for name in counted}

    def counting(name: str) -> Any:
        def call(*args: Any) -> Any:
            counted[name] += 1
            return originals[name](*args)

        return call

    with mock.patch.multiple(native, **{name: counting(name) for name in counted}):
        run_state_machine_as_test(
            Twins, settings=settings(max_examples=250, stateful_step_count=40, deadline=None)
        )
    # C made many of the calls it got itself, not handing every one to Python.
    for name, total in counted.items():
        handed = Twins.served[name + "_handed"]
        assert total - handed > 100, (name, total, handed)


def test_one_lookup_through_the_c_path(native: ModuleType) -> None:
    clock = Clock()
    side = Side(clock)
    side.engine.modes["a"] = "instant"
    with side.reporter.riding() as riding:
        side.dispatcher.handle(_req("a", 2, True), 250.0)
    assert riding == [Report("a", 2, TOKENS)] and type(riding[0]) is Report
    assert side.engine.calls == [("start", "a", (11, 12), (4, 4), True, None)]
    side.dispatcher.settle(riding[0], "complete")
    assert side.life.sizes()["held"] == 1
    counts = side.dispatcher.counts()
    assert counts == {"start": 1, "requests": 1, "report_complete": 1}
    assert sum(side.dispatcher.engine_seconds) == 1
    assert set(side.handed.values()) == {0}  # all of it in C


def test_an_engine_that_raises_is_answered_0_with_its_traceback_logged(
    native: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    side = Side(Clock())
    side.engine.modes["a"] = "raise"
    with caplog.at_level(logging.ERROR, logger=dispatch_module.__name__):
        side.dispatcher.handle(_req("a", 0, True), 250.0)
    assert side.state()["queued"] == [Report("a", 0, 0)]
    assert side.dispatcher.counts()["engine_errors"] == 1
    (record,) = caplog.records
    assert record.exc_info is not None and "engine broke on a" in str(record.exc_info[1])
    assert "engine failed to start a" in record.getMessage()


def test_a_base_exception_from_the_engine_is_not_swallowed(native: ModuleType) -> None:
    side = Side(Clock())

    def interrupted(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt

    side.engine.async_lookup_and_prefetch = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        side.dispatcher.handle(_req("a", 0, True), 250.0)
    assert "engine_errors" not in side.dispatcher.counts()


def test_engine_times_on_a_bucket_edge_land_as_in_python(native: ModuleType) -> None:
    """A time equal to a bucket's bound counts in that bucket (``le``), on both paths:
    random runs rarely land exactly on one."""
    clock = Clock()
    fast = Side(clock)
    with _python_only():
        slow = Side(clock)
    edges = [edge for edge in LATENCY_BUCKETS if (clock.now + edge) - clock.now == edge]
    assert len(edges) >= 4  # 0.5, 1.0, 2.5, 5.0 are exact in binary
    for i, edge in enumerate(edges):
        lookup_id = "abcd"[i % 4] + str(i)
        started = clock.now
        for side in (fast, slow):
            side.engine.modes[lookup_id] = "later"
            side.dispatcher.handle(_req(lookup_id, 0, True), 10_000.0)
        clock.now = started + edge
        for side in (fast, slow):
            side.dispatcher.report(lookup_id, 1)
    assert fast.dispatcher.engine_seconds == slow.dispatcher.engine_seconds
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    for edge in edges:
        expected[LATENCY_BUCKETS.index(edge)] += 1
    assert fast.dispatcher.engine_seconds == expected


def test_a_batch_that_raises_queues_its_reports_on_both_paths(native: ModuleType) -> None:
    """An engine's BaseException ends the batch: the window closes failed, the reports
    made so far go to the queue (the batch is not acked), and the exception propagates."""
    clock = Clock()
    fast = Side(clock)
    with _python_only():
        slow = Side(clock)
    for side in (fast, slow):
        engine = side.engine
        original = engine.async_lookup_and_prefetch

        def interrupted(lookup_id: str, *args: Any, _original: Any = original, **kw: Any) -> None:
            if lookup_id == "b":
                raise KeyboardInterrupt
            _original(lookup_id, *args, **kw)

        engine.async_lookup_and_prefetch = interrupted  # type: ignore[method-assign]
        batch: list[tuple[Request, float]] = [
            (_req("a", 0, True), 250.0),
            (_req("b", 0, True), 250.0),
            (_req("c", 0, True), 250.0),
        ]
        with pytest.raises(KeyboardInterrupt):
            side.dispatcher.serve(batch)
    assert fast.state() == slow.state()
    assert fast.state()["queued"] == [Report("a", 0, TOKENS)]
    assert fast.state()["riding"] is None
    assert [call[1] for call in fast.engine.calls] == ["a"]  # c never reached the engine
