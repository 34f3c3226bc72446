"""The lifecycle's C transitions (``workers/pipeline/_transitions.c``) against its Python path.

Two lifecycles take the same random requests, reports, settles, aborts, keeps, progress
and time. One is built with the extension and goes through its ``try_*`` transitions first,
as the dispatcher does; the other is built without it and takes every decision in Python.
After every step both must have answered the same and hold the same maps: jobs with every
field, waiting generations, holds in order, timers, memos in order, state sizes, events,
the sweeper's plan and the rings it got. And the C transitions must have been taken, so
the fast path is not vacuous. Without the extension built these skip, except under
``CI``, which must build it.
"""

from __future__ import annotations

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
from lifecycle_state import job_fields as _job
from lifecycle_state import lifecycle_state as _maps

from broker_lookup.protocol.messages import LookupRequest
from workers.pipeline import lifecycle as lifecycle_module
from workers.pipeline.lifecycle import NOTHING, Job, Lifecycle, Step

IDS = st.sampled_from(("a", "b", "c", "d"))
GENS = st.integers(min_value=-1, max_value=3)
CAPACITY = 3  # below the ids: memos forget and holds overflow within a run
PIN_TTL = 4.0
MEMO_TTL = 3.0
GRACE = 0.5


def _req(lookup_id: str, gen: int, tokens: int = 8) -> LookupRequest:
    return LookupRequest(
        lookup_id=lookup_id,
        gen=gen,
        hashes=[1, 2],
        offsets=[tokens // 2, tokens - tokens // 2],
        expected=[0],
        deadline_ms=0,
        tokens=tokens,
    )


@contextmanager
def _python_only() -> Iterator[None]:
    with mock.patch.object(lifecycle_module, "_transitions", None):
        yield


def _python_lifecycle(capacity: int = CAPACITY, ttl: float = PIN_TTL) -> Lifecycle:
    with _python_only():
        return Lifecycle(capacity, ttl, min(ttl, MEMO_TTL), GRACE)


def _step(step: Step) -> tuple[Any, ...]:
    return (step.release, step.start, step.keep)


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return optional_extension("workers.pipeline._transitions")


class Twins(RuleBasedStateMachine):
    """The same inputs to a lifecycle with the C transitions and to one without."""

    taken: dict[str, int]

    def __init__(self) -> None:
        super().__init__()
        self.fast = Lifecycle(CAPACITY, PIN_TTL, MEMO_TTL, GRACE)
        self.slow = _python_lifecycle()
        self.rings = {"fast": 0, "slow": 0}
        self.fast.ring_sweeper(lambda: self._rang("fast"))
        self.slow.ring_sweeper(lambda: self._rang("slow"))
        self.now = 0.0

    def _rang(self, which: str) -> None:
        self.rings[which] += 1

    @rule(dt=st.floats(min_value=0.0, max_value=1.5))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @rule(lookup_id=IDS, gen=GENS, budget=st.floats(min_value=0.1, max_value=3.0))
    def request(self, lookup_id: str, gen: int, budget: float) -> None:
        req = _req(lookup_id, gen)
        deadline = self.now + budget
        if self.fast.try_start(req, self.now, deadline):
            Twins.taken["start"] += 1
            fast: tuple[str, Step] = ("start", Step(start=req))
        else:
            fast = self.fast.on_request(req, self.now, deadline)
        slow = self.slow.on_request(req, self.now, deadline)
        assert (fast[0], _step(fast[1])) == (slow[0], _step(slow[1]))

    @rule(lookup_id=IDS)
    def engine_reports(self, lookup_id: str) -> None:
        job = self.fast.try_report(lookup_id, self.now)
        if job is not None:
            Twins.taken["report"] += 1
            fast: tuple[str, Job | None, Step] = ("report", job, NOTHING)
        else:
            fast = self.fast.on_report(lookup_id, self.now)
        slow = self.slow.on_report(lookup_id, self.now)
        assert (fast[0], _job(fast[1]), _step(fast[2])) == (slow[0], _job(slow[1]), _step(slow[2]))

    @rule(lookup_id=IDS, gen=GENS, keep=st.booleans())
    def settled(self, lookup_id: str, gen: int, keep: bool) -> None:
        if keep and self.fast.try_hold(lookup_id, gen, self.now):
            Twins.taken["hold"] += 1
            fast = NOTHING
        else:
            fast = self.fast.on_settled(lookup_id, gen, keep, self.now)
        slow = self.slow.on_settled(lookup_id, gen, keep, self.now)
        assert _step(fast) == _step(slow)

    @rule(lookup_id=IDS, gen=GENS, budget=st.floats(min_value=0.1, max_value=3.0))
    def served(self, lookup_id: str, gen: int, budget: float) -> None:
        """A rank's usual lookup: it arrives, the engine answers at once, Redis keeps it."""
        self.request(lookup_id, gen, budget)
        self.engine_reports(lookup_id)
        self.settled(lookup_id, gen, True)

    @rule(data=st.data(), keep=st.booleans())
    def report_answered(self, data: st.DataObject, keep: bool) -> None:
        """Redis answers a report in flight (random settles rarely name one)."""
        reporting = sorted(
            (job.lookup_id, job.gen)
            for job in vars(self.slow)["_jobs"].values()
            if job.state == "reporting"
        )
        if reporting:
            self.settled(*data.draw(st.sampled_from(reporting)), keep)

    @rule(lookup_id=IDS, gen=GENS)
    def abort(self, lookup_id: str, gen: int) -> None:
        fast = self.fast.on_abort(lookup_id, gen, self.now)
        assert _step(fast) == _step(self.slow.on_abort(lookup_id, gen, self.now))

    @rule(lookup_id=IDS, gen=GENS, tokens=st.integers(min_value=0, max_value=8))
    def keep(self, lookup_id: str, gen: int, tokens: int) -> None:
        decision, step = self.fast.on_keep(lookup_id, gen, tokens)
        other, other_step = self.slow.on_keep(lookup_id, gen, tokens)
        assert (decision, _step(step)) == (other, _step(other_step))

    @rule(lookup_id=IDS, tokens=st.integers(min_value=0, max_value=9))
    def progress(self, lookup_id: str, tokens: int) -> None:
        fast = self.fast.on_progress(lookup_id, tokens, self.now)
        assert fast == self.slow.on_progress(lookup_id, tokens, self.now)

    @rule()
    def sweep(self) -> None:
        fast = [(kind, _job(job), _step(step)) for kind, job, step in self.fast.due(self.now)]
        slow = [(kind, _job(job), _step(step)) for kind, job, step in self.slow.due(self.now)]
        assert fast == slow
        assert self.fast.expired_holds(self.now) == self.slow.expired_holds(self.now)
        fast_progress = [_job(job) for job in self.fast.take_progress()]
        assert fast_progress == [_job(job) for job in self.slow.take_progress()]

    @rule(ahead=st.floats(min_value=0.0, max_value=2.0))
    def plan(self, ahead: float) -> None:
        soonest, latest = self.now + 0.05, self.now + ahead + 0.05
        fast = self.fast.plan_sweep(soonest, latest)
        assert fast == self.slow.plan_sweep(soonest, latest)

    @invariant()
    def same_maps_and_rings(self) -> None:
        assert _maps(self.fast) == _maps(self.slow)
        assert self.fast.sizes() == self.slow.sizes()
        assert self.rings["fast"] == self.rings["slow"]


def test_the_c_transitions_decide_as_the_python_path(native: ModuleType) -> None:
    Twins.taken = {"start": 0, "report": 0, "hold": 0}
    run_state_machine_as_test(
        Twins, settings=settings(max_examples=300, stateful_step_count=40, deadline=None)
    )
    # Every transition was taken by C many times, not left to Python each time.
    assert min(Twins.taken.values()) > 50, Twins.taken


def test_one_lookup_takes_the_c_transitions_and_python_the_rest(native: ModuleType) -> None:
    life = Lifecycle(CAPACITY, PIN_TTL, MEMO_TTL, GRACE)
    req = _req("a", 1)
    assert life.try_start(req, 0.0, 1.0)
    assert not life.try_start(req, 0.1, 1.0)  # a duplicate: Python's decision
    assert life.on_request(req, 0.1, 1.0)[0] == "duplicate"
    job = life.try_report("a", 0.2)
    assert job is not None and job.state == "reporting" and job.gen == 1
    assert life.try_report("a", 0.3) is None  # not running any more
    assert not life.try_hold("a", 2, 0.3)  # another generation
    assert life.try_hold("a", 1, 0.3)
    assert life.sizes()["held"] == 1 and life.sizes()["reporting"] == 0


def test_without_the_extension_every_transition_is_declined() -> None:
    life = _python_lifecycle()
    assert not life.try_start(_req("a", 1), 0.0, 1.0)
    assert life.on_request(_req("a", 1), 0.0, 1.0)[0] == "start"
    assert life.try_report("a", 0.1) is None
    assert life.on_report("a", 0.1)[0] == "report"
    assert not life.try_hold("a", 1, 0.2)
    assert life.sizes()["running"] == 0 and life.sizes()["reporting"] == 1


def _count(counts: dict[str, int], name: str) -> None:
    counts[name] += 1


def _serve(life: Lifecycle, lookup_id: str, gen: int, now: float) -> None:
    """A lookup's usual start and report, through the C transitions where they take it."""
    if not life.try_start(_req(lookup_id, gen), now, now + 1.0):
        life.on_request(_req(lookup_id, gen), now, now + 1.0)
    if life.try_report(lookup_id, now) is None:
        life.on_report(lookup_id, now)


def _settle(life: Lifecycle, lookup_id: str, gen: int, now: float) -> Step:
    if life.try_hold(lookup_id, gen, now):
        return NOTHING
    return life.on_settled(lookup_id, gen, True, now)


def test_a_hold_beyond_capacity_rings_the_sweeper_as_python_does(native: ModuleType) -> None:
    rings: dict[str, int] = {}
    twins = (("c", Lifecycle(2, 30.0, MEMO_TTL, GRACE)), ("python", _python_lifecycle(2, 30.0)))
    for name, life in twins:
        rings[name] = 0
        life.ring_sweeper(partial(_count, rings, name))
        for n, lookup_id in enumerate(("a", "b", "c")):
            now = float(n)
            life.due(now)  # past timers gone: the sweeper plans to sleep past this step
            life.plan_sweep(now + 0.05, now + 10.0)
            _serve(life, lookup_id, 1, now)
            assert _settle(life, lookup_id, 1, now) == NOTHING
        assert life.sizes()["held"] == 3  # one over capacity: the next sweep releases it
    assert rings["c"] == rings["python"] >= 1


def test_a_report_awaited_past_the_planned_wake_rings_the_sweeper_as_python_does(
    native: ModuleType,
) -> None:
    # A short pin TTL against a long watchdog and memo: the report is given up on (at
    # 1 + 0.5) before anything else falls due, so the sweeper must be woken for it.
    rings: dict[str, int] = {}
    with _python_only():
        python = Lifecycle(CAPACITY, 0.5, 50.0, GRACE)
    twins = (("c", Lifecycle(CAPACITY, 0.5, 50.0, GRACE)), ("python", python))
    for name, life in twins:
        rings[name] = 0
        life.ring_sweeper(partial(_count, rings, name))
        if not life.try_start(_req("a", 1), 0.0, 100.0):
            life.on_request(_req("a", 1), 0.0, 100.0)
        assert life.plan_sweep(0.05, 1000.0) == 50.0  # the seen memo's expiry
        taken = life.try_report("a", 1.0)
        assert (taken is not None) == (name == "c")
        if taken is None:
            life.on_report("a", 1.0)
        assert life.plan_sweep(0.05, 1000.0) == 1.5
        assert [kind for kind, _, _ in life.due(1.5)] == ["unsettled"]
    assert rings == {"c": 1, "python": 1}


def test_a_report_settled_while_a_newer_generation_waits_is_released_not_held(
    native: ModuleType,
) -> None:
    for life in (Lifecycle(CAPACITY, PIN_TTL, MEMO_TTL, GRACE), _python_lifecycle()):
        _serve(life, "a", 1, 0.0)
        assert life.on_request(_req("a", 2), 0.1, 1.0)[0] == "queued"
        step = _settle(life, "a", 1, 0.2)
        assert (step.release, step.start) == (True, _req("a", 2))  # gen 2 starts at once
        assert life.sizes()["held"] == 0 and life.sizes()["running"] == 1
