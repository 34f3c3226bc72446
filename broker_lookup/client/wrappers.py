"""Clients that wrap another client: the hit limit and chunk statistics.

Every wrapper forwards every method of :class:`LookupClientInterface`, including
``cancel_lookup`` (LMCache D3 raised AttributeError here). Per-lookup maps are
bounded and emptied by ``clear_lookup_status`` / ``cancel_lookup``.

Like the Redis client, none of them raises into the scheduler: each contract method
runs through a :class:`~broker_lookup.client.guard.Guard`, and a wrapper's own
bookkeeping skips what the client it wraps answers 0 for (that client counts it, so
every bad call is counted once). ``stats()`` adds a wrapper's counts to its client's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from broker_lookup.client.guard import Guard
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.interface import LookupClientInterface
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.stats import ClientStats

if TYPE_CHECKING:
    import torch

__all__ = ["BoundedMap", "ChunkStatisticsLookupClient", "HitLimitLookupClient"]


class BoundedMap(OrderedDict[str, int]):
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
    """Forwards everything to ``inner`` through a guard; subclasses override the hooks
    (``_lookup``, ``_lookup_cache``, ``_clear``, ``_cancel``) of what they change."""

    def __init__(self, inner: LookupClientInterface) -> None:
        self.inner = inner
        self._guard = Guard()

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
        return self._guard.call(
            "internal_error", lookup_id, 0, self._lookup, token_ids, lookup_id, request_configs
        )

    def lookup_cache(self, lookup_id: str) -> int | None:
        return self._guard.call("internal_error", lookup_id, -1, self._lookup_cache, lookup_id)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self._guard.call("bad_clear", lookup_id, None, self._clear, lookup_id)

    def cancel_lookup(self, lookup_id: str) -> None:
        self._guard.call("bad_cancel", lookup_id, None, self._cancel, lookup_id)

    def supports_producer_reuse(self) -> bool:
        return self.inner.supports_producer_reuse()

    def close(self) -> None:
        self._guard.call("close_error", None, None, self.inner.close)

    def stats(self) -> ClientStats:
        """The wrapped client's ``stats()`` (where it returns :class:`ClientStats`; else
        one at zero), with this wrapper's counts added to ``rejected``."""
        inner = getattr(self.inner, "stats", None)  # the interface does not require it
        base = inner() if callable(inner) else None
        if not isinstance(base, ClientStats):  # a client of another kind: none of ours
            base = ClientStats()
        rejected = dict(base.rejected)
        for kind, count in self._guard.counts.items():
            rejected[kind] = rejected.get(kind, 0) + count
        return msgspec.structs.replace(base, rejected=rejected)

    def _lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> int | None:
        return self.inner.lookup(token_ids, lookup_id, request_configs)

    def _lookup_cache(self, lookup_id: str) -> int | None:
        return self.inner.lookup_cache(lookup_id)

    def _clear(self, lookup_id: str) -> None:
        self.inner.clear_lookup_status(lookup_id)

    def _cancel(self, lookup_id: str) -> None:
        self.inner.cancel_lookup(lookup_id)


class HitLimitLookupClient(_Forwarding):
    """Caps hits at ``(1 - hit_miss_ratio)`` of the prompt, chunk-aligned, for benchmarks.

    The cap applies to ``lookup_cache`` results too, which is where async results
    arrive (LMCache D16 applied it to ``lookup()`` only).
    """

    def __init__(self, inner: LookupClientInterface, config: LookupConfig) -> None:
        super().__init__(inner)
        self.config = config
        self._tokens = BoundedMap(config.max_pending)

    def _limit(self, lookup_id: str, result: int | None) -> int | None:
        ratio = self.config.hit_miss_ratio
        if result is None or result <= 0 or ratio is None:
            return result
        total = self._tokens.get(lookup_id)
        if not total or result / total <= 1 - ratio:
            return result
        chunk = self.config.chunk_size
        return min(result, int(total * (1 - ratio)) // chunk * chunk)

    def _lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> int | None:
        result = self.inner.lookup(token_ids, lookup_id, request_configs)
        if isinstance(lookup_id, str):
            if result == 0:  # nothing to cap later; a prompt it refused may have no length
                self._tokens.pop(lookup_id, None)
            else:
                self._tokens.put(lookup_id, len(token_ids))
        return self._limit(lookup_id, result)

    def _lookup_cache(self, lookup_id: str) -> int | None:
        return self._limit(lookup_id, self.inner.lookup_cache(lookup_id))

    def _clear(self, lookup_id: str) -> None:
        if isinstance(lookup_id, str):  # any other id: the wrapped client counts it
            self._tokens.pop(lookup_id, None)
        self.inner.clear_lookup_status(lookup_id)

    def _cancel(self, lookup_id: str) -> None:
        if isinstance(lookup_id, str):
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
        self._seen_ids = BoundedMap(config.max_pending)
        self._unique: set[int] = set()
        self._max_unique = max_unique
        self.total_chunks = 0
        self.lookups = 0
        self.lookup_seconds = 0.0
        self.saturated = False

    def _lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> int | None:
        if isinstance(lookup_id, str) and lookup_id not in self._seen_ids:
            self._seen_ids.put(lookup_id, 1)
            self._record(token_ids)
        started = time.perf_counter()
        try:
            return self.inner.lookup(token_ids, lookup_id, request_configs)
        finally:
            self.lookup_seconds += time.perf_counter() - started

    def _record(self, token_ids: list[int] | torch.Tensor) -> None:
        try:
            hashes, _ = self._hasher.hashes_and_offsets(token_ids)
        except Exception:  # not a prompt (InvalidRequest or odder): the wrapped client counts it
            return
        self.lookups += 1
        self.total_chunks += len(hashes)
        for h in hashes:
            if len(self._unique) >= self._max_unique:
                self.saturated = True
                break
            self._unique.add(h)

    def _cancel(self, lookup_id: str) -> None:
        if isinstance(lookup_id, str):
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
