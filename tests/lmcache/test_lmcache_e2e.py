"""End to end through LMCache's own classes: LMCacheManager, its factory, a real LMCacheEngine.

A scheduler-role and a worker-role ``LMCacheManager`` are built exactly as vLLM's
connector builds them, through a service factory that calls LMCache's (patched)
``LookupClientFactory``; the worker's engine is a real ``LMCacheEngine`` on CPU with
chunks stored in its local CPU backend. The broker runs on fakeredis and on a real server.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from faultkit import alive
from helpers import Backend, wait_until

from broker_lookup import (
    BypassLookupClient,
    FleetClient,
    LookupConfig,
    RedisAsyncLookupClient,
    RedisLookupClient,
)
from workers import RedisAsyncLookupServer

pytestmark = pytest.mark.lmcache

BROKER = {
    "lookup_broker_url": "redis://unused.invalid:6379/0",  # the tests pass connection_factory
    "lookup_broker_block_ms": 50,
    "lookup_broker_heartbeat_interval_ms": 100,
    "lookup_broker_heartbeat_ttl_ms": 1500,
}
PROMPT = list(range(1000, 1064))  # 4 chunks of 16
STORED = 32  # tokens of PROMPT stored in the worker's engine


class ServiceFactory:
    """Stands in for LMCache's VllmServiceFactory: builds what LMCacheManager asks for."""

    def __init__(
        self, lmc: Any, role: str, config: Any, metadata: Any, backend: Backend, engine: Any
    ) -> None:
        self.lmc, self.role, self.config, self.metadata = lmc, role, config, metadata
        self.backend, self.engine = backend, engine

    def get_or_create_metadata(self) -> Any:
        return self.metadata

    def get_or_create_lmcache_engine(self) -> Any:
        return self.engine

    def maybe_create_lookup_client(self) -> Any:
        if self.role != "scheduler":
            return None
        return self.lmc.Factory.create_lookup_client(
            self.config, self.metadata, self.engine, connection_factory=self.backend.factory
        )

    def maybe_create_lookup_server(self) -> Any:
        if self.role != "worker":
            return None
        return self.lmc.Factory.create_lookup_server(
            self.engine, self.metadata, connection_factory=self.backend.factory
        )

    def maybe_create_offload_server(self) -> None:
        return None

    def maybe_create_runtime_plugin_launcher(self) -> None:
        return None

    def maybe_create_internal_api_server(self, lmcache_manager: Any = None) -> None:
        return None

    def maybe_create_health_monitor(self, lmcache_manager: Any = None) -> None:
        return None

    def get_engine_instance_id(self) -> str:
        return "not-built-by-the-manager"  # make_engine destroys the engine


class MiniManager:
    """LMCacheManager 0.5.6's lookup wiring, used when ``lmcache.v1.manager`` cannot be
    imported (it needs fastapi, which the CPU install lacks): the same factory calls in
    the same order, and post_init's isinstance check before wiring the async server in."""

    def __init__(self, lmc: Any, config: Any, factory: ServiceFactory) -> None:
        self._lmc, self._config = lmc, config
        factory.get_or_create_metadata()
        self._lmcache_engine = factory.get_or_create_lmcache_engine()
        self.lookup_client = factory.maybe_create_lookup_client()
        self.lookup_server = factory.maybe_create_lookup_server()
        self._init_failed = False

    def post_init(self) -> None:
        if self._lmcache_engine is None:
            return
        server = None
        if self._config.enable_async_loading and self.lookup_server is not None:
            assert isinstance(self.lookup_server, self._lmc.AsyncServer)
            server = self.lookup_server
        self._lmcache_engine.post_init(async_lookup_server=server)

    def is_healthy(self) -> bool:
        return not self._init_failed

    def get_lookup_info(self) -> dict[str, str]:
        return {"client": _nested(self.lookup_client), "server": _nested(self.lookup_server)}

    def stop_services(self) -> None:
        for part in (self.lookup_server, self.lookup_client):
            if part is not None:
                part.close()


def _nested(obj: Any) -> str:
    names = [type(obj).__name__]
    while hasattr(obj, "actual_lookup_client"):
        obj = obj.actual_lookup_client
        names.append(type(obj).__name__)
    return "".join(f"{n}(" for n in names[:-1]) + names[-1] + ")" * (len(names) - 1)


def new_manager(lmc: Any, config: Any, factory: ServiceFactory) -> Any:
    """LMCache's own LMCacheManager when importable, else :class:`MiniManager`."""
    if lmc.Manager is not None:
        return lmc.Manager(config, factory)
    return MiniManager(lmc, config, factory)


@pytest.fixture
def deploy(
    lmc: SimpleNamespace,
    installed: Any,
    backend: Backend,
    make_metadata: Callable[..., Any],
    make_engine: Callable[..., Any],
) -> Iterator[Callable[..., SimpleNamespace]]:
    """Build a worker manager (real engine, chunks stored) and a scheduler manager."""
    managers: list[Any] = []

    def make(**settings: Any) -> SimpleNamespace:
        extra = {**BROKER, **settings.pop("extra", {})}
        config = lmc.Config.from_defaults(
            chunk_size=16, local_cpu=True, max_local_cpu_size=0.02, extra_config=extra, **settings
        )
        metadata = make_metadata()
        engine = make_engine(config, metadata)
        worker = new_manager(
            lmc, config, ServiceFactory(lmc, "worker", config, metadata, backend, engine)
        )
        managers.append(worker)
        worker.post_init()  # LMCache: after KV caches are registered; wires the server in
        store(engine, metadata, PROMPT[:STORED])
        bypass = config.enable_scheduler_bypass_lookup
        factory = ServiceFactory(
            lmc, "scheduler", config, metadata, backend, engine if bypass else None
        )
        scheduler = new_manager(lmc, config, factory)
        managers.append(scheduler)
        scheduler.post_init()
        return SimpleNamespace(worker=worker, scheduler=scheduler, engine=engine)

    yield make
    for built in reversed(managers):
        built.stop_services()


def store(engine: Any, metadata: Any, tokens: list[int]) -> None:
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    manager = engine.storage_manager
    objs = manager.batched_allocate(metadata.get_shapes(), metadata.get_dtypes(), len(keys))
    manager.batched_put(keys, objs)
    wait_until(lambda: all(manager.contains(k) for k in keys), message="chunks stored")


def test_async_lookup_answered_by_a_real_engine(lmc: SimpleNamespace, deploy: Any) -> None:
    d = deploy(enable_async_loading=True)
    server, client = d.worker.lookup_server, d.scheduler.lookup_client
    assert isinstance(server, RedisAsyncLookupServer) and isinstance(server, lmc.AsyncServer)
    assert type(client) is RedisAsyncLookupClient and isinstance(client, lmc.Interface)
    assert d.worker.is_healthy() and not d.worker._init_failed  # post_init accepted our server
    assert d.engine.storage_manager.async_lookup_server is server
    alive(client)
    assert client.lookup_cache("req-1") == -1
    assert client.lookup(PROMPT, "req-1") is None
    assert wait_until(lambda: client.lookup_cache("req-1") == STORED)
    assert client.lookup(list(range(5000, 5064)), "miss") is None
    assert wait_until(lambda: client.lookup_cache("miss") == 0)
    loading = lmc.EventType.LOADING
    assert d.engine.event_manager.get_event_status(loading, "req-1") == lmc.EventStatus.DONE
    client.cancel_lookup("req-1")  # the worker releases the prefetched objects at once (D11)
    wait_until(
        lambda: (
            d.engine.event_manager.get_event_status(loading, "req-1") == lmc.EventStatus.NOT_FOUND
        ),
        message="prefetch released by cleanup_memory_objs",
    )
    assert client.fingerprint.mismatches == [] and server.fingerprint.run() == []


def test_rank_heartbeat_says_which_lmcache_it_runs(
    lmc: SimpleNamespace, deploy: Any, backend: Backend
) -> None:
    server = deploy(enable_async_loading=True).worker.lookup_server
    redis = backend.factory(decode_responses=True)
    key = server.keys.heartbeat(server.rank)
    assert wait_until(lambda: redis.get(key) is not None, message="the rank's first heartbeat")
    beat = redis.get(key)
    assert isinstance(beat, str) and json.loads(beat)["lmcache"] == lmc.version


def test_sync_mode_looks_up_and_pins_like_lmcache_sync_server(deploy: Any) -> None:
    d = deploy(enable_async_loading=False)
    client = d.scheduler.lookup_client
    assert type(client) is RedisLookupClient
    alive(client)
    assert client.lookup(PROMPT, "req-1") == STORED
    assert client.lookup_cache("req-1") == STORED
    assert "req-1" in d.engine.lookup_pins  # pinned on the worker until lookup_unpin
    d.engine.lookup_unpin("req-1")  # what vLLM's adapter does after retrieve
    assert "req-1" not in d.engine.lookup_pins
    assert client.lookup(list(range(5000, 5064)), "miss") == 0


def test_bypass_asks_the_real_engine_and_cancel_unpins(deploy: Any) -> None:
    d = deploy(enable_async_loading=True, enable_scheduler_bypass_lookup=True)
    client = d.scheduler.lookup_client
    assert type(client) is BypassLookupClient
    assert client.lookup_cache("b1") == -1  # not None: the scheduler would wait forever (D1)
    assert client.lookup(PROMPT, "b1") == STORED
    assert client.lookup_cache("b1") == STORED
    assert "b1" in d.engine.lookup_pins
    client.cancel_lookup("b1")
    assert "b1" not in d.engine.lookup_pins and client.lookup_cache("b1") == -1


def test_wrappers_show_in_lmcache_lookup_info(deploy: Any) -> None:
    d = deploy(enable_async_loading=True, hit_miss_ratio=0.5, enable_chunk_statistics=True)
    info = d.scheduler.get_lookup_info()
    assert info["client"] == (
        "ChunkStatisticsLookupClient(HitLimitLookupClient(RedisAsyncLookupClient))"
    )
    assert d.worker.get_lookup_info()["server"] == "LMCacheBrokerLookupServer"
    client = d.scheduler.lookup_client
    alive(client.inner.inner)
    client.lookup(PROMPT, "r")
    # 32 of 64 tokens are cached; a 0.5 miss ratio allows 32: the limit applies to
    # lookup_cache results (D16), here without cutting them.
    assert wait_until(lambda: client.lookup_cache("r") == STORED)


def test_the_fleet_query_asks_a_real_engine_and_reserves_with_its_pins(
    deploy: Any, backend: Backend
) -> None:
    d = deploy(enable_async_loading=True)
    server = d.worker.lookup_server
    fleet = FleetClient(LookupConfig(chunk_size=16), connection_factory=backend.factory)
    try:
        wait_until(lambda: server.prober.reading.is_set(), message="the probe thread reads")
        engine_id = server.keys.engine_id
        answer = fleet.query(PROMPT, engines=[engine_id], deadline_ms=3000)
        assert [(e.tokens, e.reason) for e in answer.engines] == [(STORED, None)]
        assert not d.engine.lookup_pins  # a probe pins nothing
        held = fleet.query(PROMPT, engines=[engine_id], deadline_ms=3000, reserve_ms=300)
        assert held.engines[0].reserved == STORED
        assert any(k.startswith("bl-reserve:") for k in d.engine.lookup_pins)
        wait_until(lambda: not d.engine.lookup_pins, message="released at the TTL")
        assert server.reservations.counts == {"reserved": 1, "released_ttl": 1}
    finally:
        fleet.close()
