"""The stub engine: a KV-cache engine with no cache, and the reference for engine writers.

What a worker needs from an engine (:class:`broker_lookup.engine.LookupEngine`; the contract
is LMCache's, so LMCache's ``LMCacheEngine`` fits it as it is):

``async_lookup_and_prefetch(lookup_id, hashes, offsets, pin=True, request_configs=None)``
    Called by the server, mostly on its consumer thread, for each lookup this rank must
    answer: return quickly (the rank's next lookups wait behind this call), and report once,
    later from any thread or from inside this call, through the server's
    ``send_response_to_scheduler(lookup_id, num_hit_tokens)``. ``num_hit_tokens`` is the
    prefix actually loaded and pinned, from 0 to ``sum(offsets)`` (``offsets`` are the
    chunks' token counts, ``hashes`` their keys, in prompt order). ``lookup_id`` is the
    caller's plain id: when a new lookup reuses an id, the server releases the old one
    first (``cleanup_memory_objs``), so one id is only ever running once.
``cleanup_memory_objs(lookup_id)``
    Release what the lookup pinned. Called after a cancel, a timeout, a newer lookup of the
    same id, or when the scheduler did not retrieve within the pin TTL; it must be safe for an
    id the engine does not know, and may come from any of the server's threads.
``post_init(async_lookup_server=server)`` (optional)
    How the engine learns where to report. ``RedisAsyncLookupServer`` calls it on
    construction, before it reads anything, as LMCache's manager does for its own server.

What the server does about a faulty engine, so an engine need not: an exception from
``async_lookup_and_prefetch`` is answered with 0 hits; a report outside ``0..sum(offsets)``
is answered with 0; a report for an id that is not running (cancelled, timed out, or
unknown) changes nothing; an engine that never reports is answered 0 at the lookup's
deadline (after a grace) and cleaned up.

:class:`StubEngine` does the least that contract allows, in one of three modes:

* ``instant``: reports inside ``async_lookup_and_prefetch`` (on the consumer thread, as
  the fake engines of LMCache's own tests do): ``min(hits, tokens)`` when ``hits`` is given,
  else the tokens of the first ``fraction`` of the asked chunks. The benchmarks use it, so
  what they measure is the lookup path and not an engine.
* ``manual``: records the lookup and reports only when the test calls :meth:`StubEngine.report`.
* ``mute``: records the lookup and never reports (lookups stay in flight until their deadline).

A real engine with a store, pinning and asynchronous prefetch is ``workers.ReferenceEngine``.
"""

from __future__ import annotations

import threading
from typing import Any, Literal, get_args

from broker_lookup.engine import ResponseSink

__all__ = ["Mode", "StubEngine"]

#: How a :class:`StubEngine` answers a lookup.
Mode = Literal["instant", "manual", "mute"]


class StubEngine:
    """An engine that answers lookups as its ``mode`` says, and records what it was asked.

    Args:
        mode: ``instant``, ``manual`` or ``mute`` (see the module docstring).
        hits: ``instant`` only: report ``min(hits, tokens)``; None: use ``fraction``.
        fraction: ``instant`` only: report the tokens of this leading share of the chunks.
        record: Keep :attr:`started` and :attr:`released`; a benchmark turns it off, since
            the lists grow with every lookup.

    Attributes:
        started: ``(lookup_id, hashes, offsets, request_configs)`` of every lookup started.
        released: Every ``lookup_id`` that ``cleanup_memory_objs`` was called for.
        fail_start: Set it to make ``async_lookup_and_prefetch`` raise (engine failures).
        server: Where reports go; set by :meth:`post_init`.
    """

    def __init__(
        self,
        mode: Mode = "manual",
        *,
        hits: int | None = None,
        fraction: float = 1.0,
        record: bool = True,
    ) -> None:
        if mode not in get_args(Mode):
            raise ValueError(f"StubEngine mode {mode!r}: use one of {get_args(Mode)}")
        if hits is not None and hits < 0:
            raise ValueError(f"StubEngine hits={hits}: must be >= 0")
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"StubEngine fraction={fraction}: must be in [0, 1]")
        self.mode = mode
        self.hits = hits
        self.fraction = fraction
        self.record = record
        self.server: ResponseSink | None = None
        self.started: list[tuple[str, list[int], list[int], dict[str, Any] | None]] = []
        self.released: list[str] = []
        self.fail_start = False
        self._lock = threading.Lock()

    def post_init(self, async_lookup_server: ResponseSink | None = None) -> None:
        """LMCache's wiring: the lookup server hands itself over."""
        self.server = async_lookup_server

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """Record the lookup; in ``instant`` mode, report its hits now."""
        if self.fail_start:
            raise RuntimeError(f"stub engine: fail_start is set (lookup {lookup_id})")
        if self.record:
            with self._lock:
                self.started.append((lookup_id, hashes, offsets, request_configs))
        if self.mode == "instant":
            self.report(lookup_id, self._instant_hits(offsets))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Record the release; nothing is pinned."""
        if self.record:
            with self._lock:
                self.released.append(lookup_id)

    def report(self, lookup_id: str, hits: int) -> None:
        """Report ``hits`` for ``lookup_id`` to the server, as a real engine does when done."""
        if self.server is None:
            raise RuntimeError("stub engine has no server: call post_init(async_lookup_server=)")
        self.server.send_response_to_scheduler(lookup_id, hits)

    def probe_prefix(
        self,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """The fleet query's answer (``ProbeEngine``): what an ``instant`` lookup would report."""
        return self._instant_hits(list(offsets))

    def started_ids(self) -> list[str]:
        """The ids of :attr:`started`, in order (a copy, safe to read while lookups arrive)."""
        with self._lock:
            return [lookup_id for lookup_id, _, _, _ in self.started]

    def _instant_hits(self, offsets: list[int]) -> int:
        if self.hits is not None:
            return min(self.hits, sum(offsets))
        return sum(offsets[: int(len(offsets) * self.fraction)])
