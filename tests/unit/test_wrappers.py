"""Wrappers and the bypass client: forwarding (D3), the hit limit (D16), statistics, bypass (D1)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from broker_lookup import (
    BypassLookupClient,
    ChunkedTokenHasher,
    ChunkStatisticsLookupClient,
    HitLimitLookupClient,
    LookupClientInterface,
    LookupConfig,
    LookupMetadata,
)
from workers import ReferenceEngine

META = LookupMetadata(engine_id="e", world_size=1)


class Recording(LookupClientInterface):
    """An inner client that records every call and answers what the test sets."""

    def __init__(self, lookup_result: int | None = None) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.lookup_result = lookup_result
        self.cached: dict[str, int | None] = {}

    def lookup(
        self, token_ids: Any, lookup_id: str, request_configs: dict[str, Any] | None = None
    ) -> int | None:
        self.calls.append(("lookup", len(token_ids), lookup_id, request_configs))
        return self.lookup_result

    def lookup_cache(self, lookup_id: str) -> int | None:
        self.calls.append(("lookup_cache", lookup_id))
        return self.cached.get(lookup_id, -1)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.calls.append(("clear_lookup_status", lookup_id))

    def cancel_lookup(self, lookup_id: str) -> None:
        self.calls.append(("cancel_lookup", lookup_id))

    def supports_producer_reuse(self) -> bool:
        self.calls.append(("supports_producer_reuse",))
        return True

    def close(self) -> None:
        self.calls.append(("close",))


def lmcache_limit(result: int, total: int, ratio: float, chunk: int) -> int:
    """LMCache 0.5.6 HitLimitLookupClient's arithmetic (reference section 4.2)."""
    upper = 1 - ratio
    if total > 0 and result / total > upper:
        return min(result, int(total * upper) // chunk * chunk)
    return result


def wrap(kind: str, inner: LookupClientInterface) -> LookupClientInterface:
    if kind == "hit_limit":
        return HitLimitLookupClient(inner, LookupConfig(hit_miss_ratio=0.0))
    return ChunkStatisticsLookupClient(inner, LookupConfig(), META)


# -- forwarding (LMCache D3) ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["hit_limit", "chunk_statistics"])
def test_wrappers_forward_every_method(kind: str) -> None:
    inner = Recording(lookup_result=None)
    client = wrap(kind, inner)
    configs = {"lmcache.tag.user": "u"}
    assert client.lookup(list(range(10)), "r1", configs) is None
    assert client.lookup_cache("r1") == -1
    client.clear_lookup_status("r1")
    client.cancel_lookup("r1")
    assert client.supports_producer_reuse() is True
    client.close()
    assert inner.calls == [
        ("lookup", 10, "r1", configs),
        ("lookup_cache", "r1"),
        ("clear_lookup_status", "r1"),
        ("cancel_lookup", "r1"),
        ("supports_producer_reuse",),
        ("close",),
    ]
    assert client.actual_lookup_client is inner  # type: ignore[attr-defined]  # LMCache's name


def test_wrappers_nest_and_cancel_reaches_the_innermost() -> None:
    inner = Recording()
    outer = ChunkStatisticsLookupClient(
        HitLimitLookupClient(inner, LookupConfig(hit_miss_ratio=0.5)), LookupConfig(), META
    )
    outer.cancel_lookup("gone")
    assert inner.calls == [("cancel_lookup", "gone")]


# -- the hit limit ------------------------------------------------------------------------------


CASES = [
    # (tokens, raw result, ratio, chunk)
    (1024, 1024, 0.7, 256),
    (1024, 1024, 0.0, 256),
    (1024, 1024, 1.0, 256),
    (1024, 512, 0.5, 256),
    (1024, 768, 0.5, 256),
    (1000, 1000, 0.3, 256),
    (1000, 700, 0.3, 16),
    (40, 40, 0.5, 4),
    (41, 40, 0.25, 4),
    (300, 256, 0.9, 256),
    (1024, 0, 0.5, 256),
]


@pytest.mark.parametrize(("tokens", "raw", "ratio", "chunk"), CASES)
def test_hit_limit_on_lookup_is_lmcache_formula(
    tokens: int, raw: int, ratio: float, chunk: int
) -> None:
    client = HitLimitLookupClient(
        Recording(lookup_result=raw), LookupConfig(hit_miss_ratio=ratio, chunk_size=chunk)
    )
    assert client.lookup(list(range(tokens)), "r") == lmcache_limit(raw, tokens, ratio, chunk)


@pytest.mark.parametrize(("tokens", "raw", "ratio", "chunk"), CASES)
def test_hit_limit_applies_to_lookup_cache_results_too(
    tokens: int, raw: int, ratio: float, chunk: int
) -> None:
    inner = Recording(lookup_result=None)  # async: the result arrives later (LMCache D16)
    client = HitLimitLookupClient(inner, LookupConfig(hit_miss_ratio=ratio, chunk_size=chunk))
    assert client.lookup(list(range(tokens)), "r") is None
    inner.cached["r"] = None
    assert client.lookup_cache("r") is None
    inner.cached["r"] = raw
    expected = lmcache_limit(raw, tokens, ratio, chunk)
    assert client.lookup_cache("r") == expected == client.lookup_cache("r")  # re-polls too


def test_hit_limit_matches_lmcache_on_random_cases() -> None:
    rng = random.Random(7)
    for _ in range(300):
        tokens, chunk = rng.randrange(1, 5000), rng.choice([1, 4, 16, 256])
        raw, ratio = rng.randrange(0, tokens + 1), rng.choice([0.0, 0.1, 0.33, 0.5, 0.9, 1.0])
        inner = Recording(lookup_result=raw)
        client = HitLimitLookupClient(inner, LookupConfig(hit_miss_ratio=ratio, chunk_size=chunk))
        expected = lmcache_limit(raw, tokens, ratio, chunk)
        assert client.lookup(list(range(tokens)), "r") == expected
        inner.cached["r"] = raw
        assert client.lookup_cache("r") == expected


def test_hit_limit_passes_unknown_and_forgotten_ids_through() -> None:
    inner = Recording(lookup_result=None)
    client = HitLimitLookupClient(inner, LookupConfig(hit_miss_ratio=1.0, chunk_size=4))
    inner.cached["never-looked-up"] = 40
    assert client.lookup_cache("never-looked-up") == 40  # no token count: nothing to cap by
    assert client.lookup_cache("absent") == -1
    client.lookup(list(range(40)), "r")
    inner.cached["r"] = 40
    assert client.lookup_cache("r") == 0  # ratio 1.0: every hit capped away
    client.clear_lookup_status("r")
    assert client.lookup_cache("r") == 40  # forgotten with the status: the id may be reused


def test_hit_limit_with_tensor_input() -> None:
    client = HitLimitLookupClient(
        Recording(lookup_result=1024), LookupConfig(hit_miss_ratio=0.7, chunk_size=256)
    )
    assert client.lookup(torch.arange(1024), "r") == 256


# -- chunk statistics ----------------------------------------------------------------------------


@pytest.fixture
def stats() -> Iterator[ChunkStatisticsLookupClient]:
    client = ChunkStatisticsLookupClient(Recording(lookup_result=0), LookupConfig(), META)
    yield client
    client.close()


def test_chunk_statistics_counts_total_and_unique(stats: ChunkStatisticsLookupClient) -> None:
    prompt = list(range(512))
    stats.lookup(prompt, "a")
    stats.lookup(prompt[:256], "b")
    got = stats.get_statistics()
    assert (got["total_chunks"], got["unique_chunks"], got["duplicate_chunks"]) == (3, 2, 1)
    assert got["lookups"] == 2 and got["reuse_rate"] == pytest.approx(1 / 3)
    assert got["lookup_seconds"] >= 0 and got["saturated"] is False


def test_chunk_statistics_does_not_re_record_a_repeated_id(
    stats: ChunkStatisticsLookupClient,
) -> None:
    stats.lookup(list(range(512)), "a")
    stats.lookup(list(range(512)), "a")  # preempted and looked up again
    stats.clear_lookup_status("a")
    stats.lookup(list(range(512)), "a")
    got = stats.get_statistics()
    assert (got["lookups"], got["total_chunks"], got["unique_chunks"]) == (1, 2, 2)


def test_chunk_statistics_uses_the_lookup_hashing(stats: ChunkStatisticsLookupClient) -> None:
    stats.lookup(torch.arange(600), "t")  # tensor input; the 88-token tail is not a chunk
    assert stats.get_statistics()["total_chunks"] == 2
    unfull = ChunkStatisticsLookupClient(
        Recording(), LookupConfig(chunk_size=256, save_unfull_chunk=True), META
    )
    unfull.lookup(list(range(600)), "t")
    assert unfull.get_statistics()["total_chunks"] == 3


def test_chunk_statistics_reset_and_saturation() -> None:
    client = ChunkStatisticsLookupClient(
        Recording(), LookupConfig(chunk_size=4), META, max_unique=3
    )
    client.lookup(list(range(40)), "a")
    got = client.get_statistics()
    assert got["total_chunks"] == 10 and got["unique_chunks"] == 3 and got["saturated"] is True
    client.reset()
    assert client.get_statistics()["total_chunks"] == 0
    client.lookup(list(range(8)), "a")  # a reset forgets seen ids too
    assert client.get_statistics()["total_chunks"] == 2


# -- bypass (LMCache D1) -------------------------------------------------------------------------


BYPASS_CFG = LookupConfig(chunk_size=4, enable_scheduler_bypass_lookup=True)


@pytest.fixture
def engine() -> Iterator[ReferenceEngine]:
    eng = ReferenceEngine(memory_capacity_chunks=64)
    yield eng
    eng.close()


def stored(engine: ReferenceEngine, tokens: list[int]) -> None:
    hashes, offsets = ChunkedTokenHasher(BYPASS_CFG).hashes_and_offsets(tokens)
    engine.store(hashes, offsets)


def test_bypass_lookup_cache_is_minus_one_then_the_result(engine: ReferenceEngine) -> None:
    prompt = list(range(100, 140))
    stored(engine, prompt[:24])
    client = BypassLookupClient(BYPASS_CFG, META, engine)
    assert client.lookup_cache("r") == -1
    assert client.lookup(prompt, "r") == 24
    assert client.lookup_cache("r") == 24
    assert client.lookup_cache("r") == 24
    client.clear_lookup_status("r")
    assert client.lookup_cache("r") == -1
    client.close()


def test_bypass_pins_and_cancel_releases_them(engine: ReferenceEngine) -> None:
    prompt = list(range(40))
    stored(engine, prompt)
    client = BypassLookupClient(BYPASS_CFG, META, engine)
    assert client.lookup(prompt, "r") == 40
    assert engine.stats()["pinned_lookups"] == 1 and engine.stats()["pinned_chunks"] == 10
    client.cancel_lookup("r")
    assert engine.stats()["pinned_lookups"] == 0 and engine.stats()["pinned_chunks"] == 0
    assert client.lookup_cache("r") == -1
    client.cancel_lookup("r")  # idempotent, and safe for an unknown id


def test_bypass_miss_short_prompt_and_configs(engine: ReferenceEngine) -> None:
    client = BypassLookupClient(BYPASS_CFG, META, engine)
    assert client.lookup(list(range(40)), "miss") == 0 and client.lookup_cache("miss") == 0
    assert client.lookup([1, 2, 3], "short") == 0  # under one chunk: nothing asked
    hashes, offsets = ChunkedTokenHasher(BYPASS_CFG).hashes_and_offsets(list(range(8)))
    engine.store(hashes, offsets, {"lmcache.tag.user": "a"})
    assert client.lookup(list(range(8)), "untagged") == 0
    assert client.lookup(list(range(8)), "tagged", {"lmcache.tag.user": "a"}) == 8


class Exploding:
    def lookup(self, *args: Any, **kwargs: Any) -> int:
        raise RuntimeError("backend down")


def test_bypass_engine_failure_answers_zero_and_cancel_needs_no_cleanup() -> None:
    client = BypassLookupClient(BYPASS_CFG, META, Exploding())
    assert client.lookup(list(range(40)), "r") == 0
    assert client.lookup_cache("r") == 0
    client.cancel_lookup("r")  # the engine has no cleanup_memory_objs: still no error
    assert client.lookup_cache("r") == -1
    assert client.supports_producer_reuse() is False


# -- nothing raises into the scheduler ------------------------------------------------------------


class Raising(Recording):
    """An inner client (an external scheme's, say) whose every contract method raises."""

    def lookup(self, *args: Any, **kwargs: Any) -> int | None:
        raise RuntimeError("inner lookup")

    def lookup_cache(self, lookup_id: str) -> int | None:
        raise RuntimeError("inner lookup_cache")

    def clear_lookup_status(self, lookup_id: str) -> None:
        raise RuntimeError("inner clear")

    def cancel_lookup(self, lookup_id: str) -> None:
        raise RuntimeError("inner cancel")

    def close(self) -> None:
        raise RuntimeError("inner close")


@pytest.mark.parametrize("kind", ["hit_limit", "chunk_statistics"])
def test_an_inner_client_that_raises_is_answered_counted_and_logged_once(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = wrap(kind, Raising())
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for _ in range(3):
            assert client.lookup(list(range(40)), "r") == 0  # recompute
            assert client.lookup_cache("r") == -1  # unknown: the scheduler asks again
            client.clear_lookup_status("r")
            client.cancel_lookup("r")
            client.close()
    want = {"internal_error": 6, "bad_clear": 3, "bad_cancel": 3, "close_error": 3}
    assert client.stats().rejected == want  # type: ignore[attr-defined]
    assert len(caplog.records) == 4, "one line per kind"


class FailingEngine:
    """A bypass engine whose lookup answers ``answer`` (raises if it is an exception)
    and whose cleanup raises when ``cleanup_raises``."""

    def __init__(self, answer: Any, cleanup_raises: bool = False) -> None:
        self.answer = answer
        self.cleanup_raises = cleanup_raises
        self.released: list[str] = []

    def lookup(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        if self.cleanup_raises:
            raise RuntimeError("cleanup failed")
        self.released.append(lookup_id)


@pytest.mark.parametrize("answer", [RuntimeError("backend down"), None, "many", -4, 41, 10**9])
def test_bypass_engine_failure_or_nonsense_answers_zero_and_releases(
    answer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FailingEngine(answer)
    client = BypassLookupClient(BYPASS_CFG, META, engine)
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for i in range(3):
            assert client.lookup(list(range(40)), f"r{i}") == 0
            assert client.lookup_cache(f"r{i}") == 0
    assert client.stats().rejected == {"engine_error": 3}
    assert engine.released == ["r0", "r1", "r2"], "what it may have pinned is released"
    assert len(caplog.records) == 1


def test_bypass_cancel_with_an_engine_whose_cleanup_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = BypassLookupClient(BYPASS_CFG, META, FailingEngine(40, cleanup_raises=True))
    assert client.lookup(list(range(40)), "r") == 40
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for _ in range(3):
            client.cancel_lookup("r")
    assert client.lookup_cache("r") == -1
    assert client.stats().rejected == {"engine_error": 3}
    assert len(caplog.records) == 1
