"""The rank's per-lookup state machine, without Redis or an engine."""

from __future__ import annotations

from broker_lookup.messages import LookupRequest
from workers._tracker import Tracker


def req(lookup_id: str = "a", gen: int = 1) -> LookupRequest:
    return LookupRequest(
        lookup_id=lookup_id,
        gen=gen,
        hashes=[1, 2],
        offsets=[4, 4],
        expected=[0],
        deadline_ms=0,
        tokens=8,
    )


def tracker(capacity: int = 100) -> Tracker:
    return Tracker(dedupe_capacity=capacity, pin_ttl_s=10.0, memo_ttl_s=5.0)


def test_request_starts_then_duplicate_is_ignored():
    t = tracker()
    assert t.on_request(req(), 0.0) == "start"
    assert t.on_request(req(), 0.1) == "duplicate"
    assert t.sizes()["running"] == 1


def test_report_kept_then_abort_releases_held_pins():
    t = tracker()
    t.on_request(req(), 0.0)
    job = t.take_running("a")
    assert job is not None
    assert t.settle("a", job, keep=True, now=0.0) == (True, None)
    assert t.on_abort("a", 1, 0.1) is True
    assert t.sizes()["held"] == 0


def test_abort_while_running_marks_the_job():
    t = tracker()
    t.on_request(req(), 0.0)
    assert t.on_abort("a", 1, 0.1) is False  # released when the prefetch reports
    job = t.take_running("a")
    assert job is not None and job.aborted


def test_abort_before_request_skips_it():
    t = tracker()
    assert t.on_abort("a", 1, 0.0) is False
    assert t.on_request(req(), 0.1) == "aborted"


def test_abort_racing_an_in_flight_report_wins():
    t = tracker()
    t.on_request(req(), 0.0)
    job = t.take_running("a")  # the report is on its way to Redis
    assert job is not None
    assert t.on_abort("a", 1, 0.1) is False
    held, nxt = t.settle("a", job, keep=True, now=0.2)
    assert (held, nxt) == (False, None)  # the caller releases at once
    assert t.sizes()["held"] == 0


def test_new_generation_waits_for_the_running_one():
    t = tracker()
    assert t.on_request(req(gen=1), 0.0) == "start"
    assert t.on_request(req(gen=2), 0.1) == "queued"
    job = t.take_running("a")
    assert job is not None and job.superseded
    held, nxt = t.settle("a", job, keep=False, now=0.2)
    assert not held and nxt is not None and nxt.gen == 2
    assert t.running["a"].gen == 2


def test_request_for_held_id_releases_the_old_pins_first():
    t = tracker()
    t.on_request(req(gen=1), 0.0)
    job = t.take_running("a")
    assert job is not None
    t.settle("a", job, keep=True, now=0.0)
    assert t.on_request(req(gen=2), 0.1) == "release_then_start"


def test_held_pins_expire_and_memos_are_bounded():
    t = tracker(capacity=3)
    for i in range(10):
        t.on_request(req(lookup_id=f"id{i}"), 0.0)
        job = t.take_running(f"id{i}")
        assert job is not None
        t.settle(f"id{i}", job, keep=True, now=0.0)
    assert t.sizes()["seen"] == 3
    assert sorted(t.expired_holds(now=11.0)) == sorted(f"id{i}" for i in range(10))
    assert t.sizes() == {"running": 0, "waiting": 0, "held": 0, "seen": 0, "aborted": 0}


def test_release_all_empties_every_map():
    t = tracker()
    t.on_request(req("a"), 0.0)
    t.on_request(req("b"), 0.0)
    job = t.take_running("b")
    assert job is not None
    t.settle("b", job, keep=True, now=0.0)
    assert sorted(t.release_all()) == ["a", "b"]
    assert t.sizes()["running"] == t.sizes()["held"] == 0
