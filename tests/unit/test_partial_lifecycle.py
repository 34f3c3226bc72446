"""Progress and keeps in the rank's lifecycle (partial answers): no Redis, no
engine; what each input decides and which engine step follows."""

from __future__ import annotations

from helpers import lookup_request

from workers.pipeline.lifecycle import NOTHING, Lifecycle, Step

PIN_TTL = 10.0


def running(lookup_id: str = "a", gen: int = 1) -> Lifecycle:
    t = Lifecycle(capacity=100, pin_ttl_s=PIN_TTL, memo_ttl_s=5.0, grace_s=2.0)
    decision, step = t.on_request(lookup_request(lookup_id, gen, chunks=4), 0.0, 3.0)
    assert decision == "start" and step.start is not None
    return t


def test_progress_is_taken_once_and_only_when_it_grew() -> None:
    t = running()
    assert t.on_progress("a", 4, 0.0)
    assert not t.on_progress("a", 4, 0.0)  # not above what it confirmed
    assert not t.on_progress("a", 3, 0.0)
    assert t.on_progress("a", 8, 0.0)
    [job] = t.take_progress()
    assert (job.lookup_id, job.gen, job.progress) == ("a", 1, 8)
    assert t.take_progress() == []  # nothing grew since
    assert t.on_progress("a", 12, 0.0)
    assert [j.progress for j in t.take_progress()] == [12]


def test_progress_of_an_id_that_does_not_run_is_ignored() -> None:
    t = running()
    assert not t.on_progress("other", 4, 0.0)
    t.on_report("a", 1.0)  # reporting now: its final answer is on the way
    assert not t.on_progress("a", 4, 0.0)
    assert t.take_progress() == []
    assert t.sizes()["progressed"] == 0


def test_progress_map_forgets_released_jobs() -> None:
    t = running()
    t.on_progress("a", 4, 0.0)
    assert t.sizes()["progressed"] == 1
    assert t.on_abort("a", 1, 1.0) == NOTHING  # running: released once it reports
    outcome, _, step = t.on_report("a", 1.5)
    assert outcome == "skipped" and step.release
    assert t.sizes()["progressed"] == 0
    assert t.take_progress() == []


def test_keep_of_a_running_job_trims_then_holds_it_without_a_report() -> None:
    t = running()
    t.on_progress("a", 8, 0.0)
    decision, step = t.on_keep("a", 1, 8, 1.0)
    assert decision == "kept" and step == Step(keep=8)
    assert t.take_progress() == []  # decided: its progress is worth nothing now
    outcome, job, step = t.on_report("a", 2.0)  # the engine stops at the kept prefix
    assert outcome == "kept" and job is not None and step == NOTHING
    assert t.sizes()["held"] == 1 and t.sizes()["running"] == 0
    assert t.on_abort("a", 1, 3.0) == Step(release=True)  # cancel releases the kept prefix
    assert t.sizes()["held"] == 0


def test_keep_of_a_held_job_trims_and_pin_ttl_still_releases_it() -> None:
    t = running()
    outcome, _, _ = t.on_report("a", 1.0)
    assert outcome == "report"
    assert t.on_settled("a", 1, True, 1.0) == NOTHING
    assert t.on_keep("a", 1, 4, 1.0) == ("kept", Step(keep=4))
    assert t.on_keep("a", 1, 8, 1.0) == ("kept", Step(keep=4))  # never widens what it kept
    assert t.expired_holds(1.0 + PIN_TTL) == ["a"]


def test_keep_while_the_report_is_in_flight_holds_once_it_settles() -> None:
    t = running()
    t.on_report("a", 1.0)
    assert t.on_keep("a", 1, 8, 1.0) == ("kept", Step(keep=8))
    assert t.on_settled("a", 1, True, 1.5) == NOTHING
    assert t.sizes()["held"] == 1


def test_keep_of_another_generation_or_an_unknown_id_changes_nothing() -> None:
    t = running(gen=2)
    assert t.on_keep("a", 1, 8, 1.0) == ("unknown", NOTHING)
    assert t.on_keep("b", 2, 8, 1.0) == ("unknown", NOTHING)
    t.on_abort("a", 2, 1.0)
    assert t.on_keep("a", 2, 8, 1.0) == ("unknown", NOTHING)  # aborted: released, not kept
    outcome, _, _ = t.on_report("a", 1.5)
    assert outcome == "skipped"


def test_the_watchdog_never_releases_a_kept_prefix_the_pin_ttl_after_the_keep_does() -> None:
    """A partial answer's prefix is a promise: an engine on a slow tier that has not
    reported by the deadline + grace keeps it pinned (the watchdog is for answers not
    given yet), until the pin TTL after the keep; its late report then releases again."""
    t = running()  # deadline 3.0, grace 2.0: the watchdog's time is 5.0
    assert t.on_keep("a", 1, 8, 3.1) == ("kept", Step(keep=8))
    assert t.due(5.0) == []
    assert t.due(3.1 + PIN_TTL - 0.01) == []
    assert t.sizes()["running"] == 1
    [(kind, job, step)] = t.due(3.1 + PIN_TTL)
    assert (kind, job.kept, step) == ("kept_expired", 8, Step(release=True))
    assert t.events() == {"kept_expired": 1}
    assert t.on_report("a", 20.0) == ("late", None, Step(release=True))


def test_a_keep_then_the_report_holds_for_the_pin_ttl_and_no_timer_releases_it() -> None:
    t = running()
    t.on_keep("a", 1, 8, 3.1)
    outcome, _, step = t.on_report("a", 6.0)  # after the watchdog's old time
    assert (outcome, step) == ("kept", NOTHING)
    assert t.due(100.0) == []  # both timers stale: held, not running
    assert t.expired_holds(6.0 + PIN_TTL - 0.01) == []
    assert t.expired_holds(6.0 + PIN_TTL) == ["a"]


def test_a_report_settled_after_the_deadline_answered_holds_that_prefix() -> None:
    """``report.lua`` answers ``settled:<n>`` when the deadline answered the lookup before
    this rank's report landed: the rank keeps the smaller of n and its own count, as the
    keep it may not have read yet would, instead of releasing what the client answered."""
    t = running()
    t.on_report("a", 3.5)
    assert t.on_settled("a", 1, False, 3.6, kept=8) == Step(keep=8)
    assert t.sizes()["held"] == 1 and t.sizes()["reporting"] == 0
    assert t.on_keep("a", 1, 8, 3.7) == ("kept", Step(keep=8))  # the keep, read later
    assert t.expired_holds(3.6 + PIN_TTL) == ["a"]


def test_a_settled_report_keeps_the_smaller_prefix_or_releases_at_0_or_when_cancelled() -> None:
    t = running()
    t.on_report("a", 3.5)
    t.on_keep("a", 1, 4, 3.5)  # read first: the report's answer cannot widen it
    assert t.on_settled("a", 1, False, 3.6, kept=8) == Step(keep=4)
    zero = running()
    zero.on_report("a", 3.5)
    assert zero.on_settled("a", 1, False, 3.6, kept=0) == Step(release=True)
    aborted = running()
    aborted.on_report("a", 3.5)
    aborted.on_abort("a", 1, 3.5)
    assert aborted.on_settled("a", 1, False, 3.6, kept=8) == Step(release=True)
