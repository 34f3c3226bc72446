"""A partial answer is a promise: every rank keeps the answered prefix pinned until the
scheduler is done with it. On fakeredis and on a real server, in-process ranks:

* a report that reaches Redis after the deadline answered (``settled:<n>``) holds that
  prefix instead of releasing it, over hundreds of partial answers with no fault at all;
* the watchdog never releases a prefix a keep decided, while the engine still loads;
* what an engine pins when its prefetch ends, after the watchdog released it, is
  released by its late report, and by ``close()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import CHUNK, LateEngine, MakeClient, MakeServer, Serve, alive, answer, prompt, ready
from helpers import wait_until

from broker_lookup.stub_engine import StubEngine
from workers.reference.engine import ReferenceEngine

TOKENS = prompt(9000, chunks=4)
FULL = len(TOKENS)
PROMISE: dict[str, Any] = {
    "partial_answers": True,
    "lookup_timeout_ms": 300,
    "lookup_timeout_per_1k_tokens_ms": 0,
}
#: Partial answers the race must be run over, and lookups sent at once.
WANTED = 300
WAVE = 60


@pytest.fixture
def late_engine() -> Iterator[LateEngine]:
    # It reports about when the client answers at the deadline: many of its reports
    # reach Redis just after the partial answer, before the rank reads the keep. Its
    # clock starts when the rank asks it, a few ms after the client's, whose deadline
    # answers: 10 ms later than the deadline centres the race on it.
    engine = LateEngine(after_s=PROMISE["lookup_timeout_ms"] / 1000 + 0.01, jitter_s=0.03)
    yield engine
    engine.close()


def test_reports_landing_after_the_partial_answer_never_release_it(
    serve: Serve, late_engine: LateEngine
) -> None:
    _, server, client = serve(late_engine, rank_config=PROMISE, **PROMISE)
    answers: dict[str, int] = {}
    partial = 0
    for wave in range(30):
        ids = [f"w{wave}-{i}" for i in range(WAVE)]
        for lookup_id in ids:
            client.lookup(TOKENS, lookup_id)
        for lookup_id in ids:
            answers[lookup_id] = answer(client, lookup_id, timeout=30)
        partial += sum(0 < answers[i] < FULL for i in ids)
        if partial >= WANTED:
            break
    assert partial >= WANTED, f"only {partial} partial answers in {len(answers)} lookups"
    wait_until(
        lambda: server.lifecycle.sizes()["running"] + server.lifecycle.sizes()["reporting"] == 0,
        timeout=30,
        message="every report answered",
    )
    broken = late_engine.broken(answers)
    assert broken == [], f"{len(broken)} of {partial} partial answers broken: {broken[:5]}"
    # Not vacuous: reports did land after the partial answer, and were held.
    assert server.stats().counts.get("report_settled", 0) > 0


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[ReferenceEngine]]:
    fast = ReferenceEngine()
    slow = ReferenceEngine(disk_dir=tmp_path / "slow", load_delay_s=2.0)
    yield [fast, slow]
    for engine in (fast, slow):
        engine.close(timeout_s=3.0)


def test_the_watchdog_never_releases_the_prefix_a_partial_answer_kept(
    make_server: MakeServer, make_client: MakeClient, engines: list[ReferenceEngine]
) -> None:
    """Rank 1 holds 2 of 4 chunks in memory, the rest on a disk tier at 2 s a chunk: the
    answer is 2 chunks; its engine reports only once its current load ends, after the
    deadline + grace. It must keep the 2 chunks, not be released by the watchdog."""
    settings = {**PROMISE, "lookup_timeout_ms": 1000, "worker_watchdog_grace_ms": 500}
    client = make_client(world_size=2, **settings)
    hashes, offsets = client.hasher.hashes_and_offsets(TOKENS)
    fast, slow = engines
    fast.store(hashes, offsets)
    slow.store(hashes[:2], offsets[:2])
    slow.store_to_disk(hashes, offsets)
    servers = [make_server(e, rank=r, world_size=2, **settings) for r, e in enumerate(engines)]
    ready(*servers)
    alive(client)
    client.lookup(TOKENS, "long")
    assert answer(client, "long", timeout=10) == 2 * CHUNK
    wait_until(
        lambda: slow.stats()["inflight"] == 0 and servers[1].lifecycle.sizes()["running"] == 0,
        timeout=10,
        message="the slow engine reported",
    )
    assert [e.stats()["pinned_chunks"] for e in engines] == [2, 2]
    assert servers[1].lifecycle.sizes()["held"] == 1
    assert "watchdog" not in servers[1].lifecycle.events()
    assert client.lookup_cache("long") == 2 * CHUNK
    client.cancel_lookup("long")
    wait_until(lambda: [e.stats()["pinned_chunks"] for e in engines] == [0, 0])


class PinsWhenDone(StubEngine):
    """An engine that pins a lookup's chunks when its prefetch ends (LMCache's does): a
    release during the prefetch frees nothing. The test ends each prefetch."""

    def __init__(self) -> None:
        super().__init__("manual")
        self.pinned: dict[str, int] = {}

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        super().cleanup_memory_objs(lookup_id)
        with self._lock:
            self.pinned.pop(lookup_id, None)

    def finish(self, lookup_id: str, report: bool = True) -> None:
        """The prefetch ends: its chunks are pinned, then (``report``) it reports."""
        with self._lock:
            self.pinned[lookup_id] = FULL
        if report:
            self.report(lookup_id, FULL)


def test_what_the_engine_pins_after_the_watchdog_is_released_by_its_report_and_close(
    serve: Serve,
) -> None:
    settings: dict[str, Any] = {"lookup_timeout_ms": 300, "worker_watchdog_grace_ms": 200}
    engine, server, client = serve(PinsWhenDone(), rank_config=settings, **settings)
    for lookup_id in ("reports", "silent", "at-close"):
        client.lookup(TOKENS, lookup_id)
    wait_until(lambda: server.lifecycle.events().get("watchdog") == 3, timeout=10)
    engine.finish("reports")  # after the watchdog's release: its late report releases
    assert engine.pinned == {}
    assert server.stats().counts["report_late"] == 1
    engine.finish("silent", report=False)  # pinned, and never reports
    client.lookup(TOKENS, "running")
    wait_until(lambda: server.lifecycle.sizes()["running"] == 1)
    server.close()
    assert engine.pinned == {}  # close released what the watchdog could not
    engine.finish("at-close")  # a report after close releases what it pinned
    engine.finish("running")  # running at close: released at close, and once it pins
    assert engine.pinned == {}
