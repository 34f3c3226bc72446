"""Clients that wrap or replace the Redis client: hit limit, chunk statistics, bypass.

Every wrapper forwards every method of :class:`LookupClientInterface`, including
``cancel_lookup`` (LMCache D3 raised AttributeError here). Per-lookup maps are
bounded and emptied by ``clear_lookup_status`` / ``cancel_lookup``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.engine import SyncLookupEngine
from broker_lookup.interface import LookupClientInterface
from broker_lookup.protocol.hashing import ChunkedTokenHasher

if TYPE_CHECKING:
    import torch

__all__ = ["BypassLookupClient", "ChunkStatisticsLookupClient", "HitLimitLookupClient"]

logger = logging.getLogger(__name__)


class _BoundedMap(OrderedDict[str, int]):
    """A dict that forgets its oldest entries beyond ``capacity``."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: str, value: int) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


class _Forwarding(LookupClientInterface):
    """Forwards everything to ``inner``; subclasses override what they change."""

    def __init__(self, inner: LookupClientInterface) -> None:
        self.inner = inner

    @property
    def actual_lookup_client(self) -> LookupClientInterface:
        """LMCache's name for ``inner``: its ``/lookup/info`` unwraps wrappers through it."""
        return self.inner

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        return self.inner.lookup(token_ids, lookup_id, request_configs)

    def lookup_cache(self, lookup_id: str) -> int | None:
        return self.inner.lookup_cache(lookup_id)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.inner.clear_lookup_status(lookup_id)

    def cancel_lookup(self, lookup_id: str) -> None:
        self.inner.cancel_lookup(lookup_id)

    def supports_producer_reuse(self) -> bool:
        return self.inner.supports_producer_reuse()

    def close(self) -> None:
        self.inner.close()


class HitLimitLookupClient(_Forwarding):
    """Caps hits at ``(1 - hit_miss_ratio)`` of the prompt, chunk-aligned, for benchmarks.

    The cap applies to ``lookup_cache`` results too, which is where async results
    arrive (LMCache D16 applied it to ``lookup()`` only).
    """

    def __init__(self, inner: LookupClientInterface, config: LookupConfig) -> None:
        super().__init__(inner)
        self.config = config
        self._tokens = _BoundedMap(config.max_pending)

    def _limit(self, lookup_id: str, result: int | None) -> int | None:
        ratio = self.config.hit_miss_ratio
        total = self._tokens.get(lookup_id)
        if result is None or result <= 0 or ratio is None or not total:
            return result
        if result / total <= 1 - ratio:
            return result
        chunk = self.config.chunk_size
        return min(result, int(total * (1 - ratio)) // chunk * chunk)

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        self._tokens.put(lookup_id, len(token_ids))
        return self._limit(lookup_id, self.inner.lookup(token_ids, lookup_id, request_configs))

    def lookup_cache(self, lookup_id: str) -> int | None:
        return self._limit(lookup_id, self.inner.lookup_cache(lookup_id))

    def clear_lookup_status(self, lookup_id: str) -> None:
        self._tokens.pop(lookup_id, None)
        self.inner.clear_lookup_status(lookup_id)

    def cancel_lookup(self, lookup_id: str) -> None:
        self._tokens.pop(lookup_id, None)
        self.inner.cancel_lookup(lookup_id)


class ChunkStatisticsLookupClient(_Forwarding):
    """Counts total and unique chunks looked up, with the lookup's own hashing settings.

    Using the lookup's hasher (not a config-less one) keeps the statistics about the
    same chunks the workers see (LMCache D12). A repeated lookup of one id
    (preemption) is counted once. Unique counting stops growing at ``max_unique``.
    """

    def __init__(
        self,
        inner: LookupClientInterface,
        config: LookupConfig,
        metadata: LookupMetadata,
        max_unique: int = 1_000_000,
    ) -> None:
        super().__init__(inner)
        self._hasher = ChunkedTokenHasher(config)
        self._seen_ids = _BoundedMap(config.max_pending)
        self._unique: set[int] = set()
        self._max_unique = max_unique
        self.total_chunks = 0
        self.lookups = 0
        self.lookup_seconds = 0.0
        self.saturated = False

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        if lookup_id not in self._seen_ids:
            self._seen_ids.put(lookup_id, 1)
            self._record(token_ids)
        started = time.perf_counter()
        try:
            return self.inner.lookup(token_ids, lookup_id, request_configs)
        finally:
            self.lookup_seconds += time.perf_counter() - started

    def _record(self, token_ids: list[int] | torch.Tensor) -> None:
        hashes, _ = self._hasher.hashes_and_offsets(token_ids)
        self.lookups += 1
        self.total_chunks += len(hashes)
        for h in hashes:
            if len(self._unique) >= self._max_unique:
                self.saturated = True
                break
            self._unique.add(h)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self.inner.clear_lookup_status(lookup_id)

    def cancel_lookup(self, lookup_id: str) -> None:
        self._seen_ids.pop(lookup_id, None)
        self.inner.cancel_lookup(lookup_id)

    def get_statistics(self) -> dict[str, Any]:
        """Totals so far: chunks, unique chunks, duplicates and the reuse rate."""
        unique = len(self._unique)
        dup = self.total_chunks - unique
        return {
            "lookups": self.lookups,
            "total_chunks": self.total_chunks,
            "unique_chunks": unique,
            "duplicate_chunks": dup,
            "reuse_rate": dup / self.total_chunks if self.total_chunks else 0.0,
            "lookup_seconds": self.lookup_seconds,
            "saturated": self.saturated,
        }

    def reset(self) -> None:
        """Forget everything counted."""
        self._unique.clear()
        self._seen_ids.clear()
        self.total_chunks = self.lookups = 0
        self.lookup_seconds = 0.0
        self.saturated = False


class BypassLookupClient(LookupClientInterface):
    """The scheduler asks its own engine (shared remote backend, MLA); no Redis round trip.

    Unlike LMCache's bypass client it answers ``lookup_cache`` correctly (-1 or the
    cached int), so the scheduler does not wait forever (LMCache D1).
    """

    def __init__(
        self, config: LookupConfig, metadata: LookupMetadata, engine: SyncLookupEngine
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.engine = engine
        self._hasher = ChunkedTokenHasher(config)
        self._results = _BoundedMap(config.max_pending)

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        hashes, offsets = self._hasher.hashes_and_offsets(token_ids)
        if not hashes:
            return 0
        try:
            hits = int(
                self.engine.lookup(
                    hashes, offsets, lookup_id=lookup_id, pin=True, request_configs=request_configs
                )
            )
        except Exception:  # an engine failure means "recompute", never a scheduler crash
            logger.exception("bypass lookup of %s failed; answering 0", lookup_id)
            hits = 0
        self._results.put(lookup_id, hits)
        return hits

    def lookup_cache(self, lookup_id: str) -> int:
        return self._results.get(lookup_id, -1)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self._results.pop(lookup_id, None)

    def cancel_lookup(self, lookup_id: str) -> None:
        self._results.pop(lookup_id, None)
        release = getattr(self.engine, "cleanup_memory_objs", None)
        if callable(release):
            release(lookup_id)

    def close(self) -> None:
        self._results.clear()
