"""The bypass client: the scheduler asks its own engine, with no Redis round trip.

Its contract path never raises into the scheduler either: a request is admitted as
the Redis client admits it, and everything that could raise runs through the same
:class:`~broker_lookup.client.guard.Guard`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from broker_lookup.client.admission import Admission, Rejected
from broker_lookup.client.guard import Guard
from broker_lookup.client.wrappers import BoundedMap
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.engine import SyncLookupEngine
from broker_lookup.interface import LookupClientInterface
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.stats import ClientStats

if TYPE_CHECKING:
    import torch

__all__ = ["BypassLookupClient"]


class BypassLookupClient(LookupClientInterface):
    """The scheduler asks its own engine (shared remote backend, MLA); no Redis round trip.

    Unlike LMCache's bypass client it answers ``lookup_cache`` correctly (-1 or the
    cached int), so the scheduler does not wait forever (LMCache D1). A request is
    admitted as the Redis client admits it (the same limits, answered 0 and counted
    when broken); an engine that raises, or answers outside ``0..tokens``, is answered
    0, counted as ``engine_error`` and asked to release what it pinned.
    """

    def __init__(
        self, config: LookupConfig, metadata: LookupMetadata, engine: SyncLookupEngine
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.engine = engine
        self._hasher = ChunkedTokenHasher(config)
        self._guard = Guard()
        self._admission = Admission(config, self._hasher, self._guard)
        self._results = BoundedMap(config.max_pending)

    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        return self._guard.call(
            "internal_error", lookup_id, 0, self._lookup, token_ids, lookup_id, request_configs
        )

    def _lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None,
    ) -> int:
        admitted = self._admission.admit(token_ids, lookup_id, request_configs)
        hits = 0
        if not isinstance(admitted, Rejected) and admitted[0]:  # shorter than a chunk: 0
            hits = self._guard.call(
                "engine_error", lookup_id, -1, self._ask, lookup_id, *admitted, request_configs
            )
            if hits < 0:  # the engine failed: it may hold pins nobody will retrieve
                self._release(lookup_id)
                hits = 0
        if isinstance(lookup_id, str):
            self._results.put(lookup_id, hits)
        return hits

    def _ask(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None,
    ) -> int:
        hits = int(
            self.engine.lookup(
                hashes, offsets, lookup_id=lookup_id, pin=True, request_configs=request_configs
            )
        )
        if not 0 <= hits <= sum(offsets):
            raise ValueError(f"engine answered {hits} hit tokens for {sum(offsets)} tokens")
        return hits

    def lookup_cache(self, lookup_id: str) -> int:
        return self._guard.call("bad_id", lookup_id, -1, self._cached, lookup_id)

    def _cached(self, lookup_id: str) -> int:
        return self._results.get(lookup_id, -1)

    def clear_lookup_status(self, lookup_id: str) -> None:
        self._guard.call("bad_clear", lookup_id, None, self._forget, lookup_id)

    def _forget(self, lookup_id: str) -> None:
        self._results.pop(lookup_id, None)

    def cancel_lookup(self, lookup_id: str) -> None:
        self._guard.call("bad_cancel", lookup_id, None, self._cancel, lookup_id)

    def _cancel(self, lookup_id: str) -> None:
        self._results.pop(lookup_id, None)
        if isinstance(lookup_id, str):  # any other id never reached the engine
            self._release(lookup_id)

    def _release(self, lookup_id: str) -> None:
        release = getattr(self.engine, "cleanup_memory_objs", None)
        if callable(release):
            self._guard.call("engine_error", lookup_id, None, release, lookup_id)

    def stats(self) -> ClientStats:
        """What was answered without the engine (``rejected``, by kind), and the map's size
        (``entries``); no Redis, so the rest stays at zero."""
        return ClientStats(
            rejected=dict(self._guard.counts),
            truncated=self._admission.truncated,
            entries=len(self._results),
        )

    def close(self) -> None:
        self._results.clear()
