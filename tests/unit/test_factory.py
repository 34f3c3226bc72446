"""LookupClientFactory: LMCache's decision table row by row, and the server's rank filter.

The Redis clients are built on fakeredis through ``connection_factory=``, which the factory
forwards to the client and server constructors; no real server is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from helpers import Made, wait_until

from broker_lookup import (
    BypassLookupClient,
    ChunkStatisticsLookupClient,
    ConfigError,
    HitLimitLookupClient,
    KeySpace,
    LookupClientFactory,
    LookupClientInterface,
    LookupConfig,
    LookupMetadata,
    RedisAsyncLookupClient,
    RedisLookupClient,
    UnknownScheme,
)
from broker_lookup.stub_engine import StubEngine
from workers import RedisAsyncLookupServer, ReferenceEngine

FAST: dict[str, Any] = {"block_ms": 20, "heartbeat_interval_ms": 100, "heartbeat_ttl_ms": 1500}
META = LookupMetadata(engine_id="factory-test", world_size=2)


def cfg(**overrides: Any) -> LookupConfig:
    return LookupConfig(**{**FAST, **overrides})


class External(LookupClientInterface):
    def __init__(self, address: str, config: LookupConfig, metadata: LookupMetadata) -> None:
        self.args = (address, config, metadata)

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return 0

    def close(self) -> None:
        pass


@pytest.fixture
def scheme() -> Iterator[str]:
    LookupClientFactory.register_scheme("extstore", External)
    yield "extstore"
    LookupClientFactory.unregister_scheme("extstore")


def build(made: Made, config: LookupConfig, engine: Any = None, **kwargs: Any) -> Any:
    return made.keep(LookupClientFactory.create_lookup_client(config, META, engine, **kwargs))


# -- rows 1 and 2: external clients ----------------------------------------------------------


def test_row1_external_with_async_loading_is_refused(scheme: str) -> None:
    config = cfg(external_lookup_client=f"{scheme}://h:1", enable_async_loading=True)
    with pytest.raises(ConfigError, match=r"enable_async_loading.*external_lookup_client"):
        LookupClientFactory.create_lookup_client(config, META)


def test_row2_registered_scheme_builds_the_client(scheme: str, made: Made) -> None:
    config = cfg(external_lookup_client=f"{scheme}://master:50051")
    client = build(made, config)
    assert type(client) is External
    assert client.args == ("master:50051", config, META)


def test_row2_unknown_scheme_names_the_registered_schemes(scheme: str) -> None:
    with pytest.raises(UnknownScheme, match=f"'mooncakestore'.*registered schemes: {scheme}"):
        LookupClientFactory.create_lookup_client(
            cfg(external_lookup_client="mooncakestore://h:1"), META
        )


@pytest.mark.parametrize("uri", ["no-scheme", "extstore://", "://addr", "extstore:/h"])
def test_row2_malformed_uri_is_refused(scheme: str, uri: str) -> None:
    with pytest.raises(UnknownScheme, match=r"<scheme>://<address>.*extstore"):
        LookupClientFactory.create_lookup_client(cfg(external_lookup_client=uri), META)


def test_schemes_must_be_identifiers() -> None:
    with pytest.raises(ValueError, match="identifier"):
        LookupClientFactory.register_scheme("bad-scheme", External)
    LookupClientFactory.unregister_scheme("never-registered")


# -- rows 3 to 5: our own clients --------------------------------------------------------------


def test_row3_bypass_with_an_engine(made: Made) -> None:
    engine = ReferenceEngine()
    made.keep(engine)
    client = build(made, cfg(enable_scheduler_bypass_lookup=True), engine)
    assert type(client) is BypassLookupClient and client.engine is engine


def test_row3_bypass_wins_over_async(made: Made) -> None:
    engine = ReferenceEngine()
    made.keep(engine)
    config = cfg(enable_scheduler_bypass_lookup=True, enable_async_loading=True)
    assert type(build(made, config, engine)) is BypassLookupClient


@pytest.mark.parametrize(
    ("async_loading", "expected"),
    [(True, RedisAsyncLookupClient), (False, RedisLookupClient)],
)
def test_row3_bypass_without_an_engine_falls_through(
    fake: Any, made: Made, async_loading: bool, expected: type
) -> None:
    config = cfg(enable_scheduler_bypass_lookup=True, enable_async_loading=async_loading)
    assert type(build(made, config, None, connection_factory=fake)) is expected


def test_row4_async_loading(fake: Any, made: Made) -> None:
    client = build(made, cfg(enable_async_loading=True), connection_factory=fake)
    assert type(client) is RedisAsyncLookupClient
    assert client.supports_producer_reuse() is True


def test_row5_default_is_the_sync_client(fake: Any, made: Made) -> None:
    client = build(made, cfg(), connection_factory=fake)
    assert type(client) is RedisLookupClient
    assert client.supports_producer_reuse() is False


def test_kwargs_reach_the_redis_client(fake: Any, made: Made) -> None:
    redis = fake()
    for rank in (0, 1):  # both ranks look alive to the client, so the lookup is sent
        redis.set(KeySpace(META.engine_id).heartbeat(rank), "{}", px=60_000)
    client = build(made, cfg(enable_async_loading=True), connection_factory=fake)
    assert client.lookup(list(range(600)), "r1") is None
    wait_until(lambda: redis.exists(client.keys.lookup("r1")), message="lookup hash in fakeredis")


# -- wrappers W1 and W2 ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_w1_hit_miss_ratio_wraps_in_hit_limit(fake: Any, made: Made, ratio: float) -> None:
    client = build(made, cfg(hit_miss_ratio=ratio), connection_factory=fake)
    assert type(client) is HitLimitLookupClient
    assert type(client.inner) is RedisLookupClient


def test_w2_chunk_statistics_wraps(fake: Any, made: Made) -> None:
    config = cfg(enable_chunk_statistics=True, enable_async_loading=True)
    client = build(made, config, connection_factory=fake)
    assert type(client) is ChunkStatisticsLookupClient
    assert type(client.inner) is RedisAsyncLookupClient


def test_both_wrappers_in_lmcache_order(fake: Any, made: Made) -> None:
    config = cfg(hit_miss_ratio=0.3, enable_chunk_statistics=True, enable_async_loading=True)
    client = build(made, config, connection_factory=fake)
    assert type(client) is ChunkStatisticsLookupClient
    assert type(client.inner) is HitLimitLookupClient
    assert type(client.inner.inner) is RedisAsyncLookupClient


def test_wrappers_apply_to_external_and_bypass_clients(scheme: str, made: Made) -> None:
    config = cfg(external_lookup_client=f"{scheme}://a", hit_miss_ratio=0.5)
    client = build(made, config)
    assert type(client) is HitLimitLookupClient and type(client.inner) is External
    engine = ReferenceEngine()
    made.keep(engine)
    config = cfg(enable_scheduler_bypass_lookup=True, enable_chunk_statistics=True)
    client = build(made, config, engine)
    assert type(client) is ChunkStatisticsLookupClient
    assert type(client.inner) is BypassLookupClient


# -- create_lookup_server ------------------------------------------------------------------------


def serve(fake: Any, made: Made, config: LookupConfig | None, rank: int) -> Any:
    meta = LookupMetadata(engine_id="factory-test", world_size=2, worker_id=rank)
    engine = StubEngine()
    server = LookupClientFactory.create_lookup_server(engine, meta, config, connection_factory=fake)
    if server is not None:
        made.keep(server)
    return server


@pytest.mark.parametrize("rank", [0, 1])
def test_server_on_every_rank_by_default(fake: Any, made: Made, rank: int) -> None:
    server = serve(fake, made, cfg(), rank)
    assert type(server) is RedisAsyncLookupServer and server.rank == rank
    wait_until(lambda: server.ready, message="server reading its group")


def test_server_wires_itself_into_the_engine(fake: Any, made: Made) -> None:
    server = serve(fake, made, cfg(), 0)
    assert server.engine.server is server  # StubEngine.post_init(async_lookup_server=...)


def test_server_only_on_listed_ranks(fake: Any, made: Made) -> None:
    config = cfg(lookup_server_worker_ids=(1,))
    assert serve(fake, made, config, 0) is None
    assert type(serve(fake, made, config, 1)) is RedisAsyncLookupServer


def test_server_with_mla_only_on_rank_zero(fake: Any, made: Made) -> None:
    for rank, expected in ((0, RedisAsyncLookupServer), (1, type(None))):
        meta = LookupMetadata(engine_id="factory-test", world_size=2, worker_id=rank, use_mla=True)
        server = LookupClientFactory.create_lookup_server(
            StubEngine(), meta, cfg(), connection_factory=fake
        )
        if server is not None:
            made.keep(server)
        assert type(server) is expected


def test_no_server_with_an_external_client(fake: Any, made: Made) -> None:
    assert serve(fake, made, cfg(external_lookup_client="extstore://a"), 0) is None


def test_server_config_defaults_to_the_environment(
    fake: Any, made: Made, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BROKER_LOOKUP_LOOKUP_SERVER_WORKER_IDS", "1")
    assert serve(fake, made, None, 0) is None
    server = serve(fake, made, None, 1)
    assert server.config.lookup_server_worker_ids == (1,)
