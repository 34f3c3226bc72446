"""Model-based test of the rank's lifecycle: random requests, reports, settles, aborts and
time against a model of the engine (plain dicts), checking after every step that

* the engine never holds two generations of one id;
* every release is of the generation the engine holds, and of one that entered it;
* every generation that entered the engine is released exactly once, by time alone
  (watchdog, pin TTL) or at close;
* a kept prefix (a partial answer) is never released by the watchdog;
* the late report of a generation the watchdog released releases that id again, once,
  while nothing else holds it (what the engine pinned after the watchdog);
* no generation starts after its deadline;
* every map stays bounded.
"""

from __future__ import annotations

import pytest
from helpers import lookup_request
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.pipeline.lifecycle import Lifecycle, Step

IDS = ("a", "b")
GENS = st.integers(min_value=1, max_value=4)
CAPACITY = len(IDS) * 4  # every (id, gen) pair fits: the memos never forget one in time
BUDGET = st.floats(min_value=0.1, max_value=5.0)
MEMO_TTL = 6.0  # >= any budget: an entry older than its memo is dropped as expired first
PIN_TTL = 8.0
GRACE = 1.0


class LifecycleModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.life = Lifecycle(CAPACITY, PIN_TTL, MEMO_TTL, GRACE)
        self.now = 0.0
        self.engine: dict[str, int] = {}  # id -> the generation the engine holds
        self.phase: dict[str, str] = {}  # id -> running | reporting | held (model's view)
        self.entered: set[tuple[str, int]] = set()
        self.released: set[tuple[str, int]] = set()
        self.inflight: list[tuple[str, int]] = []  # reports queued to Redis, not settled
        self.expires: dict[tuple[str, int], float] = {}  # first arrival + budget
        self.late: dict[str, float] = {}  # ids the watchdog released -> when that is forgotten
        self.kept: dict[tuple[str, int], float] = {}  # generations a keep reached -> when

    # -- the engine -----------------------------------------------------------------

    def apply(self, lookup_id: str, step: Step, gen: int | None = None) -> None:
        """Do ``step`` to the model engine; ``gen``: the generation the release is for."""
        if step.release:
            assert lookup_id in self.engine, f"cleanup({lookup_id}) but the engine holds none"
            held = self.engine.pop(lookup_id)
            assert gen is None or held == gen, f"released gen {gen}, the engine held {held}"
            assert (lookup_id, held) not in self.released, "released twice"
            self.released.add((lookup_id, held))
            self.phase.pop(lookup_id)
        if step.start is not None:
            assert lookup_id not in self.engine, "two generations of one id in the engine"
            key = (lookup_id, step.start.gen)
            assert key not in self.entered, "a generation entered the engine twice"
            assert self.now < self.expires[key], "a generation started after its deadline"
            self.entered.add(key)
            self.engine[lookup_id] = step.start.gen
            self.phase[lookup_id] = "running"

    # -- rules ----------------------------------------------------------------------

    @rule(lookup_id=st.sampled_from(IDS), gen=GENS, budget=BUDGET)
    def request(self, lookup_id: str, gen: int, budget: float) -> None:
        key = (lookup_id, gen)
        expires = self.expires.setdefault(key, self.now + budget)
        if self.now >= expires:
            return  # the server drops it as expired before the lifecycle sees it
        was = self.phase.get(lookup_id)
        decision, step = self.life.on_request(
            lookup_request(lookup_id, gen, chunks=1), self.now, expires
        )
        if decision == "release_then_start":
            assert was == "held", f"released a {was} generation for a new one"
        if decision in ("start", "release_then_start"):
            assert step.start is not None and step.start.gen == gen
        else:
            assert step == Step(), (decision, step)
        self.apply(lookup_id, step)

    @rule(lookup_id=st.sampled_from(IDS))
    def engine_reports(self, lookup_id: str) -> None:
        outcome, job, step = self.life.on_report(lookup_id, self.now)
        if self.phase.get(lookup_id) != "running":
            if self.late.pop(lookup_id, None) is None:
                assert (outcome, job, step) == ("unknown", None, Step())
            elif lookup_id in self.engine:  # a newer generation holds the id: not released
                assert (outcome, job, step) == ("late", None, Step())
            else:  # what the engine pinned after the watchdog's release
                assert (outcome, job, step) == ("late", None, Step(release=True))
            return
        assert job is not None and job.gen == self.engine[lookup_id]
        if outcome == "kept":
            assert (lookup_id, job.gen) in self.kept and step == Step()
            self.phase[lookup_id] = "held"
        elif outcome == "report":
            self.phase[lookup_id] = "reporting"
            self.inflight.append((lookup_id, job.gen))
        else:
            assert outcome == "skipped"
            self.apply(lookup_id, step, job.gen)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), keep=st.booleans(), settled=st.sampled_from((None, 0, 2, 4)))
    def report_settles(self, data: st.DataObject, keep: bool, settled: int | None) -> None:
        """``settled``: the report landed after the deadline answered that many tokens."""
        lookup_id, gen = self.inflight.pop(data.draw(st.integers(0, len(self.inflight) - 1)))
        keep = keep and settled is None
        step = self.life.on_settled(lookup_id, gen, keep, self.now, settled)
        ours = self.engine.get(lookup_id) == gen and self.phase[lookup_id] == "reporting"
        if step.release:
            assert ours, "a settle released a generation that was not reporting"
            self.apply(lookup_id, step, gen)
        elif ours:
            if settled is None:
                assert keep and step == Step()
            else:
                assert settled and step.keep is not None and step.keep <= settled
                self.kept.setdefault((lookup_id, gen), self.now)
            self.phase[lookup_id] = "held"

    @rule(lookup_id=st.sampled_from(IDS), gen=GENS, tokens=st.sampled_from((2, 4)))
    def keep(self, lookup_id: str, gen: int, tokens: int) -> None:
        decision, step = self.life.on_keep(lookup_id, gen, tokens, self.now)
        if decision == "kept":
            assert self.engine.get(lookup_id) == gen and step.keep is not None
            assert step.keep <= tokens and not step.release and step.start is None
            self.kept.setdefault((lookup_id, gen), self.now)
        else:
            assert step == Step()

    @rule(lookup_id=st.sampled_from(IDS), gen=GENS)
    def abort(self, lookup_id: str, gen: int) -> None:
        step = self.life.on_abort(lookup_id, gen, self.now)
        if step.release:
            assert self.phase.get(lookup_id) == "held", "an abort released a busy generation"
        self.apply(lookup_id, step, gen)

    @rule(dt=st.floats(min_value=0.0, max_value=4.0))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.sweep()

    def sweep(self) -> None:
        for kind, job, step in self.life.due(self.now):
            want = "reporting" if kind == "unsettled" else "running"
            assert self.phase.get(job.lookup_id) == want, (kind, self.phase)
            assert self.now >= job.deadline + GRACE or kind == "unsettled"
            kept_at = self.kept.get((job.lookup_id, job.gen))
            if kept_at is not None and kind != "unsettled":  # held a pin TTL past the keep
                assert kind == "kept_expired" and self.now >= kept_at + PIN_TTL, "keep released"
            if kind != "unsettled":
                self.late[job.lookup_id] = self.now + PIN_TTL
            self.apply(job.lookup_id, step, job.gen)
        for lookup_id in self.life.expired_holds(self.now):
            assert self.phase.get(lookup_id) == "held"
            self.apply(lookup_id, Step(release=True))
        self.late = {i: until for i, until in self.late.items() if until > self.now}

    # -- invariants -----------------------------------------------------------------

    @invariant()
    def engine_and_lifecycle_agree(self) -> None:
        sizes = self.life.sizes()
        for state in ("running", "reporting", "held"):
            assert sizes[state] == sum(p == state for p in self.phase.values()), (state, sizes)
        assert self.entered - self.released == set(self.engine.items())
        assert sizes["waiting"] <= len(self.engine)
        assert max(sizes["seen"], sizes["aborted"], sizes["late"], sizes["held"]) <= CAPACITY

    def teardown(self) -> None:
        # Time alone releases everything: watchdog, unsettled reports, pin TTL.
        self.now += 10 * (PIN_TTL + MEMO_TTL)
        self.sweep()
        assert self.engine == {}, self.engine
        self.now += 2 * PIN_TTL  # and the watchdog's late ids are forgotten
        self.sweep()
        assert self.late == {}
        assert self.life.release_all(self.now) == []
        assert self.entered == self.released


LifecycleModel.TestCase.settings = settings(stateful_step_count=40, deadline=None)
test_lifecycle_against_model = pytest.mark.property(LifecycleModel.TestCase)


def test_close_releases_every_generation_the_engine_holds() -> None:
    life = Lifecycle(CAPACITY, PIN_TTL, MEMO_TTL, GRACE)
    for lookup_id in IDS:
        life.on_request(lookup_request(lookup_id, 1, chunks=1), 0.0, 3.0)
    life.on_report("b", 0.1)
    assert sorted(life.release_all(0.2)) == list(IDS)
