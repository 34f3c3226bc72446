"""``LookupClientInterface``: LMCache's scheduler-side contract, plus ``cancel_lookup``.

Values returned by ``lookup_cache`` / ``lookup`` mean exactly what they mean to
vLLM's LMCache adapter:

=========  ==========================================================
``-1``     no result for this id: call ``lookup()`` now
``None``   still in flight: ask again next scheduler step
``0``      miss, timeout or error: recompute everything
``n > 0``  ``n`` prefix tokens are cached and prefetched on every rank
=========  ==========================================================
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["LookupClientInterface"]


class LookupClientInterface(metaclass=abc.ABCMeta):
    """What the vLLM scheduler calls; every lookup client here implements it."""

    def lookup_cache(self, lookup_id: str) -> int | None:
        """Result of an earlier ``lookup``: -1 unknown, None in flight, else hit tokens."""
        return -1

    @abc.abstractmethod
    def lookup(
        self,
        token_ids: list[int] | torch.Tensor,
        lookup_id: str,
        request_configs: dict[str, Any] | None = None,
    ) -> int | None:
        """Start (async) or perform (sync) a lookup of ``token_ids`` under ``lookup_id``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and connections; idempotent."""

    def supports_producer_reuse(self) -> bool:
        """Whether producer KV reuse is supported (LMCache's flag)."""
        return False

    def clear_lookup_status(self, lookup_id: str) -> None:
        """Forget the result of ``lookup_id`` (the scheduler allocated its blocks)."""
        return None

    def cancel_lookup(self, lookup_id: str) -> None:
        """The request was aborted: release what its lookup holds. No-op by default."""
        return None
