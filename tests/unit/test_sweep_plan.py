"""When the rank's sweeper runs: the lifecycle's plan (the earliest thing due, within the
sweeper's bounds) and its ring (something due sooner than the planned wake), without
Redis; then the sweeper thread itself, which must sleep while nothing is due."""

from __future__ import annotations

import itertools
import math
import time

from helpers import lookup_request, wait_until

from workers.pipeline.lifecycle import Lifecycle
from workers.pipeline.sweeper import Sweeper

PIN_TTL = 10.0
GRACE = 2.0
MEMO_TTL = 5.0
DELAY = 0.05


def lifecycle(capacity: int = 100) -> tuple[Lifecycle, list[int]]:
    t = Lifecycle(capacity, PIN_TTL, MEMO_TTL, GRACE, progress_delay_s=DELAY)
    rings: list[int] = []
    t.ring_sweeper(lambda: rings.append(1))
    return t, rings


def test_nothing_tracked_plans_the_longest_sleep() -> None:
    t, _ = lifecycle()
    assert t.plan_sweep(0.05, 100.0) == 100.0


def test_the_plan_is_the_earliest_timer_hold_or_memo_within_its_bounds() -> None:
    t, _ = lifecycle()
    t.on_request(lookup_request(), 0.0, 3.0)  # watchdog at 3 + GRACE; seen memo until MEMO_TTL
    assert t.plan_sweep(0.05, 100.0) == 3.0 + GRACE
    assert t.plan_sweep(0.05, 1.0) == 1.0  # never past the latest
    assert t.plan_sweep(6.0, 100.0) == 6.0  # never before the soonest
    t.on_report("a", 1.0)  # its report awaited until 1 + PIN_TTL; the watchdog's stays, stale
    t.on_settled("a", 1, keep=True, now=1.5)  # no longer awaited; held until 1.5 + PIN_TTL
    assert t.due(3.0 + GRACE) == []  # the stale watchdog timer is dropped
    assert t.plan_sweep(0.0, 100.0) == MEMO_TTL  # the seen memo comes first now
    t.expired_holds(MEMO_TTL)
    assert t.plan_sweep(0.0, 100.0) == 1.5 + PIN_TTL  # the hold: a settled report leaves no timer


def test_progress_is_due_once_it_is_as_old_as_the_delay() -> None:
    t, _ = lifecycle()
    t.on_request(lookup_request(), 0.0, 3.0)
    assert t.on_progress("a", 4, 1.0)
    assert t.on_progress("a", 6, 1.02)  # the oldest progress not taken sets the time
    assert t.plan_sweep(0.05, 100.0) == 1.0 + DELAY
    t.take_progress()
    assert t.plan_sweep(0.05, 100.0) == 3.0 + GRACE


def test_holds_beyond_capacity_are_due_at_once() -> None:
    t, _ = lifecycle(capacity=1)
    for i, lookup_id in enumerate(("a", "b")):
        t.on_request(lookup_request(lookup_id), float(i), 30.0)
        t.on_report(lookup_id, float(i))
        t.on_settled(lookup_id, 1, keep=True, now=float(i))
    assert t.plan_sweep(0.05, 100.0) == 0.05
    assert t.expired_holds(1.0) == ["a"]
    assert t.plan_sweep(0.05, 100.0) > 1.0


def test_a_timer_due_before_a_long_sleep_rings_the_sweeper_once() -> None:
    t, rings = lifecycle()
    assert t.plan_sweep(0.05, 100.0) == 100.0  # nothing tracked: the sweeper sleeps long
    t.on_request(lookup_request("a"), 0.0, 3.0)  # its watchdog at 5 is due before 100: ring
    assert rings == [1]
    t.on_request(lookup_request("b"), 0.0, 2.0)  # due at 4: sooner still, ring again
    t.on_request(lookup_request("c"), 0.0, 9.0)  # due at 11: after the wake now planned, no ring
    assert rings == [1, 1]
    assert t.plan_sweep(0.05, 100.0) == 2.0 + GRACE


def test_steady_traffic_never_rings() -> None:
    """Each new timer falls after the earliest one, which the sweeper already plans for."""
    t, rings = lifecycle()
    t.on_request(lookup_request("first"), 0.0, 3.0)
    rings.clear()
    for i in range(50):
        now = 0.01 * i
        assert t.plan_sweep(now + 0.05, now + 1.0) == now + 1.0
        t.on_request(lookup_request(f"l{i}"), now, now + 3.0)
        t.on_report(f"l{i}", now)
        t.on_settled(f"l{i}", 1, keep=True, now=now)
    assert rings == []


def test_progress_rings_a_sleeping_sweeper_once_per_sweep() -> None:
    t, rings = lifecycle()
    t.on_request(lookup_request(), 0.0, 30.0)
    assert t.plan_sweep(0.05, 100.0) == MEMO_TTL  # the seen memo, before the watchdog
    rings.clear()
    t.on_progress("a", 4, 1.0)
    assert rings == [1]
    assert t.plan_sweep(0.05, 100.0) == 1.0 + DELAY
    t.on_progress("a", 6, 1.01)  # its sweep is planned already: no second ring
    assert rings == [1]


class _Due:
    """A plan with one due time, settable from the test; ``ring`` after a change."""

    def __init__(self) -> None:
        self.at = math.inf
        self.swept: list[float] = []

    def plan(self, soonest: float, latest: float) -> float:
        return min(max(self.at, soonest), latest)

    def sweep(self, now: float) -> None:
        self.swept.append(now)
        if now >= self.at:
            self.at = math.inf


def test_an_idle_sweeper_sleeps_and_a_ring_brings_its_sweep_forward() -> None:
    due = _Due()
    sweeper = Sweeper("test sweeper", due.sweep, due.plan, 0.01, 60.0)
    sweeper.start()
    try:
        time.sleep(0.3)  # thirty sweeps at the minimum period, none planned
        assert sweeper.sweeps == 0
        at = due.at = time.monotonic()
        sweeper.ring()  # without it, the next sweep is a minute away
        wait_until(lambda: sweeper.sweeps == 1, timeout=10, message="the rung sweep")
        assert due.swept[0] >= at
    finally:
        assert sweeper.stop(5)  # a stop wakes it too, long before the minute


def test_a_sweeper_keeps_its_minimum_period_when_always_due() -> None:
    sweeps: list[float] = []

    def always(now: float) -> None:
        sweeps.append(now)

    sweeper = Sweeper("test sweeper", always, lambda soonest, latest: soonest, 0.05, 60.0)
    sweeper.start()
    try:
        wait_until(lambda: len(sweeps) >= 4, timeout=10, message="four sweeps")
    finally:
        assert sweeper.stop(5)
    gaps = [b - a for a, b in itertools.pairwise(sweeps)]
    assert min(gaps) >= 0.05
