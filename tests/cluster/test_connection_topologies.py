"""``make_factory`` for ``redis+sentinel://`` and ``redis+cluster://`` URLs.

Parsing, credentials, TLS and timeouts are checked without a server (a factory call never
does I/O); sharing of the one ``RedisCluster`` per factory runs on the local cluster.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import redis
from redis.sentinel import (
    SentinelConnectionPool,
    SentinelManagedConnection,
    SentinelManagedSSLConnection,
)

from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerUnavailable, ConfigError, translate_redis_errors
from broker_lookup.tools.local_cluster import LocalCluster
from broker_lookup.transport.connection import make_factory


def _pool(url: str, **config: object) -> redis.ConnectionPool:
    client = make_factory(LookupConfig(redis_url=url, **config), "bl-test")()  # type: ignore[arg-type]
    return client.connection_pool


def _nodes(handle: object) -> object:
    """The nodes manager of the RedisCluster a cluster handle forwards to."""
    return cast(Any, handle).nodes_manager


def test_sentinel_url_names_sentinels_service_db_and_credentials() -> None:
    pool = _pool("redis+sentinel://u:p%40ss@s1:26379,[::1]:26380/cache/3")
    assert isinstance(pool, SentinelConnectionPool)
    kw = pool.connection_kwargs
    assert (pool.service_name, kw["db"], kw["username"], kw["password"]) == (
        "cache",
        3,
        "u",
        "p@ss",
    )
    assert kw["client_name"] == "bl-test" and kw["socket_timeout"] == 5.0
    assert pool.connection_class is SentinelManagedConnection
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"]) for s in sentinels] == [("s1", 26379), ("::1", 26380)]
    assert all(s["password"] is None and s["socket_timeout"] == 1.0 for s in sentinels)


def test_sentinel_config_credentials_win_and_options_reach_sentinels_and_tls() -> None:
    pool = _pool(
        "redis+sentinel://u:url@s1:26379/mymaster?ssl=true&sentinel_auth=true",
        redis_password="cfg",
        ssl_ca_certs="/ca.pem",
    )
    assert pool.connection_kwargs["password"] == "cfg"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert pool.connection_class is SentinelManagedSSLConnection
    assert isinstance(pool, SentinelConnectionPool)
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool
    assert sentinel.connection_kwargs["password"] == "cfg"
    assert sentinel.connection_class is redis.SSLConnection


def test_clients_of_one_sentinel_factory_share_its_pool() -> None:
    factory = make_factory(LookupConfig(redis_url="redis+sentinel://s1:26379/m"), "n")
    first, second = factory(), factory()
    assert first.connection_pool is second.connection_pool
    first.close()
    assert second.connection_pool is first.connection_pool  # closing one closes no pool


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://s1:26379", "name the Sentinel service"),
        ("redis+sentinel://s1:26379/m/x", "name the Sentinel service"),
        ("redis+sentinel://s1:26379/m/0/extra", "name the Sentinel service"),
        ("redis+sentinel://s1/m", "is not host:port"),
        ("redis+sentinel://s1:26379/m?tls=1", "option tls"),
        ("redis+sentinel://s1:26379/m?ssl=maybe", "option ssl"),
        ("redis+cluster://h1:7000/0", "only db 0"),
        ("redis+cluster://h1:7000,h2", "is not host:port"),
        ("redis+cluster://h1:7000?sentinel_auth=true", "option sentinel_auth"),
        ("redis+cluster://:secret@h1:x", "is not host:port"),
    ],
)
def test_bad_topology_urls_fail_naming_the_problem(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        make_factory(LookupConfig(redis_url=url), "n")
    assert "secret" not in str(info.value)


def test_cluster_factory_does_no_io_and_an_unreachable_cluster_is_unavailable() -> None:
    config = LookupConfig(
        redis_url="redis+cluster://127.0.0.1:1,127.0.0.1:2", socket_timeout_ms=2000
    )
    client = make_factory(config, "n")()  # no node answers: still no error here
    with pytest.raises(BrokerUnavailable, match="unreachable"):
        with translate_redis_errors("pinging"):
            client.ping()
    client.close()
    client.close()  # idempotent
    with pytest.raises(redis.ConnectionError, match="closed"):
        client.ping()


def test_cluster_factory_passes_credentials_tls_and_timeouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[dict[str, object]] = []

    class FakeCluster:
        def __init__(self, **kwargs: object) -> None:
            made.append(kwargs)

        def ping(self) -> bool:
            return True

        def close(self) -> None:
            made.append({"closed": True})

    monkeypatch.setattr(redis.cluster, "RedisCluster", FakeCluster)
    url = "redis+cluster://u:p@h1:7000,h2:7001?ssl=1"
    config = LookupConfig(redis_url=url, ssl_certfile="/c.pem", socket_timeout_ms=3000)
    client = make_factory(config, "bl-x")()
    assert client.ping()  # first use makes the shared client
    kw = made[0]
    nodes = kw["startup_nodes"]
    assert [(n.host, n.port) for n in nodes] == [("h1", 7000), ("h2", 7001)]  # type: ignore[attr-defined]
    assert (kw["username"], kw["password"], kw["ssl"], kw["ssl_certfile"]) == (
        "u",
        "p",
        True,
        "/c.pem",
    )
    assert (kw["socket_timeout"], kw["client_name"], kw["dynamic_startup_nodes"]) == (
        3.0,
        "bl-x",
        False,
    )
    assert "retry" in kw and "health_check_interval" not in kw
    client.close()
    assert made[-1] == {"closed": True}


def test_cluster_errors_are_translated() -> None:
    # redis-py 8.0 leaves RedisClusterException untyped, 8.1 and 8.2 type it.
    cluster_exception: Any = redis.exceptions.RedisClusterException
    for exc in (cluster_exception("x"), redis.exceptions.ClusterError("y")):
        with pytest.raises(BrokerUnavailable, match="Cluster"):
            with translate_redis_errors("testing"):
                raise exc


@pytest.mark.cluster
@pytest.mark.real
def test_handles_of_one_cluster_factory_share_one_client_until_the_last_closes(
    local_cluster: LocalCluster,
) -> None:
    factory = make_factory(LookupConfig(redis_url=local_cluster.url), "bl-test-share")
    first, second = factory(), factory()
    assert first.set("bl:{share}:k", "v")
    assert _nodes(first) is _nodes(second)  # one RedisCluster
    first.close()
    assert second.get("bl:{share}:k") == b"v"  # closing one handle leaves the other working
    shared = _nodes(second)
    second.close()
    third = factory()  # the last close closed the client: a new one is made on first use
    assert third.get("bl:{share}:k") == b"v" and _nodes(third) is not shared
    names = [c["name"] for c in local_cluster.admin(0).client_list()]
    assert "bl-test-share" in names
    third.delete("bl:{share}:k")
    third.close()
