"""``LookupClientFactory``: LMCache's decision table, over our clients and servers.

``create_lookup_client`` rows, evaluated in order (LMCache 0.5.6's factory, whose table this is):

1. ``external_lookup_client`` and ``enable_async_loading``   -> ConfigError
2. ``external_lookup_client = <scheme>://<address>``       -> the registered builder
3. ``enable_scheduler_bypass_lookup`` and an engine given  -> :class:`BypassLookupClient`
4. ``enable_async_loading``                                -> :class:`RedisAsyncLookupClient`
5. otherwise                                               -> :class:`RedisLookupClient`

then :class:`HitLimitLookupClient` if ``hit_miss_ratio`` is set, then
:class:`ChunkStatisticsLookupClient` if ``enable_chunk_statistics``.

``create_lookup_server`` returns None on ranks that should not serve (an external
client is configured, or the rank is not in ``lookup_server_worker_ids``). The
server class comes from the ``broker_lookup.servers`` entry point, so this
package never imports ``workers``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from broker_lookup.client import RedisAsyncLookupClient, RedisLookupClient
from broker_lookup.client.bypass import BypassLookupClient
from broker_lookup.client.wrappers import (
    ChunkStatisticsLookupClient,
    HitLimitLookupClient,
)
from broker_lookup.config import LookupConfig, LookupMetadata, expected_ranks
from broker_lookup.errors import ConfigError, UnknownScheme
from broker_lookup.interface import LookupClientInterface

__all__ = ["LookupClientFactory", "SchemeBuilder"]

logger = logging.getLogger(__name__)

#: Builds a client for ``<scheme>://<address>``: called with (address, config, metadata).
SchemeBuilder = Callable[[str, LookupConfig, LookupMetadata], LookupClientInterface]

_SCHEMES: dict[str, SchemeBuilder] = {}


def _split_uri(uri: str) -> tuple[str, str]:
    scheme, sep, address = uri.partition("://")
    if not sep or not scheme or not address:
        raise UnknownScheme(
            f"external_lookup_client={uri!r} is not '<scheme>://<address>'; "
            f"registered schemes: {_supported()}"
        )
    return scheme, address


def _supported() -> str:
    return ", ".join(sorted(_SCHEMES)) or "none (register one with register_scheme)"


class LookupClientFactory:
    """Creates the scheduler's client and each rank's server from config."""

    @staticmethod
    def register_scheme(scheme: str, builder: SchemeBuilder) -> None:
        """Make ``external_lookup_client = "<scheme>://..."`` build clients with ``builder``."""
        if not scheme.isidentifier():
            raise ValueError(f"scheme {scheme!r} must be a plain identifier")
        _SCHEMES[scheme] = builder

    @staticmethod
    def unregister_scheme(scheme: str) -> None:
        """Remove a registered scheme (no-op if unknown)."""
        _SCHEMES.pop(scheme, None)

    @staticmethod
    def create_lookup_client(
        config: LookupConfig, metadata: LookupMetadata, engine: Any = None, **kwargs: Any
    ) -> LookupClientInterface:
        """The client LMCache's table picks, wrapped as configured."""
        client = LookupClientFactory._base_client(config, metadata, engine, **kwargs)
        if config.hit_miss_ratio is not None:
            client = HitLimitLookupClient(client, config)
        if config.enable_chunk_statistics:
            client = ChunkStatisticsLookupClient(client, config, metadata)
        return client

    @staticmethod
    def _base_client(
        config: LookupConfig, metadata: LookupMetadata, engine: Any, **kwargs: Any
    ) -> LookupClientInterface:
        if config.external_lookup_client:
            if config.enable_async_loading:
                raise ConfigError(
                    "enable_async_loading is not supported with external_lookup_client="
                    f"{config.external_lookup_client!r}"
                )
            scheme, address = _split_uri(config.external_lookup_client)
            builder = _SCHEMES.get(scheme)
            if builder is None:
                raise UnknownScheme(
                    f"external_lookup_client scheme {scheme!r} is not registered; "
                    f"registered schemes: {_supported()}"
                )
            return builder(address, config, metadata)
        if config.enable_scheduler_bypass_lookup and engine is not None:
            return BypassLookupClient(config, metadata, engine)
        if config.enable_async_loading:
            return RedisAsyncLookupClient(config, metadata, **kwargs)
        return RedisLookupClient(config, metadata, **kwargs)

    @staticmethod
    def create_lookup_server(
        engine: Any, metadata: LookupMetadata, config: LookupConfig | None = None, **kwargs: Any
    ) -> Any:
        """This rank's ``RedisAsyncLookupServer``, or None if it should not serve."""
        config = config if config is not None else LookupConfig.load()
        if config.external_lookup_client:
            return None
        if metadata.worker_id not in expected_ranks(config, metadata):
            logger.info(
                "rank %d is not in lookup_server_worker_ids; no lookup server", metadata.worker_id
            )
            return None
        return _server_class()(engine, metadata, config, **kwargs)


def _server_class() -> Any:
    found = entry_points(group="broker_lookup.servers", name="redis")
    for ep in found:
        return ep.load()
    raise ConfigError(
        "no lookup server is installed (entry point broker_lookup.servers:redis); "
        "install the broker-lookup package with its workers"
    )
