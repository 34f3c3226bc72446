"""The KV-cache engine each worker rank runs: :class:`ReferenceEngine`.

It implements LMCache's engine contract (``LookupEngine``, and ``SyncLookupEngine`` for
the bypass client) over the tiered store of :mod:`workers.reference.chunk_store`, and reports the
prefix actually loaded exactly once per prefetch, even on failure (fixes LMCache D9).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from broker_lookup.engine import ResponseSink
from broker_lookup.printable import shown
from workers.reference.chunk_store import (
    ChunkKey,
    ChunkLoadError,
    ChunkStore,
    Tier,
    chunk_payload,
    make_tags,
)

__all__ = ["ReferenceEngine"]

logger = logging.getLogger(__name__)

_NOT_WIRED = (
    "ReferenceEngine is not wired to a lookup server: call post_init(async_lookup_server=...) first"
)
_COUNTERS = (
    "loads",
    "load_failures",
    "reports",
    "report_errors",
    "prefetch_errors",
    "stores",
    "progress_reports",
    "kept_released",
)
Configs = Mapping[str, Any] | None
Chunks = list[tuple[ChunkKey, int]]  # (key, token count) per chunk, in prompt order
#: The sink's optional ``send_progress_to_scheduler(lookup_id, num_loaded_tokens)``.
Progress = Callable[[str, int], None]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_seconds(name: str, value: float, *, allow_zero: bool) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")


def _chunks(hashes: Sequence[int], offsets: Sequence[int], configs: Configs) -> Chunks:
    if len(hashes) != len(offsets):
        raise ValueError(f"hashes and offsets differ: {len(hashes)} != {len(offsets)} items")
    for tokens in offsets:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"offsets must be positive token counts, got {tokens!r}")
    tags = make_tags(configs)
    return [((int(h), tags), tokens) for h, tokens in zip(hashes, offsets, strict=True)]


class ReferenceEngine:
    """A real in-process KV-cache engine for worker ranks, demos, benchmarks and tests.

    Chunks are keyed by ``(chunk_hash, tags)``; payloads derive from the hash, so a load
    can be verified. ``offsets`` are per-chunk token counts. Example::

        engine = ReferenceEngine(disk_dir="/tmp/rank0", load_delay_s=0.01)
        engine.post_init(async_lookup_server=server)    # anything with send_response_to_scheduler
        engine.store([11, 22], [256, 100])               # memory tier
        engine.store_to_disk([33], [256])                # disk tier only
        engine.async_lookup_and_prefetch("req-1", [11, 22], [256, 100])  # later reports 356
        engine.cleanup_memory_objs("req-1")              # releases the pins of req-1
        engine.close()
    """

    def __init__(
        self,
        *,
        memory_capacity_chunks: int = 4096,
        disk_dir: str | Path | None = None,
        disk_capacity_chunks: int = 16384,
        kv_width: int = 8,
        max_workers: int = 4,
        load_delay_s: float = 0.0,
        pin_timeout_s: float = 300.0,
    ) -> None:
        _check_int("memory_capacity_chunks", memory_capacity_chunks, 1)
        _check_int("disk_capacity_chunks", disk_capacity_chunks, 1)
        _check_int("kv_width", kv_width, 1)
        _check_int("max_workers", max_workers, 1)
        _check_seconds("load_delay_s", load_delay_s, allow_zero=True)
        _check_seconds("pin_timeout_s", pin_timeout_s, allow_zero=False)
        self._store = ChunkStore(memory_capacity_chunks, disk_dir, disk_capacity_chunks)
        self._kv_width = kv_width
        self._load_delay_s = float(load_delay_s)
        self._pin_timeout_s = float(pin_timeout_s)
        self._sink: ResponseSink | None = None
        # Engine bookkeeping only; never held across store calls, the sink or sleeps.
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}
        self._pending_cleanup: set[str] = set()
        #: Prefixes a partial answer kept, of prefetches still running: they stop there.
        self._caps: dict[str, int] = {}
        self._futures: set[Future[None]] = set()
        self._counters = dict.fromkeys((*_COUNTERS, "pins_expired"), 0)
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="reference-engine")

    def post_init(self, async_lookup_server: ResponseSink | None = None) -> None:
        """LMCache-style wiring: the lookup server hands itself over as the report sink."""
        if async_lookup_server is not None:
            self.set_response_sink(async_lookup_server)

    def set_response_sink(self, sink: ResponseSink) -> None:
        """Set where prefetch reports go (anything with ``send_response_to_scheduler``)."""
        if not callable(getattr(sink, "send_response_to_scheduler", None)):
            raise TypeError(f"{sink!r} has no send_response_to_scheduler(lookup_id, hits) method")
        self._sink = sink

    def store(
        self,
        hashes: Sequence[int],
        offsets: Sequence[int],
        request_configs: Configs = None,
        *,
        tier: Tier = "memory",
    ) -> int:
        """Put the chunks' deterministic payloads in ``tier``; return how many were stored."""
        if tier not in ("memory", "disk"):
            raise ValueError(f"tier must be 'memory' or 'disk', got {tier!r}")
        if tier == "disk" and not self._store.has_disk:
            raise ValueError("tier='disk' needs a disk tier: construct with disk_dir=...")
        stored = 0
        for key, tokens in _chunks(hashes, offsets, request_configs):
            stored += self._store.put(key, chunk_payload(key[0], tokens, self._kv_width), tier)
        self._count("stores", stored)
        return stored

    def store_to_disk(
        self, hashes: Sequence[int], offsets: Sequence[int], request_configs: Configs = None
    ) -> int:
        """Put chunks on the disk tier only (so a prefetch has to load them)."""
        return self.store(hashes, offsets, request_configs, tier="disk")

    def get_chunk(self, chunk_hash: int, request_configs: Configs = None) -> torch.Tensor | None:
        """Return a chunk's memory-tier tensor (None if not in memory), e.g. to verify a load."""
        return self._store.peek((int(chunk_hash), make_tags(request_configs)))

    def lookup(
        self,
        hashes: list[int],
        offsets: list[int],
        lookup_id: str | None = None,
        pin: bool = False,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Return the prefix (tokens) in memory or on disk now, loading nothing; maybe pin hits."""
        chunks = _chunks(hashes, offsets, request_configs)
        self.release_expired_pins()
        owner = lookup_id if pin else None
        hits = 0
        for key, tokens in chunks:
            if not (self._store.pin_if_in_memory(key, owner) or self._store.on_disk(key)):
                break
            hits += tokens
        return hits

    def probe_prefix(
        self,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """The fleet query's lookup (``ProbeEngine``): the prefix held now, in memory or
        on disk, loading and pinning nothing, and leaving the LRU order alone (a router's
        question must not change what gets evicted)."""
        hits = 0
        for key, tokens in _chunks(hashes, offsets, request_configs):
            if self._store.peek(key) is None and not self._store.on_disk(key):
                break
            hits += tokens
        return hits

    def reserve_prefix(
        self,
        owner: str,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """A reservation (``ReserveEngine``): pin the leading chunks in memory for
        ``owner``, loading nothing; return their tokens. ``cleanup_memory_objs(owner)``
        releases them (and the pin timeout, as any lookup's)."""
        reserved = 0
        for key, tokens in _chunks(hashes, offsets, request_configs):
            if not self._store.pin_if_in_memory(key, owner):
                break
            reserved += tokens
        return reserved

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """Start a prefetch and return; the sink later gets the loaded prefix, exactly once.

        Raises, reporting nothing, if not wired, closed, or given bad arguments.
        """
        sink = self._sink
        if sink is None:
            raise RuntimeError(_NOT_WIRED)
        if self._closing.is_set():
            raise RuntimeError("ReferenceEngine is closed")
        chunks = _chunks(hashes, offsets, request_configs)
        self.release_expired_pins()
        with self._lock:
            future = self._pool.submit(self._prefetch, sink, lookup_id, chunks, pin)
            self._inflight[lookup_id] = self._inflight.get(lookup_id, 0) + 1
            self._futures.add(future)
        future.add_done_callback(self._forget_future)

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Release every pin of ``lookup_id`` now, or when its running prefetch ends. Idempotent."""
        with self._lock:
            if lookup_id in self._inflight:
                self._pending_cleanup.add(lookup_id)
                return
        self._store.release(lookup_id)

    def keep_memory_objs(self, lookup_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` of ``lookup_id`` pinned and release the rest; a
        prefetch still running stops there (a partial answer was given at the deadline)."""
        with self._lock:
            if lookup_id in self._inflight:
                self._caps[lookup_id] = num_tokens
        released = self._store.keep_prefix(lookup_id, num_tokens)
        self._count("kept_released", released)

    def release_expired_pins(self) -> int:
        """Release pins older than ``pin_timeout_s`` (a PinMonitor, run on every lookup)."""
        with self._lock:
            busy = set(self._inflight)
        expired = self._store.expire_owners(self._pin_timeout_s, busy)
        if expired:
            logger.warning("released stale pins of %d lookups: %s", len(expired), expired[:3])
            self._count("pins_expired", len(expired))
        return len(expired)

    def stats(self) -> dict[str, int]:
        """Counters and sizes for bounded-resource checks (``reports`` counts every attempt)."""
        with self._lock:
            out = dict(self._counters)
            out["inflight"] = sum(self._inflight.values())
        out.update(self._store.snapshot())
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop taking work, wait up to ``timeout_s`` for prefetches, release all pins. Idempotent.

        Prefetches still queued or sleeping stop early and report what they had loaded.
        """
        self._closing.set()
        with self._lock:
            futures = list(self._futures)
        _, not_done = wait(futures, timeout=timeout_s)
        if not_done:
            logger.error("%d prefetches still running after %.1fs", len(not_done), timeout_s)
        self._store.release_all()
        self._pool.shutdown(wait=False)

    def _prefetch(self, sink: ResponseSink, lookup_id: str, chunks: Chunks, pin: bool) -> None:
        loaded = 0
        # Progress only means something for pinned chunks: they are what a partial
        # answer promises the scheduler.
        progress = getattr(sink, "send_progress_to_scheduler", None) if pin else None
        try:
            for tokens in self._walk(lookup_id, chunks, pin, progress):
                loaded += tokens
        except Exception:
            logger.exception("prefetch of %s failed after %d tokens", shown(lookup_id), loaded)
            self._count("prefetch_errors")
        finally:
            try:
                self._finish(lookup_id)
            finally:
                self._report(sink, lookup_id, loaded)

    def _walk(
        self, lookup_id: str, chunks: Chunks, pin: bool, progress: Progress | None = None
    ) -> Iterator[int]:
        """Yield the token count of each chunk made resident, stopping at the first miss
        (or at a kept prefix). ``progress`` hears the prefix held in memory when the first
        chunk has to be loaded, then the prefix after each chunk loaded."""
        owner = lookup_id if pin else None
        loaded = 0
        told = False  # whether the memory prefix was reported
        for key, tokens in chunks:
            if self._closing.is_set() or not self._fits(lookup_id, loaded + tokens):
                return
            if not self._store.pin_if_in_memory(key, owner):
                if loaded and progress is not None and not told:
                    self._progress(progress, lookup_id, loaded)  # the memory prefix, at once
                told = True
                if not self._load(key, tokens, owner):
                    return
                if progress is not None:
                    self._progress(progress, lookup_id, loaded + tokens)
            loaded += tokens
            if not self._fits(lookup_id, loaded):  # kept meanwhile: drop what went beyond
                self._store.keep_prefix(lookup_id, self._caps.get(lookup_id, loaded))
                return
            yield tokens

    def _fits(self, lookup_id: str, tokens: int) -> bool:
        cap = self._caps.get(lookup_id)
        return cap is None or tokens <= cap

    def _progress(self, progress: Progress, lookup_id: str, tokens: int) -> None:
        self._count("progress_reports")
        try:
            progress(lookup_id, tokens)
        except Exception:
            logger.exception("response sink failed on progress of %s", shown(lookup_id))
            self._count("report_errors")

    def _load(self, key: ChunkKey, tokens: int, owner: str | None) -> bool:
        """Load a disk chunk into memory (pinned for ``owner``); False on a miss or a failure."""
        if not self._store.on_disk(key):
            return False
        # Simulated read latency; Event.wait so close() interrupts it.
        if self._load_delay_s and self._closing.wait(self._load_delay_s):
            return False
        try:
            tensor = self._store.read_disk(key, tokens, self._kv_width)
        except ChunkLoadError as exc:
            logger.warning("chunk %x failed to load: %s", key[0], exc)
            self._count("load_failures")
            return False
        if tensor is None:  # evicted from disk while we waited
            return False
        if not self._store.put_memory(key, tensor, owner):
            logger.warning("chunk %x: no memory to load into (every chunk is pinned)", key[0])
            self._count("load_failures")
            return False
        self._count("loads")
        return True

    def _finish(self, lookup_id: str) -> None:
        with self._lock:
            left = self._inflight.pop(lookup_id, 1) - 1
            if left > 0:  # another prefetch of the same id still runs
                self._inflight[lookup_id] = left
                cleanup = False
            else:
                cleanup = lookup_id in self._pending_cleanup
                self._pending_cleanup.discard(lookup_id)
                self._caps.pop(lookup_id, None)
        if cleanup or self._closing.is_set():
            self._store.release(lookup_id)

    def _report(self, sink: ResponseSink, lookup_id: str, tokens: int) -> None:
        self._count("reports")
        try:
            sink.send_response_to_scheduler(lookup_id, tokens)
        except Exception:
            # Must not escape into the pool, where nobody would see it.
            logger.exception("response sink failed on %s (%d tokens)", shown(lookup_id), tokens)
            self._count("report_errors")

    def _forget_future(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n
