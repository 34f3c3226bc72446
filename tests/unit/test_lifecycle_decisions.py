"""The rank's per-lookup lifecycle (running -> reporting -> held -> released), without Redis
or an engine: every decision and engine step, including the generation races (a new
lookup under a reused id)."""

from __future__ import annotations

import gc

from helpers import lookup_request as req

from workers.pipeline.lifecycle import NOTHING, Job, Lifecycle, Step

PIN_TTL = 10.0
GRACE = 2.0


def lifecycle(capacity: int = 100) -> Lifecycle:
    return Lifecycle(capacity=capacity, pin_ttl_s=PIN_TTL, memo_ttl_s=5.0, grace_s=GRACE)


def start(t: Lifecycle, gen: int = 1, lookup_id: str = "a", now: float = 0.0) -> None:
    decision, step = t.on_request(req(lookup_id, gen), now, now + 3.0)
    assert decision == "start" and step == Step(start=req(lookup_id, gen))


def report(t: Lifecycle, lookup_id: str = "a", now: float = 0.0) -> int:
    outcome, job, step = t.on_report(lookup_id, now)
    assert outcome == "report" and job is not None and step == NOTHING
    return job.gen


def test_request_starts_then_duplicate_is_ignored() -> None:
    t = lifecycle()
    start(t)
    assert t.on_request(req(), 0.1, 3.0) == ("duplicate", NOTHING)
    assert t.sizes()["running"] == 1


def test_held_jobs_do_not_count_towards_the_engine_processs_collections() -> None:
    """A rank holds each answered lookup for the pins' TTL: tens of thousands of jobs at a
    few thousand lookups a second, none of them tracked by the GC of the engine's process."""
    t = lifecycle(capacity=1000)
    jobs: list[Job] = []
    for i in range(200):
        start(t, lookup_id=f"id-{i}")
        outcome, job, _ = t.on_report(f"id-{i}", 0.0)
        assert outcome == "report" and job is not None
        assert t.on_settled(f"id-{i}", 1, keep=True, now=0.1) == NOTHING
        jobs.append(job)
    assert t.sizes()["held"] == 200
    assert all(job.state == "held" for job in jobs)
    jobs.append(Job("py", 1, 8, 0.0, 3.0))
    assert not any(gc.is_tracked(job) for job in jobs)


def test_report_kept_then_abort_releases_held_pins() -> None:
    t = lifecycle()
    start(t)
    assert report(t) == 1
    assert t.sizes()["reporting"] == 1
    assert t.on_settled("a", 1, keep=True, now=0.1) == NOTHING
    assert t.sizes()["held"] == 1
    assert t.on_abort("a", 1, 0.2) == Step(release=True)
    assert t.sizes()["held"] == 0


def test_report_not_kept_releases_at_once() -> None:
    t = lifecycle()
    start(t)
    report(t)
    assert t.on_settled("a", 1, keep=False, now=0.1) == Step(release=True)
    assert t.sizes()["reporting"] == 0


def test_abort_while_running_releases_when_it_reports() -> None:
    t = lifecycle()
    start(t)
    assert t.on_abort("a", 1, 0.1) == NOTHING  # the engine still works on it
    outcome, job, step = t.on_report("a", 0.2)
    assert outcome == "skipped" and job is not None and step == Step(release=True)
    assert t.on_report("a", 0.3)[0] == "unknown"  # a second report changes nothing


def test_abort_while_reporting_releases_when_the_report_settles_and_does_not_hold() -> None:
    t = lifecycle()
    start(t)
    report(t)  # the report is on its way to Redis
    assert t.on_abort("a", 1, 0.1) == NOTHING
    assert t.on_settled("a", 1, keep=True, now=0.2) == Step(release=True)
    assert t.sizes()["held"] == 0


def test_abort_before_request_skips_it() -> None:
    t = lifecycle()
    assert t.on_abort("a", 1, 0.0) == NOTHING
    assert t.on_request(req(), 0.1, 3.0) == ("aborted", NOTHING)
    assert t.sizes()["running"] == 0


def test_abort_of_the_waiting_generation_drops_it() -> None:
    t = lifecycle()
    start(t, gen=1)
    assert t.on_request(req(gen=2), 0.1, 3.0) == ("queued", NOTHING)
    assert t.on_abort("a", 2, 0.2) == NOTHING
    assert t.on_report("a", 0.3)[2] == Step(release=True)  # gen 1 superseded: no start
    assert t.sizes()["waiting"] == 0


def test_stale_answer_of_the_old_generation_never_releases_the_new_one() -> None:
    # gen 1 reports; gen 2 arrives before gen 1's report settles. Gen 1's
    # answer comes back "stale" (the hash holds gen 2 now): releasing it must be the
    # release of gen 1, before gen 2 reaches the engine, never a release of gen 2.
    t = lifecycle()
    start(t, gen=1)
    report(t)
    assert t.on_request(req(gen=2), 0.1, 3.0) == ("queued", NOTHING)  # not started: 1 still in
    step = t.on_settled("a", 1, keep=False, now=0.2)
    assert step == Step(release=True, start=req(gen=2))  # release 1, then start 2
    assert t.sizes()["running"] == 1
    assert t.on_settled("a", 1, keep=False, now=0.3) == NOTHING  # a repeat changes nothing
    report(t, now=0.4)
    assert t.on_settled("a", 2, keep=True, now=0.5) == NOTHING  # gen 2's pins are held
    assert t.sizes()["held"] == 1


def test_kept_report_with_a_waiting_generation_releases_and_starts_it() -> None:
    t = lifecycle()
    start(t, gen=1)
    report(t)
    t.on_request(req(gen=2), 0.1, 3.0)
    assert t.on_settled("a", 1, keep=True, now=0.2) == Step(release=True, start=req(gen=2))


def test_newer_waiting_generation_replaces_an_older_one() -> None:
    t = lifecycle()
    start(t, gen=1)
    assert t.on_request(req(gen=2), 0.1, 3.0)[0] == "queued"
    assert t.on_request(req(gen=3), 0.2, 3.0)[0] == "queued"
    assert t.events()["superseded"] == 1
    assert t.on_request(req(gen=2), 0.3, 3.0)[0] == "duplicate"
    outcome, _, step = t.on_report("a", 0.4)  # gen 1 is superseded: not reported
    assert outcome == "skipped" and step == Step(release=True, start=req(gen=3))


def test_older_generation_read_after_a_newer_one_is_dropped() -> None:
    t = lifecycle()
    start(t, gen=5)
    assert t.on_request(req(gen=4), 0.1, 3.0) == ("superseded", NOTHING)


def test_request_for_held_id_releases_the_old_pins_first() -> None:
    t = lifecycle()
    start(t, gen=1)
    report(t)
    t.on_settled("a", 1, keep=True, now=0.0)
    decision, step = t.on_request(req(gen=2), 0.1, 3.0)
    assert decision == "release_then_start" and step == Step(True, req(gen=2))


def test_waiting_generation_whose_deadline_passed_is_dropped_not_started() -> None:
    t = lifecycle()
    start(t, gen=1)
    t.on_request(req(gen=2), 0.1, deadline=1.0)
    assert t.on_report("a", now=2.0)[2] == Step(release=True)  # gen 2 is not started
    assert t.events()["expired_waiting"] == 1
    assert t.sizes()["running"] == t.sizes()["waiting"] == 0


def test_watchdog_releases_an_engine_that_never_reports_then_its_late_report_releases_again() -> (
    None
):
    """The watchdog's release may come while the engine still prefetches; an engine that
    pins when its prefetch ends (LMCache's) pinned after it: its late report, which is
    not sent, releases that id once more."""
    t = lifecycle()
    start(t, gen=1)  # deadline 3.0
    assert t.due(3.0 + GRACE - 0.01) == []
    [(kind, job, step)] = t.due(3.0 + GRACE)
    assert (kind, job.gen, step) == ("watchdog", 1, Step(release=True))
    assert t.sizes()["running"] == 0
    assert t.on_report("a", 6.0) == ("late", None, Step(release=True))
    assert t.on_report("a", 6.1) == ("unknown", None, NOTHING)  # once only
    assert t.events()["watchdog"] == 1
    start(t, gen=2, now=6.1)  # a later generation is served normally
    assert report(t, now=6.2) == 2


def test_watchdog_starts_the_waiting_generation_if_still_in_time() -> None:
    t = lifecycle()
    start(t, gen=1)
    t.on_request(req(gen=2), 1.0, deadline=20.0)
    [(_, _, step)] = t.due(10.0)
    assert step == Step(release=True, start=req(gen=2))
    assert t.due(10.0) == []  # the running gen 2 has its own, later, timer


def test_watchdog_ignores_generations_that_reported() -> None:
    t = lifecycle()
    start(t, gen=1)
    report(t)
    t.on_settled("a", 1, keep=True, now=0.1)
    assert t.due(3.0 + GRACE) == []
    assert t.sizes()["held"] == 1


def test_report_that_never_settles_is_released_after_the_pin_ttl() -> None:
    t = lifecycle()
    start(t, gen=1)
    report(t, now=1.0)
    [(kind, _, step)] = t.due(1.0 + PIN_TTL)
    assert (kind, step) == ("unsettled", Step(release=True))
    assert t.on_settled("a", 1, keep=True, now=12.0) == NOTHING


def test_held_pins_expire_and_memos_are_bounded() -> None:
    t = lifecycle(capacity=3)
    for i in range(10):
        start(t, lookup_id=f"id{i}")
        report(t, lookup_id=f"id{i}")
        t.on_settled(f"id{i}", 1, keep=True, now=0.0)
    assert t.sizes()["seen"] == 3
    assert sorted(t.expired_holds(now=1.0)) == [f"id{i}" for i in range(7)]  # capacity
    assert sorted(t.expired_holds(now=PIN_TTL + 1)) == [f"id{i}" for i in range(7, 10)]
    t.due(100.0)  # the stale timers of jobs that moved on go too
    assert not any(t.sizes().values()), t.sizes()


def test_release_all_empties_every_map() -> None:
    t = lifecycle()
    start(t, lookup_id="a")
    start(t, lookup_id="b")
    report(t, lookup_id="b")
    t.on_settled("b", 1, keep=True, now=0.0)
    start(t, lookup_id="c")
    report(t, lookup_id="c")
    t.on_request(req("a", 2), 0.1, 3.0)
    assert sorted(t.release_all(now=0.2)) == ["a", "b", "c"]
    sizes = t.sizes()
    assert sizes["running"] == sizes["reporting"] == sizes["held"] == sizes["waiting"] == 0


def test_close_releases_what_the_engine_pinned_after_the_watchdog_and_after_close() -> None:
    """An engine that pins when its prefetch ends: a watchdog release with no report since
    is released again at close, and a report of a generation running at close (the
    engine outlives the server) releases what it pinned."""
    t = lifecycle()
    start(t, lookup_id="gone")  # deadline 3.0
    [(kind, _, _)] = t.due(3.0 + GRACE)
    assert kind == "watchdog"
    start(t, lookup_id="busy", now=4.0)
    assert sorted(t.release_all(now=5.0)) == ["busy", "gone"]
    assert t.on_report("busy", 6.0) == ("late", None, Step(release=True))
    assert t.on_report("gone", 6.0) == ("late", None, Step(release=True))
