"""``LMCacheEngineAdapter``: a real LMCache 0.5.6 ``LMCacheEngine`` behind our engine protocols.

Our worker server calls ``engine.async_lookup_and_prefetch(lookup_id, hashes, offsets,
pin, request_configs)`` positionally (:class:`~broker_lookup.engine.LookupEngine`), and
the bypass client calls ``engine.lookup(hashes, offsets, lookup_id=..., ...)``
(:class:`~broker_lookup.engine.SyncLookupEngine`). LMCache's methods take ``tokens``
first, so the adapter passes everything by keyword.

Wiring. LMCache's ``StorageManager`` reports a finished prefetch to
``storage_manager.async_lookup_server``, which ``LMCacheManager.post_init`` hands to
``LMCacheEngine.post_init(async_lookup_server=...)`` once the KV caches are registered.
Our server calls ``engine.post_init(async_lookup_server=self)`` at construction, which
is *before* that point, so :meth:`LMCacheEngineAdapter.post_init` must not run
``LMCacheEngine.post_init`` (it would build the storage manager early, and the
manager's own call would then be a no-op). It only remembers the server, and before
each lookup points ``storage_manager.async_lookup_server`` at it when it is unset (sync
mode: the manager passes None) or is another object (a recreated server, LMCache D15).

Modes. With ``enable_async_loading`` the adapter starts LMCache's prefetch and its
storage manager reports when the data is loaded. Without it LMCache's storage manager
cannot prefetch (it has no load serializer then), so the adapter does what LMCache's
synchronous ``LMCacheLookupServer`` does: ``engine.lookup(..., pin=True)`` and an
immediate report of the pinned prefix; ``lookup_unpin`` releases it.
"""

from __future__ import annotations

import logging
from typing import Any

from broker_lookup.engine import ResponseSink

__all__ = ["LMCacheEngineAdapter"]

logger = logging.getLogger(__name__)


class LMCacheEngineAdapter:
    """Puts ``engine`` (an ``LMCacheEngine``) behind ``LookupEngine`` and ``SyncLookupEngine``.

    >>> adapter = LMCacheEngineAdapter(lmcache_engine)           # doctest: +SKIP
    >>> server = RedisAsyncLookupServer(adapter, metadata, cfg)  # doctest: +SKIP
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.server: ResponseSink | None = None

    @property
    def config(self) -> Any:
        """The engine's LMCache config (LMCache's factory reads ``engine.config``)."""
        return self.engine.config

    def post_init(self, async_lookup_server: ResponseSink | None = None) -> None:
        """Remember the server; never run ``LMCacheEngine.post_init`` (LMCache's manager does)."""
        self.server = async_lookup_server
        self._wire()

    def _wire(self) -> None:
        manager = getattr(self.engine, "storage_manager", None)
        server = self.server
        if manager is None or server is None:
            return
        if getattr(manager, "async_lookup_server", None) is not server:
            logger.info("pointing LMCache's storage manager at the broker lookup server")
            manager.async_lookup_server = server

    @property
    def async_loading(self) -> bool:
        """Whether the engine prefetches (LMCache's ``enable_async_loading``)."""
        mode = getattr(self.engine, "async_loading", None)
        if mode is None:
            mode = getattr(getattr(self.engine, "config", None), "enable_async_loading", True)
        return bool(mode)

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """LMCache's prefetch (its storage manager reports later), or a sync lookup + report.

        Raises:
            RuntimeError: the engine has no storage manager yet (``post_init`` has not
                run; LMCache asserts there and the scheduler waits for its timeout, D25),
                or sync mode has no server to report to. Our server answers 0 at once.
        """
        if getattr(self.engine, "storage_manager", None) is None:
            raise RuntimeError(
                "LMCacheEngine has no storage manager yet (post_init has not run); "
                f"lookup {lookup_id} answers 0"
            )
        if not self.async_loading:
            if self.server is None:
                raise RuntimeError("no lookup server to report to: call post_init first")
            hits = self.lookup(hashes, offsets, lookup_id, pin, request_configs)
            self.server.send_response_to_scheduler(lookup_id, hits)
            return
        self._wire()
        self.engine.async_lookup_and_prefetch(
            lookup_id,
            hashes=hashes,
            offsets=offsets,
            pin=pin,
            request_configs=request_configs,
        )

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Release what the lookup holds, via LMCache's ``lookup_unpin`` when it has one.

        ``lookup_unpin`` releases a synchronous lookup's pins (bypass) and otherwise
        calls ``cleanup_memory_objs``, which frees a finished prefetch.
        """
        release = getattr(self.engine, "lookup_unpin", None)
        if callable(release):
            release(lookup_id)
        else:
            self.engine.cleanup_memory_objs(lookup_id)

    def lookup(
        self,
        hashes: list[int],
        offsets: list[int],
        lookup_id: str | None = None,
        pin: bool = False,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """LMCache's synchronous ``lookup`` (the bypass client's path): hit tokens now."""
        return int(
            self.engine.lookup(
                hashes=hashes,
                offsets=offsets,
                lookup_id=lookup_id,
                pin=pin,
                request_configs=request_configs,
            )
        )

    def probe_prefix(
        self,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """The fleet query's lookup (``ProbeEngine``): LMCache's ``lookup`` without a pin,
        which asks its storage backends what they contain and loads nothing."""
        return self.lookup(hashes, offsets, pin=False, request_configs=request_configs)

    def reserve_prefix(
        self,
        owner: str,
        hashes: list[int],
        offsets: list[int],
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        """A reservation (``ReserveEngine``): LMCache's ``lookup`` pinning for ``owner``,
        as its synchronous lookup server pins; :meth:`cleanup_memory_objs` releases it
        (``lookup_unpin``)."""
        return self.lookup(
            hashes, offsets, lookup_id=owner, pin=True, request_configs=request_configs
        )
