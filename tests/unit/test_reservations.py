"""A rank's reservations without Redis: bounded, matched to the prompt's own lookup at the
right chunk, released exactly once (TTL, lookup, shutdown), engine failures contained."""

from __future__ import annotations

from typing import Any

from broker_lookup.protocol.probe import Reserve
from workers.pipeline.reservations import MAX_RESERVE_MS, Reservations
from workers.reference.engine import ReferenceEngine

HASHES = [11, 12, 13, 14]
OFFSETS = [4, 4, 4, 4]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reserve(qid: str, hashes: list[int] = HASHES, reserve_ms: int = 1000) -> Reserve:
    return Reserve(
        query_id=qid,
        hashes=hashes,
        offsets=[4] * len(hashes),
        budget_ms=100,
        reserve_ms=reserve_ms,
    )


def engine_with(chunks: int) -> ReferenceEngine:
    engine = ReferenceEngine()
    engine.store(HASHES[:chunks], OFFSETS[:chunks])
    return engine


def pinned(engine: ReferenceEngine) -> int:
    return engine.stats().get("pinned_chunks", 0)


def test_bounded_refused_beyond_capacity_and_counted() -> None:
    engine = engine_with(4)
    held = Reservations(engine, 0, capacity=2)
    assert [held.reserve(reserve(q)) for q in "abc"] == [16, 16, 0]
    assert len(held) == 2 and held.counts == {"reserved": 2, "refused_full": 1}
    assert held.reserve(reserve("a")) == 16 and len(held) == 2  # a re-read entry: the same
    assert held.counts == {"reserved": 2, "refused_full": 1}
    held.release_all()
    assert pinned(engine) == 0 and held.counts["released_shutdown"] == 2
    engine.close()


def test_released_at_ttl_capped_and_only_then() -> None:
    engine, clock = engine_with(3), Clock()
    held = Reservations(engine, 0, clock=clock)
    assert held.reserve(reserve("a", reserve_ms=500)) == 12  # what is held, not asked
    assert held.reserve(reserve("b", reserve_ms=10 * MAX_RESERVE_MS)) == 12
    clock.now += 0.499
    assert held.expire() == 0 and len(held) == 2
    clock.now += 0.002
    assert held.expire() == 1 and len(held) == 1
    clock.now += MAX_RESERVE_MS / 1000
    assert held.expire() == 1 and len(held) == 0 and pinned(engine) == 0
    assert held.counts == {"reserved": 2, "released_ttl": 2}
    engine.close()


def test_nothing_held_reserves_nothing() -> None:
    engine = engine_with(0)
    held = Reservations(engine, 0)
    assert held.reserve(reserve("a")) == 0 and len(held) == 0
    engine.close()


def test_only_the_prompts_own_lookup_at_the_same_chunk_releases_it() -> None:
    engine = engine_with(4)
    held = Reservations(engine, 0)
    assert held.reserve(reserve("a", HASHES[:2])) == 8
    held.arrived("shorter", HASHES[:1])  # does not reach the reserved prefix
    held.arrived("elsewhere", [98, 99, HASHES[1]])  # the hash at another index: not it
    held.reported("shorter")
    held.reported("elsewhere")
    assert len(held) == 1
    held.arrived("longer", HASHES)  # the prompt, and more
    assert len(held) == 1  # kept until that lookup reports (it pins its own meanwhile)
    held.reported("longer")
    assert len(held) == 0 and held.counts == {"reserved": 1, "released_lookup": 1}
    held.reported("longer")  # twice: nothing more
    assert held.counts == {"reserved": 1, "released_lookup": 1} and pinned(engine) == 0
    engine.close()


class Failing:
    """An engine whose every call raises."""

    def reserve_prefix(self, *args: Any, **kwargs: Any) -> int:
        raise RuntimeError("boom")

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        raise RuntimeError("boom")


def test_engine_failures_are_contained_and_counted() -> None:
    held = Reservations(Failing(), 0)
    assert held.reserve(reserve("a")) == 0 and len(held) == 0
    assert held.counts["engine_errors"] == 2  # the reserve, and the release after it


def test_an_engine_without_reservations() -> None:
    held = Reservations(object(), 0)
    assert not held.supported
    assert held.reserve(reserve("a")) == 0 and held.counts == {"unsupported": 1}
