"""Making Redis clients from a :class:`LookupConfig`, and consumer-group housekeeping.

Supported URLs: ``redis://``, ``rediss://`` (TLS, with CA and client-certificate
options), ``unix://``, ``redis+sentinel://host:port[,host:port]/<service>[/db]``
(master discovery) and ``redis+cluster://host:port[,host:port]`` (Redis Cluster).

A :data:`ConnectionFactory` returns a fresh client each call; the client and the
server take one, so tests can hand them fakeredis instead of a URL.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from broker_lookup.config import LookupConfig, redact_url
from broker_lookup.errors import ConfigError, translate_redis_errors

__all__ = ["ConnectionFactory", "ensure_group", "make_factory", "server_version"]

logger = logging.getLogger(__name__)

#: Returns a new Redis client; called once per connection a component needs.
ConnectionFactory = Callable[[], "redis.Redis"]


def _common_kwargs(config: LookupConfig, name: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "socket_timeout": config.socket_timeout_ms / 1000,
        "socket_connect_timeout": min(config.socket_timeout_ms / 1000, 5.0),
        "socket_keepalive": True,
        "health_check_interval": 10,
        "client_name": name,
        # Bounded and short: a write that keeps failing is counted and given up by
        # our own loops, which know the lookup's deadline; redis-py does not.
        "retry": Retry(ExponentialBackoff(cap=0.2, base=0.01), 2),
    }
    if config.redis_username is not None:
        kwargs["username"] = config.redis_username
    if config.redis_password is not None:
        kwargs["password"] = config.redis_password
    return kwargs


def _tls_kwargs(config: LookupConfig) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if config.ssl_ca_certs:
        kwargs["ssl_ca_certs"] = config.ssl_ca_certs
    if config.ssl_certfile:
        kwargs["ssl_certfile"] = config.ssl_certfile
    if config.ssl_keyfile:
        kwargs["ssl_keyfile"] = config.ssl_keyfile
    return kwargs


def _hosts(netloc: str, url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    creds, _, hostpart = netloc.rpartition("@")
    user, _, password = creds.partition(":") if creds else ("", "", "")
    hosts: list[tuple[str, int]] = []
    for item in hostpart.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"redis_url={redact_url(url)!r}: '{item}' is not host:port")
        hosts.append((host, int(port)))
    return hosts, unquote(user) or None, unquote(password) or None


def _sentinel_factory(config: LookupConfig, name: str) -> ConnectionFactory:
    url = config.redis_url
    parts = urlsplit(url)
    hosts, user, password = _hosts(parts.netloc, url)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ConfigError(
            f"redis_url={redact_url(url)!r}: name the Sentinel service, "
            "e.g. redis+sentinel://h1:26379,h2:26379/mymaster/0"
        )
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    kwargs = _common_kwargs(config, name)
    kwargs.setdefault("password", password)
    kwargs.setdefault("username", user)
    sentinel = redis.Sentinel(  # type: ignore[no-untyped-call]  # redis-py lacks annotations
        hosts, socket_timeout=kwargs["socket_timeout"], sentinel_kwargs={"socket_timeout": 1.0}
    )
    return lambda: sentinel.master_for(service, db=db, **kwargs)  # type: ignore[no-untyped-call]


def _cluster_factory(config: LookupConfig, name: str) -> ConnectionFactory:
    from redis.cluster import ClusterNode, RedisCluster

    url = config.redis_url
    hosts, user, password = _hosts(urlsplit(url).netloc, url)
    kwargs = _common_kwargs(config, name)
    kwargs.pop("retry")
    kwargs.pop("health_check_interval")
    kwargs.setdefault("password", password)
    kwargs.setdefault("username", user)
    nodes = [ClusterNode(h, p) for h, p in hosts]  # type: ignore[no-untyped-call]

    def make() -> redis.Redis:
        client: Any = RedisCluster(startup_nodes=nodes, **kwargs)
        return client  # type: ignore[no-any-return]  # RedisCluster quacks like Redis here

    return make


def make_factory(config: LookupConfig, name: str) -> ConnectionFactory:
    """A factory of clients for ``config.redis_url``; ``name`` is the CLIENT SETNAME."""
    url = config.redis_url
    if url.startswith("redis+sentinel://"):
        return _sentinel_factory(config, name)
    if url.startswith("redis+cluster://"):
        return _cluster_factory(config, name)
    kwargs = _common_kwargs(config, name)
    if url.startswith("rediss://"):
        kwargs.update(_tls_kwargs(config))
    pool = redis.ConnectionPool.from_url(url, **kwargs)
    return lambda: redis.Redis(connection_pool=pool)


def ensure_group(client: redis.Redis, stream: str, group: str) -> bool:
    """Create ``group`` on ``stream`` (and the stream) if missing; True if created.

    Only BUSYGROUP ("already exists") is swallowed: any other error surfaces.
    """
    with translate_redis_errors(f"creating consumer group {group} on {stream}"):
        try:
            client.xgroup_create(stream, group, id="$", mkstream=True)
        except ResponseError as exc:
            if str(exc).startswith("BUSYGROUP"):
                return False
            raise
    logger.info("created consumer group %s on %s", group, stream)
    return True


def server_version(client: redis.Redis) -> tuple[int, int, int]:
    """(major, minor, patch) of the server, for feature gates; Valkey reports its own."""
    with translate_redis_errors("reading server version"):
        info: dict[str, Any] = client.info("server")
    raw = str(info.get("valkey_version") or info.get("redis_version") or "0.0.0")
    nums = [int(p) if p.isdigit() else 0 for p in raw.split(".")[:3]]
    major, minor, patch = [*nums, 0, 0, 0][:3]
    return major, minor, patch
