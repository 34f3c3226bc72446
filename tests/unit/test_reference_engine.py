"""Unit tests of the reference engine and its chunk store (no Redis)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import wait_until

from broker_lookup.engine import LookupEngine, SyncLookupEngine
from workers.reference.chunk_store import (
    ChunkLoadError,
    ChunkStore,
    chunk_payload,
    decode_chunk,
    encode_chunk,
    make_tags,
)
from workers.reference.engine import ReferenceEngine

CHUNK = 256
TENANT_A = {"lmcache.tag.user": "a"}
TENANT_B = {"lmcache.tag.user": "b"}


class RecordingSink:
    """Collects ``(lookup_id, hits)`` reports; ``wait_for`` blocks until one arrives."""

    def __init__(self) -> None:
        self.reports: list[tuple[str, int]] = []
        self._cond = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        with self._cond:
            self.reports.append((lookup_id, num_hit_tokens))
            self._cond.notify_all()

    def wait_for(self, lookup_id: str, timeout: float = 5.0) -> int:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.hits(lookup_id) is not None, timeout)
            assert ok, f"no report for {lookup_id!r} within {timeout}s; got {self.reports}"
            hits = self.hits(lookup_id)
        assert hits is not None
        return hits

    def hits(self, lookup_id: str) -> int | None:
        found = [n for lid, n in self.reports if lid == lookup_id]
        assert len(found) <= 1, f"{lookup_id!r} reported {len(found)} times: {found}"
        return found[0] if found else None


class RaisingSink(RecordingSink):
    """Raises on the first report (after recording it), then behaves."""

    def __init__(self) -> None:
        super().__init__()
        self.raised = False

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        super().send_response_to_scheduler(lookup_id, num_hit_tokens)
        if not self.raised:
            self.raised = True
            raise ConnectionError("scheduler unreachable")


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def make_engine(sink: RecordingSink) -> Iterator[Callable[..., ReferenceEngine]]:
    """Build wired engines; every one is closed at teardown."""
    built: list[ReferenceEngine] = []

    def make(**kwargs: Any) -> ReferenceEngine:
        engine = ReferenceEngine(**kwargs)
        engine.post_init(async_lookup_server=sink)
        built.append(engine)
        return engine

    yield make
    for engine in built:
        engine.close(timeout_s=5.0)


def prefetch(
    engine: ReferenceEngine, sink: RecordingSink, lookup_id: str, hashes: list[int], **kw: Any
) -> int:
    offsets = kw.pop("offsets", [CHUNK] * len(hashes))
    engine.async_lookup_and_prefetch(lookup_id, hashes, offsets, **kw)
    return sink.wait_for(lookup_id)


def chunk_files(disk_dir: Path, chunk_hash: int) -> list[Path]:
    return sorted(disk_dir.glob(f"{chunk_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}-*.kv"))


# -- hits and prefix contiguity -----------------------------------------------


@pytest.mark.parametrize(
    ("stored", "asked", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], 3 * CHUNK),  # full hit
        ([1, 2], [1, 2, 3], 2 * CHUNK),  # partial: the tail is missing
        ([], [1, 2], 0),  # zero
        ([1, 3], [1, 2, 3], CHUNK),  # a gap stops the count
        ([2, 3], [1, 2, 3], 0),  # a missing first chunk means no prefix at all
    ],
)
def test_prefetch_reports_the_contiguous_prefix(
    make_engine: Callable[..., ReferenceEngine],
    sink: RecordingSink,
    stored: list[int],
    asked: list[int],
    expected: int,
) -> None:
    engine = make_engine()
    assert engine.store(stored, [CHUNK] * len(stored)) == len(stored)
    assert prefetch(engine, sink, "req", asked) == expected


def test_last_short_chunk_counts_its_exact_tokens(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink
) -> None:
    engine = make_engine()
    engine.store([1, 2], [CHUNK, 17])
    assert prefetch(engine, sink, "req", [1, 2], offsets=[CHUNK, 17]) == CHUNK + 17


def test_tags_isolate_tenants_and_other_configs_are_ignored(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink
) -> None:
    engine = make_engine()
    engine.store([1], [CHUNK], TENANT_A)
    assert prefetch(engine, sink, "b", [1], request_configs=TENANT_B) == 0
    assert prefetch(engine, sink, "none", [1]) == 0
    with_extra = {**TENANT_A, "lmcache.other": "x", "priority": 3}
    assert prefetch(engine, sink, "a", [1], request_configs=with_extra) == CHUNK


def test_make_tags_strips_the_prefix_keeps_order_and_stringifies() -> None:
    configs = {"lmcache.tag.z": 1, "x": "ignored", "lmcache.tag.a": "v"}
    assert make_tags(configs) == (("z", "1"), ("a", "v"))
    assert make_tags(None) == ()


def test_engine_satisfies_the_engine_protocols(
    make_engine: Callable[..., ReferenceEngine],
) -> None:
    engine = make_engine()
    assert isinstance(engine, LookupEngine)
    assert isinstance(engine, SyncLookupEngine)


# -- disk tier and eviction -----------------------------------------------------


def test_disk_hit_is_loaded_into_memory_verified_and_reported(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path)
    engine.store([1], [CHUNK])
    assert engine.store_to_disk([2], [100]) == 1
    assert engine.get_chunk(2) is None
    assert prefetch(engine, sink, "req", [1, 2], offsets=[CHUNK, 100]) == CHUNK + 100
    loaded = engine.get_chunk(2)
    assert loaded is not None
    assert torch.equal(loaded, chunk_payload(2, 100, 8))
    stats = engine.stats()
    assert (stats["loads"], stats["memory_chunks"], stats["disk_chunks"]) == (1, 2, 1)
    assert stats["pinned_chunks"] == 2


def test_memory_lru_demotes_the_least_recently_used_chunk_to_disk(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(memory_capacity_chunks=2, disk_dir=tmp_path)
    engine.store([1, 2], [CHUNK, CHUNK])
    assert engine.lookup([1], [CHUNK]) == CHUNK  # touches 1, so 2 is now the LRU
    engine.store([3], [CHUNK])
    assert engine.get_chunk(2) is None
    assert engine.get_chunk(1) is not None
    stats = engine.stats()
    assert (stats["memory_chunks"], stats["disk_chunks"], stats["demotions"]) == (2, 1, 1)
    assert len(chunk_files(tmp_path, 2)) == 1
    # The demoted chunk is still a hit: the prefetch loads it back.
    assert prefetch(engine, sink, "req", [2], pin=False) == CHUNK
    assert engine.stats()["loads"] == 1


def test_memory_overflow_without_disk_drops_the_lru_chunk(
    make_engine: Callable[..., ReferenceEngine],
) -> None:
    engine = make_engine(memory_capacity_chunks=2)
    engine.store([1, 2, 3], [CHUNK] * 3)
    assert engine.lookup([1], [CHUNK]) == 0
    assert engine.lookup([2, 3], [CHUNK, CHUNK]) == 2 * CHUNK
    stats = engine.stats()
    assert (stats["memory_chunks"], stats["memory_evictions"]) == (2, 1)


def test_disk_lru_deletes_the_oldest_file(
    make_engine: Callable[..., ReferenceEngine], tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path, disk_capacity_chunks=2)
    engine.store_to_disk([1, 2, 3], [CHUNK] * 3)
    assert engine.lookup([1], [CHUNK]) == 0
    assert engine.lookup([2, 3], [CHUNK, CHUNK]) == 2 * CHUNK
    assert (engine.stats()["disk_chunks"], engine.stats()["disk_evictions"]) == (2, 1)
    assert len(list(tmp_path.glob("*.kv"))) == 2
    assert chunk_files(tmp_path, 1) == []


def test_pinned_chunks_survive_eviction_pressure(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink
) -> None:
    engine = make_engine(memory_capacity_chunks=2)
    engine.store([1, 2], [CHUNK, CHUNK])
    assert prefetch(engine, sink, "pinned", [1]) == CHUNK
    assert engine.store([3, 4, 5], [CHUNK] * 3) == 3  # only the unpinned slot churns
    assert engine.get_chunk(1) is not None
    assert engine.lookup([2, 3, 4], [CHUNK] * 3) == 0
    assert engine.lookup([5], [CHUNK]) == CHUNK
    assert prefetch(engine, sink, "pinned-too", [5]) == CHUNK
    assert engine.store([6], [CHUNK]) == 0  # memory is all pins: nothing can enter
    engine.cleanup_memory_objs("pinned-too")
    assert engine.store([6], [CHUNK]) == 1
    assert engine.get_chunk(1) is not None


def test_load_fails_when_memory_is_full_of_pins(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(memory_capacity_chunks=1, disk_dir=tmp_path)
    engine.store([1], [CHUNK])
    engine.store_to_disk([2], [CHUNK])
    assert prefetch(engine, sink, "holder", [1]) == CHUNK
    assert prefetch(engine, sink, "req", [1, 2]) == CHUNK  # the prefix before the failed load
    assert engine.stats()["load_failures"] == 1


# -- failures -------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-3]), id="truncated"),
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-2] + b"\x00\x7c"), id="corrupt"),
        pytest.param(lambda p: p.write_bytes(b"junk"), id="garbage"),
        pytest.param(lambda p: p.unlink(), id="missing"),
    ],
)
def test_a_failed_load_reports_the_prefix_before_it(
    make_engine: Callable[..., ReferenceEngine],
    sink: RecordingSink,
    tmp_path: Path,
    damage: Callable[[Path], object],
) -> None:
    engine = make_engine(disk_dir=tmp_path)
    engine.store_to_disk([1, 2, 3], [CHUNK] * 3)
    (victim,) = chunk_files(tmp_path, 2)
    damage(victim)
    assert prefetch(engine, sink, "req", [1, 2, 3]) == CHUNK
    stats = engine.stats()
    assert (stats["load_failures"], stats["loads"], stats["disk_chunks"]) == (1, 1, 2)
    # The bad file is forgotten, so the next lookup is a plain miss, not another failure.
    assert prefetch(engine, sink, "again", [1, 2, 3]) == CHUNK
    assert engine.stats()["load_failures"] == 1


def test_a_disk_chunk_of_the_wrong_shape_fails_to_load(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path)
    engine.store_to_disk([1], [CHUNK])
    assert prefetch(engine, sink, "req", [1], offsets=[CHUNK - 1]) == 0
    assert engine.stats()["load_failures"] == 1


def test_an_exception_in_the_walk_reports_the_prefix_and_is_counted(
    make_engine: Callable[..., ReferenceEngine],
    sink: RecordingSink,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    real = ChunkStore.pin_if_in_memory

    def flaky(self: ChunkStore, key: Any, owner: str | None) -> bool:
        if key[0] == 2:
            raise RuntimeError("boom")
        return real(self, key, owner)

    monkeypatch.setattr(ChunkStore, "pin_if_in_memory", flaky)
    engine = make_engine()
    engine.store([1, 2, 3], [CHUNK] * 3)
    assert prefetch(engine, sink, "req", [1, 2, 3]) == CHUNK
    assert engine.stats()["prefetch_errors"] == 1
    assert "prefetch of req failed" in caplog.text
    engine.cleanup_memory_objs("req")
    assert engine.stats()["pinned_chunks"] == 0


def test_not_wired_engine_raises_loudly() -> None:
    engine = ReferenceEngine()
    try:
        engine.post_init()  # no server: still not wired
        with pytest.raises(RuntimeError, match=r"not wired.*post_init\(async_lookup_server"):
            engine.async_lookup_and_prefetch("req", [1], [CHUNK])
        with pytest.raises(TypeError, match="send_response_to_scheduler"):
            engine.set_response_sink(object())  # type: ignore[arg-type]
    finally:
        engine.close()


def test_a_raising_sink_is_logged_and_counted_and_the_pool_keeps_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bad = RaisingSink()
    engine = ReferenceEngine(max_workers=1)
    engine.set_response_sink(bad)
    try:
        engine.store([1], [CHUNK])
        engine.async_lookup_and_prefetch("first", [1], [CHUNK])
        assert bad.wait_for("first") == CHUNK
        engine.async_lookup_and_prefetch("second", [1], [CHUNK])
        assert bad.wait_for("second") == CHUNK
        wait_until(lambda: engine.stats()["reports"] == 2)
        assert engine.stats()["report_errors"] == 1
        assert "response sink failed on first" in caplog.text
    finally:
        engine.close()


# -- pins and cleanup -------------------------------------------------------------


def test_cleanup_releases_pins_and_is_idempotent(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink
) -> None:
    engine = make_engine()
    engine.store([1, 2], [CHUNK, CHUNK])
    assert prefetch(engine, sink, "a", [1, 2]) == 2 * CHUNK
    assert prefetch(engine, sink, "b", [1]) == CHUNK
    stats = engine.stats()
    assert (stats["pinned_chunks"], stats["pinned_lookups"]) == (2, 2)
    engine.cleanup_memory_objs("a")
    assert (engine.stats()["pinned_chunks"], engine.stats()["pinned_lookups"]) == (1, 1)
    engine.cleanup_memory_objs("a")
    engine.cleanup_memory_objs("never-seen")
    engine.cleanup_memory_objs("b")
    assert (engine.stats()["pinned_chunks"], engine.stats()["pinned_lookups"]) == (0, 0)


def test_prefetch_without_pin_pins_nothing(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path)
    engine.store([1], [CHUNK])
    engine.store_to_disk([2], [CHUNK])
    assert prefetch(engine, sink, "req", [1, 2], pin=False) == 2 * CHUNK
    assert engine.stats()["pinned_chunks"] == 0


def test_cleanup_during_prefetch_releases_when_the_prefetch_ends(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path, load_delay_s=1.0)
    engine.store([1], [CHUNK])
    engine.store_to_disk([2], [CHUNK])
    engine.async_lookup_and_prefetch("req", [1, 2], [CHUNK, CHUNK])
    wait_until(lambda: engine.stats()["pinned_chunks"] == 1)  # 1 pinned, 2 still loading
    engine.cleanup_memory_objs("req")
    assert sink.hits("req") is None
    assert engine.stats()["inflight"] == 1
    assert engine.stats()["pinned_chunks"] == 1  # deferred, not lost
    assert sink.wait_for("req") == 2 * CHUNK  # the report still happens
    stats = engine.stats()
    assert (stats["pinned_chunks"], stats["pinned_lookups"], stats["inflight"]) == (0, 0, 0)


def test_stale_pins_are_released_after_pin_timeout(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink
) -> None:
    engine = make_engine(pin_timeout_s=0.05)
    engine.store([1], [CHUNK])
    assert prefetch(engine, sink, "forgotten", [1]) == CHUNK
    wait_until(engine.release_expired_pins)
    stats = engine.stats()
    assert (stats["pinned_lookups"], stats["pins_expired"]) == (0, 1)


def test_pins_return_to_zero_after_many_lookups_and_cleanups(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(memory_capacity_chunks=8, disk_dir=tmp_path, disk_capacity_chunks=8)
    hashes = list(range(1, 7))
    engine.store(hashes[:3], [CHUNK] * 3)
    engine.store_to_disk(hashes[3:], [CHUNK] * 3)
    ids = [f"req-{i}" for i in range(30)]
    for i, lookup_id in enumerate(ids):
        engine.async_lookup_and_prefetch(lookup_id, hashes[: 1 + i % 6], [CHUNK] * (1 + i % 6))
    for i, lookup_id in enumerate(ids):
        assert sink.wait_for(lookup_id) == CHUNK * (1 + i % 6)
        engine.cleanup_memory_objs(lookup_id)
    stats = engine.stats()
    assert (stats["pinned_chunks"], stats["pinned_lookups"], stats["inflight"]) == (0, 0, 0)
    assert stats["reports"] == len(ids) == len(sink.reports)
    assert stats["memory_chunks"] <= 8 and stats["disk_chunks"] <= 8


def test_concurrent_prefetches_and_stores_stay_bounded_and_report_once(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(memory_capacity_chunks=4, disk_dir=tmp_path, disk_capacity_chunks=6)

    def churn(worker: int) -> None:
        for i in range(25):
            base = (worker * 7 + i) % 9
            engine.store([base, base + 1], [CHUNK, CHUNK], tier="disk" if i % 2 else "memory")
            engine.async_lookup_and_prefetch(f"w{worker}-{i}", [base, base + 1], [CHUNK] * 2)

    threads = [threading.Thread(target=churn, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    ids = [f"w{w}-{i}" for w in range(3) for i in range(25)]
    for lookup_id in ids:
        assert sink.wait_for(lookup_id) in (0, CHUNK, 2 * CHUNK)
        engine.cleanup_memory_objs(lookup_id)
    stats = engine.stats()
    assert stats["reports"] == len(ids) and stats["report_errors"] == 0
    assert (stats["pinned_chunks"], stats["pinned_lookups"], stats["inflight"]) == (0, 0, 0)
    assert stats["memory_chunks"] <= 4 and stats["disk_chunks"] <= 6
    assert len(list(tmp_path.glob("*.kv"))) == stats["disk_chunks"]
    assert stats["prefetch_errors"] == 0


# -- synchronous lookup --------------------------------------------------------------


def test_sync_lookup_counts_memory_and_disk_without_loading(
    make_engine: Callable[..., ReferenceEngine], tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path)
    engine.store([1], [CHUNK])
    engine.store_to_disk([2], [50])
    assert engine.lookup([1, 2, 3], [CHUNK, 50, CHUNK]) == CHUNK + 50
    assert (engine.stats()["loads"], engine.stats()["memory_chunks"]) == (0, 1)
    assert engine.lookup([1], [CHUNK], pin=True) == CHUNK  # no lookup_id: nothing to pin under
    assert engine.stats()["pinned_chunks"] == 0
    assert engine.lookup([1, 2], [CHUNK, 50], lookup_id="s", pin=True) == CHUNK + 50
    assert (engine.stats()["pinned_chunks"], engine.stats()["pinned_lookups"]) == (1, 1)
    engine.cleanup_memory_objs("s")
    assert engine.stats()["pinned_chunks"] == 0


# -- lifecycle and validation --------------------------------------------------------


def test_close_is_bounded_interrupts_loads_and_releases_pins(
    make_engine: Callable[..., ReferenceEngine], sink: RecordingSink, tmp_path: Path
) -> None:
    engine = make_engine(disk_dir=tmp_path, load_delay_s=30.0)
    engine.store([1], [CHUNK])
    engine.store_to_disk([2], [CHUNK])
    assert prefetch(engine, sink, "held", [1]) == CHUNK
    engine.async_lookup_and_prefetch("slow", [1, 2], [CHUNK, CHUNK])
    wait_until(lambda: engine.stats()["pinned_lookups"] == 2 and engine.stats()["inflight"] == 1)
    started = time.monotonic()
    engine.close(timeout_s=5.0)
    assert time.monotonic() - started < 5.0
    assert sink.wait_for("slow") == CHUNK  # what it had loaded before close
    stats = engine.stats()
    assert (stats["pinned_chunks"], stats["pinned_lookups"], stats["inflight"]) == (0, 0, 0)
    with pytest.raises(RuntimeError, match="closed"):
        engine.async_lookup_and_prefetch("late", [1], [CHUNK])
    engine.close()  # idempotent


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("memory_capacity_chunks", 0),
        ("memory_capacity_chunks", True),
        ("memory_capacity_chunks", 2.5),
        ("disk_capacity_chunks", 0),
        ("kv_width", 0),
        ("kv_width", "8"),
        ("max_workers", 0),
        ("load_delay_s", -0.1),
        ("load_delay_s", math.nan),
        ("load_delay_s", math.inf),
        ("load_delay_s", "1"),
        ("pin_timeout_s", 0),
    ],
)
def test_bad_constructor_args_raise_value_error_naming_the_arg(name: str, value: object) -> None:
    kwargs: dict[str, Any] = {name: value}
    with pytest.raises(ValueError, match=name):
        ReferenceEngine(**kwargs)


def test_a_disk_dir_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="disk_dir"):
        ReferenceEngine(disk_dir=not_a_dir)


def test_bad_call_args_raise_value_error(make_engine: Callable[..., ReferenceEngine]) -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="differ"):
        engine.async_lookup_and_prefetch("req", [1, 2], [CHUNK])
    with pytest.raises(ValueError, match="positive"):
        engine.lookup([1], [0])
    with pytest.raises(ValueError, match="tier"):
        engine.store([1], [CHUNK], tier="ssd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disk_dir"):
        engine.store_to_disk([1], [CHUNK])
    assert engine.stats()["inflight"] == 0


def test_stale_chunk_files_are_removed_at_start_and_others_kept(tmp_path: Path) -> None:
    (tmp_path / "old.kv").write_bytes(b"x")
    (tmp_path / "half.kv.tmp").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("keep me")
    ReferenceEngine(disk_dir=tmp_path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_chunk_codec_round_trips_and_rejects_damage() -> None:
    tensor = chunk_payload(-12345, 7, 3)
    data = encode_chunk(tensor)
    assert torch.equal(decode_chunk(data, 7, 3), tensor)
    assert torch.equal(chunk_payload(-12345, 7, 3), tensor)  # deterministic
    for bad, rows in [(data[:10], 7), (data, 6), (b"XXXX" + data[4:], 7), (data + b"\0\0", 7)]:
        with pytest.raises(ChunkLoadError):
            decode_chunk(bad, rows, 3)
