"""The patch of LMCache's LookupClientFactory: our classes when asked, LMCache's otherwise."""

from __future__ import annotations

import importlib
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import Made

from broker_lookup import (
    BypassLookupClient,
    ChunkStatisticsLookupClient,
    HitLimitLookupClient,
    RedisAsyncLookupClient,
    RedisLookupClient,
)
from broker_lookup.integrations import lmcache as integration
from broker_lookup.integrations.lmcache_adapter import LMCacheEngineAdapter
from broker_lookup.integrations.lmcache_layout import FACTORY
from workers import RedisAsyncLookupServer

pytestmark = pytest.mark.lmcache

URL = {"lookup_broker_url": "redis://unused.invalid:6379/0", "lookup_broker_block_ms": 50}
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def lmc_config(lmc: SimpleNamespace, **settings: Any) -> Any:
    return lmc.Config.from_defaults(chunk_size=16, **settings)


def client_for(lmc: SimpleNamespace, made: Made, config: Any, meta: Any, **kw: Any) -> Any:
    return made.keep(lmc.Factory.create_lookup_client(config, meta, None, **kw))


# -- our classes when the broker is asked for ------------------------------------------------


@pytest.mark.parametrize(
    ("async_loading", "expected"), [(True, RedisAsyncLookupClient), (False, RedisLookupClient)]
)
def test_broker_config_gets_our_client(
    lmc: SimpleNamespace,
    installed: Any,
    fake: Any,
    made: Made,
    make_metadata: Any,
    async_loading: bool,
    expected: type,
) -> None:
    config = lmc_config(lmc, enable_async_loading=async_loading, extra_config=URL)
    client = client_for(lmc, made, config, make_metadata(), connection_factory=fake)
    assert type(client) is expected
    assert isinstance(client, lmc.Interface)  # our interface is registered with LMCache's ABC
    assert client.config.chunk_size == 16 and client.metadata.engine_id == make_metadata().engine_id


def test_broker_config_gets_our_server_on_the_listed_ranks(
    lmc: SimpleNamespace, installed: Any, fake: Any, made: Made, make_metadata: Any
) -> None:
    config = lmc_config(
        lmc, enable_async_loading=True, extra_config=URL, lookup_server_worker_ids=[1]
    )
    engine = SimpleNamespace(config=config)
    rank0 = make_metadata(world_size=2, worker_id=0)
    assert lmc.Factory.create_lookup_server(engine, rank0, connection_factory=fake) is None
    rank1 = make_metadata(world_size=2, worker_id=1)
    server = lmc.Factory.create_lookup_server(engine, rank1, connection_factory=fake)
    made.keep(server)
    assert isinstance(server, RedisAsyncLookupServer) and isinstance(server, lmc.AsyncServer)
    assert type(server).__name__ == "LMCacheBrokerLookupServer" and server.rank == 1
    assert isinstance(server.engine, LMCacheEngineAdapter) and server.engine.engine is engine
    assert server.engine.server is server  # our server's post_init reached the adapter only


def test_env_switch_asks_for_the_broker(
    lmc: SimpleNamespace,
    installed: Any,
    fake: Any,
    made: Made,
    make_metadata: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = lmc_config(lmc, enable_async_loading=True)
    assert not integration.broker_requested(config)
    monkeypatch.setenv("BROKER_LOOKUP_LMCACHE", "1")
    assert not integration.broker_requested(config)  # no URL anywhere
    monkeypatch.setenv("BROKER_LOOKUP_REDIS_URL", "redis://cache:6379/0")
    assert integration.broker_requested(config)
    client = client_for(lmc, made, config, make_metadata(), connection_factory=fake)
    assert type(client) is RedisAsyncLookupClient
    assert client.config.redis_url == "redis://cache:6379/0"


def test_external_lookup_client_is_dropped_for_the_broker(
    lmc: SimpleNamespace, installed: Any, fake: Any, made: Made, make_metadata: Any
) -> None:
    config = lmc_config(lmc, external_lookup_client="mooncakestore://m:1", extra_config=URL)
    client = client_for(lmc, made, config, make_metadata(), connection_factory=fake)
    assert type(client) is RedisLookupClient and client.config.external_lookup_client is None


def test_wrappers_and_bypass_through_lmcache_factory(
    lmc: SimpleNamespace, installed: Any, fake: Any, made: Made, make_metadata: Any
) -> None:
    config = lmc_config(
        lmc,
        enable_async_loading=True,
        hit_miss_ratio=0.5,
        enable_chunk_statistics=True,
        extra_config=URL,
    )
    client = client_for(lmc, made, config, make_metadata(), connection_factory=fake)
    assert type(client) is ChunkStatisticsLookupClient
    assert type(client.inner) is HitLimitLookupClient
    assert type(client.inner.inner) is RedisAsyncLookupClient
    bypass = lmc_config(lmc, enable_scheduler_bypass_lookup=True, extra_config=URL)
    engine = SimpleNamespace(config=bypass)
    client = lmc.Factory.create_lookup_client(bypass, make_metadata(), engine)
    made.keep(client)
    assert type(client) is BypassLookupClient
    assert isinstance(client.engine, LMCacheEngineAdapter) and client.engine.engine is engine


# -- LMCache's own classes otherwise, and uninstall -----------------------------------------------


def test_other_configs_get_lmcache_own_classes(
    lmc: SimpleNamespace, installed: Any, made: Made, make_metadata: Any
) -> None:
    config = lmc_config(lmc)  # sync: LMCache's REQ/ROUTER classes close cleanly
    meta = make_metadata()
    client = client_for(lmc, made, config, meta)
    server = lmc.Factory.create_lookup_server(SimpleNamespace(config=config), meta)
    made.keep(server)
    assert type(client) is lmc.SyncClient and type(server) is lmc.SyncServer


def test_other_async_configs_go_to_lmcache_own_functions(
    lmc: SimpleNamespace, installed: Any, make_metadata: Any
) -> None:
    # LMCache's async client and server can abort the process when closed (their close
    # shuts sockets a thread is blocked on, D22), so the originals are observed instead.
    calls: list[tuple[str, tuple[Any, ...]]] = []
    saved = dict(installed._originals)
    for name, original in saved.items():
        assert original.__module__ == lmc.layout.module(FACTORY)

        def record(*args: Any, _name: str = name) -> str:
            calls.append((_name, args))
            return "lmcache's own"

        installed._originals[name] = record
    try:
        config = lmc_config(lmc, enable_async_loading=True)
        meta, engine = make_metadata(), SimpleNamespace(config=config)
        assert lmc.Factory.create_lookup_client(config, meta, None) == "lmcache's own"
        assert lmc.Factory.create_lookup_server(engine, meta) == "lmcache's own"
    finally:
        installed._originals.update(saved)
    assert calls == [
        ("create_lookup_client", (config, meta, None)),
        ("create_lookup_server", (engine, meta)),
    ]


def test_install_is_idempotent_and_uninstall_restores(lmc: SimpleNamespace) -> None:
    original_client = lmc.Factory.__dict__["create_lookup_client"].__func__
    original_server = lmc.Factory.__dict__["create_lookup_server"].__func__
    try:
        assert integration.install() is True
        assert integration.install() is False and integration.is_installed()
        assert integration.install(force=True) is True
        patched = lmc.Factory.__dict__["create_lookup_client"].__func__
        assert patched is not original_client
    finally:
        assert integration.uninstall() is True
    assert not integration.is_installed() and integration.uninstall() is False
    assert lmc.Factory.__dict__["create_lookup_client"].__func__ is original_client
    assert lmc.Factory.__dict__["create_lookup_server"].__func__ is original_server
    broker = lmc_config(lmc, extra_config=URL)
    assert integration.broker_requested(broker)  # asked for, but LMCache's table decides now
    assert lmc.Factory.create_lookup_client.__module__.startswith("lmcache.")


# -- vLLM plugin ---------------------------------------------------------------------------------


def test_vllm_plugin_entry_point_is_declared() -> None:
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"]
    target = declared["vllm.general_plugins"]["broker_lookup"]
    assert target == "broker_lookup.integrations.lmcache:vllm_plugin"
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is integration.vllm_plugin
    installed_eps = entry_points(group="vllm.general_plugins", name="broker_lookup")
    for ep in installed_eps:  # present once the package is (re)installed
        assert ep.load() is integration.vllm_plugin


def test_vllm_plugin_installs_only_when_switched_on(
    lmc: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BROKER_LOOKUP_LMCACHE", raising=False)
    try:
        integration.vllm_plugin()
        assert not integration.is_installed()
        monkeypatch.setenv("BROKER_LOOKUP_LMCACHE", "0")
        integration.vllm_plugin()
        assert not integration.is_installed()
        monkeypatch.setenv("BROKER_LOOKUP_LMCACHE", "1")
        integration.vllm_plugin()
        assert integration.is_installed()
        integration.vllm_plugin()  # vLLM loads plugins in every process, maybe twice
        assert integration.is_installed()
    finally:
        integration.uninstall()


# -- one namespace per vLLM instance -------------------------------------------------------


class VllmServiceFactory:
    """Stands in for LMCache's ``VllmServiceFactory``: it holds vLLM's config and calls
    LMCache's factory from its methods, as LMCache's does."""

    def __init__(self, lmc: SimpleNamespace, instance_id: str) -> None:
        self.lmc = lmc
        self.vllm_config = SimpleNamespace(instance_id=instance_id)

    def maybe_create_lookup_client(self, config: Any, meta: Any, **kw: Any) -> Any:
        return self.lmc.Factory.create_lookup_client(config, meta, None, **kw)

    def maybe_create_lookup_server(self, engine: Any, meta: Any, **kw: Any) -> Any:
        return self.lmc.Factory.create_lookup_server(engine, meta, **kw)


def test_each_vllm_instance_gets_its_own_namespace(
    lmc: SimpleNamespace, installed: Any, fake: Any, made: Made, make_metadata: Any
) -> None:
    """Two replicas of one manifest (one engine id): each one's client and server share a
    namespace, the replicas do not, and the configured engine id stays visible."""
    config = lmc_config(lmc, enable_async_loading=True, extra_config=URL)
    engine = SimpleNamespace(config=config)
    configured = make_metadata().engine_id
    for instance in ("3f2a1", "9c0d4"):
        vllm = VllmServiceFactory(lmc, instance)
        client = vllm.maybe_create_lookup_client(config, make_metadata(), connection_factory=fake)
        server = vllm.maybe_create_lookup_server(engine, make_metadata(), connection_factory=fake)
        made.keep(client)
        made.keep(server)
        assert client.metadata.engine_id == server.metadata.engine_id == f"{configured}@{instance}"
        assert server.metadata.configured_engine_id == configured
    outside = client_for(lmc, made, config, make_metadata(), connection_factory=fake)
    assert outside.metadata.engine_id == configured  # no vLLM config above: as configured
