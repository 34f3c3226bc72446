"""Fixtures of the LMCache integration tests: LMCache's classes, a patched factory, an engine.

Every test here needs ``lmcache==0.5.6`` (``../shared/tools/install-lmcache-cpu``). Without
it they skip locally and fail under ``CI``, which must run them.
"""

from __future__ import annotations

import importlib.metadata
import os
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

LMCACHE_VERSION = "0.5.6"


@pytest.fixture(scope="session")
def lmc() -> SimpleNamespace:
    """LMCache's config, metadata, engine builder and lookup classes, or skip (fail in CI)."""
    try:
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventStatus, EventType
        from lmcache.v1.lookup_client import abstract_client
        from lmcache.v1.lookup_client import lmcache_async_lookup_client as async_mod
        from lmcache.v1.lookup_client import lmcache_lookup_client as sync_mod
        from lmcache.v1.lookup_client.factory import LookupClientFactory
        from lmcache.v1.metadata import LMCacheMetadata

        version = importlib.metadata.version("lmcache")
    except ImportError as exc:
        reason = f"lmcache {LMCACHE_VERSION} is not importable: {exc}"
    else:
        if version == LMCACHE_VERSION:
            return SimpleNamespace(
                torch=torch,
                Config=LMCacheEngineConfig,
                Metadata=LMCacheMetadata,
                Builder=LMCacheEngineBuilder,
                Factory=LookupClientFactory,
                Manager=_manager_class(),
                Interface=abstract_client.LookupClientInterface,
                AsyncClient=async_mod.LMCacheAsyncLookupClient,
                AsyncServer=async_mod.LMCacheAsyncLookupServer,
                SyncClient=sync_mod.LMCacheLookupClient,
                SyncServer=sync_mod.LMCacheLookupServer,
                EventType=EventType,
                EventStatus=EventStatus,
            )
        reason = f"lmcache {version} is installed; these tests are for {LMCACHE_VERSION}"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the LMCache integration tests)", pytrace=False)
    pytest.skip(f"{reason}; install it with ../shared/tools/install-lmcache-cpu")


def _manager_class() -> type | None:
    """LMCache's ``LMCacheManager``, or None: its module imports fastapi, which the CPU
    install (install-lmcache-cpu) does not provide."""
    try:
        from lmcache.v1.manager import LMCacheManager
    except ImportError:
        return None
    manager: type = LMCacheManager
    return manager


@pytest.fixture
def installed(lmc: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Our patch installed in LMCache's factory for one test; the env switch unset."""
    from broker_lookup.integrations import lmcache as integration

    for name in ("BROKER_LOOKUP_LMCACHE", "BROKER_LOOKUP_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    integration.install()
    try:
        yield integration
    finally:
        integration.uninstall()


@pytest.fixture
def make_metadata(lmc: SimpleNamespace, engine_id: str) -> Callable[..., Any]:
    """LMCache metadata for this test's engine id; ``worker_id`` and more by keyword."""

    def make(**overrides: Any) -> Any:
        values: dict[str, Any] = {
            "model_name": "test-model",
            "world_size": 1,
            "local_world_size": 1,
            "worker_id": 0,
            "local_worker_id": 0,
            "kv_dtype": lmc.torch.float16,
            "kv_shape": (2, 2, 16, 2, 4),
            "chunk_size": 16,
            "engine_id": engine_id,
        }
        values.update(overrides)
        return lmc.Metadata(**values)

    return make


@pytest.fixture
def make_engine(lmc: SimpleNamespace) -> Iterator[Callable[..., Any]]:
    """A real ``LMCacheEngine`` on CPU (local CPU backend, no GPU connector)."""
    built: list[str] = []

    def make(config: Any, metadata: Any) -> Any:
        instance_id = "bl-test-" + uuid.uuid4().hex[:8]
        built.append(instance_id)
        return lmc.Builder.get_or_create(
            instance_id, config, metadata, None, lambda t, r: None, lambda o, r: o
        )

    yield make
    for instance_id in built:
        lmc.Builder.destroy(instance_id)
