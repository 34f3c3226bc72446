"""What a worker needs from a KV-cache engine: the :class:`LookupEngine` protocol.

The contract is LMCache's (``LMCacheEngine.async_lookup_and_prefetch`` and
``cleanup_memory_objs``): the engine sees the caller's plain ``lookup_id`` and
reports the number of prefix tokens it actually loaded through the server's
``send_response_to_scheduler(lookup_id, num_hit_tokens)``. The generation of a
lookup travels beside the id in Redis, never inside it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["LookupEngine", "ResponseSink", "SyncLookupEngine"]


@runtime_checkable
class ResponseSink(Protocol):
    """Where an engine reports a finished prefetch (the lookup server)."""

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """Report that ``num_hit_tokens`` prefix tokens of ``lookup_id`` are loaded and pinned."""


@runtime_checkable
class LookupEngine(Protocol):
    """The engine side of an asynchronous lookup.

    ``async_lookup_and_prefetch`` must return quickly and later call the server's
    ``send_response_to_scheduler`` exactly once for that ``lookup_id``.
    ``cleanup_memory_objs`` releases whatever the lookup pinned; it must be safe
    to call for an id the engine does not know.
    """

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """Start looking up and prefetching the chunks; report when done."""

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Release the memory a lookup pinned (abort, timeout, or superseded)."""


@runtime_checkable
class SyncLookupEngine(Protocol):
    """An engine the scheduler can ask directly (bypass mode, LMCache's ``engine.lookup``)."""

    def lookup(
        self,
        hashes: list[int],
        offsets: list[int],
        lookup_id: str | None = None,
        pin: bool = False,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Return how many prefix tokens are cached now."""
