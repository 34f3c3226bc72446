"""What a worker needs from a KV-cache engine: the :class:`LookupEngine` protocol.

The contract is LMCache's (``LMCacheEngine.async_lookup_and_prefetch`` and
``cleanup_memory_objs``): the engine sees the caller's plain ``lookup_id`` and
reports the number of prefix tokens it actually loaded through the server's
``send_response_to_scheduler(lookup_id, num_hit_tokens)``. The generation of a
lookup travels beside the id in Redis, never inside it.

Two optional additions let a lookup that misses its deadline be answered with what
is already loaded instead of 0 (``partial_answers``); an engine without them (LMCache's)
behaves as LMCache's does:

* progress: while it loads, the engine may call the server's
  ``send_progress_to_scheduler(lookup_id, num_loaded_tokens)`` (:class:`ProgressSink`)
  with the prefix it holds loaded *and pinned* so far: the part already in memory at
  once, then after each chunk it loads. The final ``send_response_to_scheduler`` call
  is still due, exactly once.
* keeping a prefix: ``keep_memory_objs(lookup_id, num_tokens)`` (:class:`PartialEngine`)
  keeps the first ``num_tokens`` pinned, releases the rest, and stops loading beyond
  them. The server calls it when the lookup was answered ``num_tokens`` at its
  deadline; ``cleanup_memory_objs`` later releases the kept prefix as usual. An engine
  without it keeps everything it loaded until that release.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = [
    "LookupEngine",
    "PartialEngine",
    "ProbeEngine",
    "ProgressSink",
    "ReserveEngine",
    "ResponseSink",
    "SyncLookupEngine",
]


@runtime_checkable
class ResponseSink(Protocol):
    """Where an engine reports a finished prefetch (the lookup server)."""

    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        """Report that ``num_hit_tokens`` prefix tokens of ``lookup_id`` are loaded and pinned."""


@runtime_checkable
class ProgressSink(ResponseSink, Protocol):
    """A sink that also takes progress (the lookup server does): optional for engines."""

    def send_progress_to_scheduler(self, lookup_id: str, num_loaded_tokens: int) -> None:
        """Report that ``num_loaded_tokens`` prefix tokens are loaded and pinned so far."""


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
class PartialEngine(LookupEngine, Protocol):
    """An engine that can keep a prefix of what it loaded (optional: see the module)."""

    def keep_memory_objs(self, lookup_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` of ``lookup_id`` pinned; release and stop the rest."""


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


@runtime_checkable
class ProbeEngine(Protocol):
    """An engine that answers the fleet query: how much of a prefix it holds now.

    Optional. It must load nothing, pin nothing and return quickly (the rank calls it on
    its probe thread, beside the lookups). A rank whose engine lacks it falls back to
    LMCache's ``lookup(hashes=..., offsets=..., pin=False)``; one with neither answers
    ``unsupported``.
    """

    def probe_prefix(
        self,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Return how many prefix tokens are cached now (any tier), touching nothing."""


@runtime_checkable
class ReserveEngine(Protocol):
    """An engine that keeps a prefix for a routed request (the fleet query's ``reserve_ms``).

    Optional. ``reserve_prefix`` pins, for ``owner``, the leading chunks it holds where a
    pin keeps them (the reference engine: its memory tier), loading nothing, and returns
    their tokens; ``cleanup_memory_objs(owner)`` releases them. A rank whose engine lacks
    it falls back to LMCache's ``lookup(..., lookup_id=owner, pin=True)``, released with
    ``lookup_unpin(owner)`` where the engine has it (LMCache's engine adapter implements
    both protocols this way).
    """

    def reserve_prefix(
        self,
        owner: str,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Pin the held prefix for ``owner``; return its tokens."""

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Release what ``lookup_id`` (here: a reservation's owner) pinned."""
