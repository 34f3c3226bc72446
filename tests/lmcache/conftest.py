"""Fixtures of the LMCache integration tests: LMCache's classes, a patched factory, an engine.

Every test here needs a tested LMCache (0.5.6 in the project's virtualenv, 0.5.7rc2 in the
CI leg's own; ``../shared/tools/install-lmcache-cpu``, ``LMCACHE_VERSION`` picks one). The
modules come from the installed version's layout (``lmcache_layout``), so one test runs on
either. Without a tested LMCache they skip locally and fail under ``CI``, which must run
them; ``BROKER_LOOKUP_TEST_LMCACHE=<version>`` fails them on any other version.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from broker_lookup.integrations.lmcache_layout import (
    TESTED_VERSIONS,
    Layout,
    expected,
    find_layout,
)


def _tested_lmcache() -> tuple[Layout, str]:
    """The installed LMCache's layout and version, or skip (fail under ``CI``)."""
    import importlib.metadata

    layout = find_layout()
    try:
        version = importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError:
        reason = "lmcache is not installed"
    else:
        wanted = os.environ.get("BROKER_LOOKUP_TEST_LMCACHE")
        if wanted and version != wanted:  # a CI leg for one release must run that release
            pytest.fail(f"lmcache {version} is installed; this run is for {wanted}")
        if layout is not None and version in layout.versions:
            return layout, version
        reason = (
            f"lmcache {version} is installed, with its lookup factory "
            f"{'at ' + str(layout) if layout else 'at none of ' + expected()}; "
            f"these tests are for LMCache {', '.join(TESTED_VERSIONS)}"
        )
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the LMCache integration tests)", pytrace=False)
    pytest.skip(f"{reason}; install one with ../shared/tools/install-lmcache-cpu")


@pytest.fixture(scope="session")
def lmc() -> SimpleNamespace:
    """LMCache's config, metadata, engine builder and lookup classes, or skip (fail in CI)."""
    layout, version = _tested_lmcache()

    def mod(relative: str) -> Any:
        return importlib.import_module(layout.module(relative))

    import torch
    from lmcache.v1.config import LMCacheEngineConfig  # the same module in every layout
    from lmcache.v1.metadata import LMCacheMetadata

    events = mod("v1.event_manager")
    engine = mod("v1.cache_engine")
    async_mod = mod("v1.lookup_client.lmcache_async_lookup_client")
    sync_mod = mod("v1.lookup_client.lmcache_lookup_client")
    return SimpleNamespace(
        layout=layout,
        version=version,
        torch=torch,
        Config=LMCacheEngineConfig,
        Metadata=LMCacheMetadata,
        Engine=engine.LMCacheEngine,
        Builder=engine.LMCacheEngineBuilder,
        Factory=mod("v1.lookup_client.factory").LookupClientFactory,
        Manager=_manager_class(layout),
        Interface=mod("v1.lookup_client.abstract_client").LookupClientInterface,
        AsyncClient=async_mod.LMCacheAsyncLookupClient,
        AsyncServer=async_mod.LMCacheAsyncLookupServer,
        SyncClient=sync_mod.LMCacheLookupClient,
        SyncServer=sync_mod.LMCacheLookupServer,
        EventType=events.EventType,
        EventStatus=events.EventStatus,
    )


def _manager_class(layout: Layout) -> type | None:
    """LMCache's ``LMCacheManager``, or None: its module imports fastapi, which the CPU
    install (install-lmcache-cpu) does not provide."""
    try:
        manager: type = importlib.import_module(layout.module("v1.manager")).LMCacheManager
    except ImportError:
        return None
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
