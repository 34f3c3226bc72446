"""ReferenceEngine's optional partial-answer contract: progress while it loads, and
keeping exactly a prefix of what it pinned."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from broker_lookup.engine import PartialEngine
from workers.reference.engine import ReferenceEngine

CHUNK = 4


class ProgressSink:
    """Records progress and final reports, as the lookup server would take them."""

    def __init__(self) -> None:
        self.progress: list[tuple[str, int]] = []
        self.reports: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        with self.lock:
            self.reports.append((lookup_id, num_hit_tokens))

    def send_progress_to_scheduler(self, lookup_id: str, num_loaded_tokens: int) -> None:
        with self.lock:
            self.progress.append((lookup_id, num_loaded_tokens))

    def reported(self, lookup_id: str) -> int | None:
        with self.lock:
            found = [n for i, n in self.reports if i == lookup_id]
        return found[0] if found else None


@pytest.fixture
def sink() -> ProgressSink:
    return ProgressSink()


@pytest.fixture
def engine(tmp_path: Path, sink: ProgressSink) -> Iterator[ReferenceEngine]:
    eng = ReferenceEngine(disk_dir=tmp_path / "disk", load_delay_s=0.05)
    eng.post_init(async_lookup_server=sink)
    yield eng
    eng.close()


HASHES = list(range(100, 108))  # 8 chunks
OFFSETS = [CHUNK] * 8


def _store_half_in_memory(engine: ReferenceEngine) -> None:
    engine.store(HASHES[:2], OFFSETS[:2])  # the first 2 chunks in memory
    engine.store_to_disk(HASHES, OFFSETS)  # all 8 on disk


def test_reference_engine_is_a_partial_engine(engine: ReferenceEngine) -> None:
    assert isinstance(engine, PartialEngine)


def test_progress_reports_the_memory_prefix_then_each_loaded_chunk(
    engine: ReferenceEngine, sink: ProgressSink
) -> None:
    _store_half_in_memory(engine)
    engine.async_lookup_and_prefetch("a", HASHES, OFFSETS)
    wait_until(lambda: sink.reported("a") is not None)
    assert [n for _, n in sink.progress] == [8, 12, 16, 20, 24, 28, 32]
    assert sink.reported("a") == 32
    assert engine.stats()["pinned_chunks"] == 8


def test_a_memory_hit_reports_no_progress(engine: ReferenceEngine, sink: ProgressSink) -> None:
    engine.store(HASHES, OFFSETS)
    engine.async_lookup_and_prefetch("a", HASHES, OFFSETS)
    wait_until(lambda: sink.reported("a") is not None)
    assert sink.progress == [] and sink.reported("a") == 32


def test_no_progress_without_pinning(engine: ReferenceEngine, sink: ProgressSink) -> None:
    _store_half_in_memory(engine)
    engine.async_lookup_and_prefetch("a", HASHES, OFFSETS, pin=False)
    wait_until(lambda: sink.reported("a") is not None)
    assert sink.progress == []


def test_keep_while_loading_stops_at_the_prefix_and_releases_the_rest(
    engine: ReferenceEngine, sink: ProgressSink
) -> None:
    _store_half_in_memory(engine)
    engine.async_lookup_and_prefetch("a", HASHES, OFFSETS)
    wait_until(lambda: any(n >= 12 for _, n in sink.progress))
    engine.keep_memory_objs("a", 12)
    wait_until(lambda: sink.reported("a") is not None)
    assert sink.reported("a") == 12  # it stopped loading at the kept prefix
    assert engine.stats()["pinned_chunks"] == 3
    engine.cleanup_memory_objs("a")
    assert engine.stats()["pinned_chunks"] == 0


def test_keep_after_loading_releases_exactly_the_tail(
    engine: ReferenceEngine, sink: ProgressSink
) -> None:
    _store_half_in_memory(engine)
    engine.async_lookup_and_prefetch("a", HASHES, OFFSETS)
    wait_until(lambda: sink.reported("a") is not None)
    engine.keep_memory_objs("a", 10)  # not on a chunk boundary: 2 whole chunks fit
    assert engine.stats()["pinned_chunks"] == 2
    assert engine.stats()["kept_released"] == 6
    engine.keep_memory_objs("a", 32)  # never re-pins what it released
    assert engine.stats()["pinned_chunks"] == 2
    engine.keep_memory_objs("unknown", 4)  # safe for an id it does not know
    engine.cleanup_memory_objs("a")
    assert engine.stats()["pinned_chunks"] == 0
