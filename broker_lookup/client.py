"""The scheduler's lookup clients over Redis: async and synchronous.

Hot path: ``lookup_cache`` is a dict read (no I/O, no sleep, no lock);
``lookup`` hashes the tokens and appends to a queue. A sender thread pipelines
the writes and a listener thread turns completion events into table entries.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from broker_lookup._listener import Listener
from broker_lookup._sender import Sender
from broker_lookup._state import Entry, LookupTable
from broker_lookup.config import LookupConfig, LookupMetadata, expected_ranks
from broker_lookup.connection import ConnectionFactory, make_factory
from broker_lookup.errors import InvalidRequest
from broker_lookup.fingerprint import Publisher
from broker_lookup.hashing import ChunkedTokenHasher
from broker_lookup.interface import LookupClientInterface
from broker_lookup.keys import KeySpace
from broker_lookup.messages import LookupRequest, check_lookup_id
from broker_lookup.scripts import ScriptSet

if TYPE_CHECKING:
    import torch

__all__ = ["RedisAsyncLookupClient", "RedisLookupClient"]

logger = logging.getLogger(__name__)

_JSON = msgspec.json.Encoder()


class RedisAsyncLookupClient(LookupClientInterface):
    """LMCache's ``LMCacheAsyncLookupClient`` contract, brokered by Redis.

    >>> client = RedisAsyncLookupClient(config, metadata)    # doctest: +SKIP
    >>> client.lookup(token_ids, "req-1")                     # None: in flight
    >>> client.lookup_cache("req-1")                          # None ... then hit tokens
    """

    def __init__(
        self,
        config: LookupConfig,
        metadata: LookupMetadata,
        *,
        connection_factory: ConnectionFactory | None = None,
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.keys = KeySpace(metadata.engine_id)
        self.expected = expected_ranks(config, metadata)
        self.hasher = ChunkedTokenHasher(config)
        self._timeout_s = config.lookup_timeout_ms / 1000
        self._gens = itertools.count(time.time_ns() // 1000)
        factory = connection_factory or make_factory(config, f"bl-client-{metadata.engine_id}")
        scripts = ScriptSet()
        self._table = LookupTable(
            self._cancel_gen, config.max_pending, config.result_retention_ms / 1000
        )
        self._sender = Sender(config, self.keys, self._table, factory, scripts)
        #: Publishes our hashing fingerprint and lists processes that hash differently.
        self.fingerprint = Publisher(self.keys, "client", self.hasher)
        self._listener = Listener(
            config, self.keys, self._table, factory, self.expected, self.fingerprint.tick
        )
        self._closed = False
        self._sender.start(",".join(map(str, self.expected)))
        probe = factory()
        try:
            self._listener.start(probe)
            self.fingerprint.run(probe)
        finally:
            probe.close()

    # -- hot path -------------------------------------------------------------------

    def lookup_cache(self, lookup_id: str) -> int | None:
        """-1 unknown, None in flight, else hit tokens (0 after a timeout, until cleared)."""
        entry = self._table.entries.get(lookup_id)
        if entry is None:
            return -1
        result = entry.result
        if result is not None:
            return result
        if time.monotonic() >= entry.deadline:
            return self._table.expire(lookup_id, entry)
        return None

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        """Start a lookup; None while in flight, or an int when answered without Redis."""
        entry = self._start(token_ids, lookup_id, request_configs, with_event=False)
        return entry if isinstance(entry, int) else None

    def _start(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
        with_event: bool,
    ) -> Entry | int:
        hashes, offsets = self._hash_checked(token_ids, lookup_id, request_configs)
        if not hashes:
            return 0  # shorter than one chunk: nothing to ask (LMCache D17)
        now = time.monotonic()
        tokens = sum(offsets)
        entry = Entry(
            next(self._gens), now, now + self._timeout_s, tokens, self.expected, with_event
        )
        if self._listener.dead.intersection(self.expected):
            self._table.add(lookup_id, entry, finished="dead_rank")
            return 0
        if not self._table.add(lookup_id, entry):
            logger.warning(
                "max_pending=%d lookups tracked; %s answers 0", self.config.max_pending, lookup_id
            )
            return 0
        deadline_ms = int(time.time() * 1000) + self.config.lookup_timeout_ms
        request = LookupRequest(
            lookup_id=lookup_id,
            gen=entry.gen,
            hashes=hashes,
            offsets=offsets,
            expected=list(self.expected),
            deadline_ms=deadline_ms,
            request_configs=request_configs,
            tokens=tokens,
        )
        self._sender.submit(lookup_id, entry, request)
        return entry

    def _hash_checked(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> tuple[list[int], list[int]]:
        """Hashes and offsets of a valid request; InvalidRequest naming the limit otherwise."""
        reason = check_lookup_id(lookup_id, self.config.max_lookup_id_length)
        if reason:
            raise InvalidRequest(reason)
        self._check_configs(request_configs)
        hashes, offsets = self.hasher.hashes_and_offsets(token_ids)
        if len(hashes) > self.config.max_chunks_per_request:
            raise InvalidRequest(
                f"{len(hashes)} chunks exceed max_chunks_per_request="
                f"{self.config.max_chunks_per_request}"
            )
        return hashes, offsets

    def _check_configs(self, request_configs: dict[str, Any] | None) -> None:
        if request_configs is None:
            return
        if not isinstance(request_configs, dict) or not all(
            isinstance(k, str) for k in request_configs
        ):
            raise InvalidRequest("request_configs must be a dict with str keys")
        try:
            size = len(_JSON.encode(request_configs))
        except (TypeError, msgspec.EncodeError) as exc:
            raise InvalidRequest(f"request_configs must be JSON-serialisable: {exc}") from None
        if size > self.config.max_request_configs_bytes:
            raise InvalidRequest(
                f"request_configs is {size} bytes, over "
                f"max_request_configs_bytes={self.config.max_request_configs_bytes}"
            )

    # -- lifecycle of one id ----------------------------------------------------------

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget the result; a lookup still in flight is cancelled so ranks release it."""
        self._table.pop(lookup_id, None)

    def cancel_lookup(self, lookup_id: str) -> None:
        """Abort: delete the lookup's key and tell every rank to release its memory."""
        self._table.pop(lookup_id, "cancelled")

    def _cancel_gen(self, lookup_id: str, gen: int) -> None:
        self._sender.cancel(lookup_id, gen)

    def supports_producer_reuse(self) -> bool:
        """True, as LMCache's async client."""
        return True

    # -- observability and shutdown ---------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and tests; cheap, takes no lock."""
        t = self._table
        return {
            "outcomes": dict(t.counts),
            "hit_tokens": t.hit_tokens,
            "inflight": len(t.inflight),
            "entries": len(t.entries),
            "queued": self._sender.queued,
            "stale_events": t.stale_events,
            "redis_errors": self._sender.errors + self._listener.errors,
            "unexpected_errors": self._sender.guard.count + self._listener.guard.count,
            "dead_ranks": sorted(self._listener.dead),
            "latency_counts": list(t.latency_counts),
            "latency_sum": t.latency_sum,
        }

    def close(self) -> None:
        """Cancel what is in flight, flush the queue, stop both threads (bounded)."""
        if self._closed:
            return
        self._closed = True
        for lookup_id, entry in self._table.drain_inflight():
            self._sender.cancel(lookup_id, entry.gen)
        grace = self.config.block_ms / 1000 + 2.0
        ok = self._sender.stop(grace) & self._listener.stop(grace)
        if not ok:
            logger.error("lookup client threads did not stop within %.1fs", grace)

    def __enter__(self) -> RedisAsyncLookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisLookupClient(RedisAsyncLookupClient):
    """Synchronous variant: ``lookup`` waits (at most ``lookup_timeout_ms``) and returns the int."""

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """Hit tokens on every expected rank (min), or 0 on timeout, miss or error."""
        entry = self._start(token_ids, lookup_id, request_configs, with_event=True)
        if isinstance(entry, int):
            return entry
        assert entry.event is not None  # created with_event=True above
        entry.event.wait(max(0.0, entry.deadline - time.monotonic()))
        if entry.result is None:
            return self._table.expire(lookup_id, entry)
        return entry.result

    def lookup_cache(self, lookup_id: str) -> int | None:
        """-1 unknown, else the result (the sync client never reports 'in flight')."""
        result = super().lookup_cache(lookup_id)
        return -1 if result is None else result

    def supports_producer_reuse(self) -> bool:
        """False, as LMCache's sync client."""
        return False
