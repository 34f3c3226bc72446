"""Making Redis clients from a :class:`LookupConfig`, and consumer-group housekeeping.

Supported URLs (:class:`~broker_lookup.config.urls.Scheme` owns the set; here, how each connects):

* ``redis://``, ``rediss://`` (TLS, with CA and client-certificate options), ``unix://``;
* ``redis+sentinel://[user:pass@]host:port[,host:port]/<service>[/db][?options]``: the
  hosts are sentinels; clients follow the service's master through failovers. Options:
  ``ssl=true`` (TLS to sentinels and nodes, with the ``ssl_*`` config), ``sentinel_auth=true``
  (the sentinels require the same credentials, like Bitnami's ``auth.sentinel``);
* ``redis+cluster://[user:pass@]host:port[,host:port][?ssl=true]``: Redis Cluster; the
  hosts are entry points for slot-map discovery. Every key of one engine shares a hash
  tag, so each engine lives in one slot and every script and pipeline is legal.

A :data:`ConnectionFactory` returns a client each call; the client and the server take
one, so tests can hand them fakeredis instead of a URL. Clients of one factory share
their connection pool (for a cluster: one ``RedisCluster``, made on first use and closed
with the last client), so ``close()`` on one never breaks another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.connection import parse_url
from redis.exceptions import ResponseError
from redis.retry import Retry

from broker_lookup.config import LookupConfig, Scheme, redact_url, url_scheme
from broker_lookup.config.urls import MultiHostUrl
from broker_lookup.errors import ConfigError, translate_redis_errors

__all__ = [
    "ConnectionFactory",
    "PooledFactory",
    "close_factory",
    "ensure_group",
    "make_factory",
    "redis_cli_args",
    "server_version",
]

logger = logging.getLogger(__name__)

#: Returns a Redis client; called once per connection a component needs. Never does I/O.
ConnectionFactory = Callable[[], "redis.Redis"]


def _common_kwargs(
    config: LookupConfig, name: str, socket_timeout_s: float | None = None
) -> dict[str, Any]:
    timeout = config.socket_timeout_ms / 1000 if socket_timeout_s is None else socket_timeout_s
    kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": min(timeout, 5.0),
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


def _multi_host(config: LookupConfig) -> MultiHostUrl:
    """The parsed ``redis_url`` of a Sentinel or Cluster config (checked when it was built)."""
    scheme = url_scheme(config.redis_url)
    try:
        return MultiHostUrl(config.redis_url, scheme.options if scheme else ())
    except ValueError as exc:  # a config built around its own checks
        raise ConfigError(f"redis_url={redact_url(config.redis_url)!r}: {exc}") from None


def _node_kwargs(
    config: LookupConfig, name: str, url: MultiHostUrl, socket_timeout_s: float | None
) -> dict[str, Any]:
    """Connection kwargs for data nodes: config credentials win over the URL's."""
    kwargs = _common_kwargs(config, name, socket_timeout_s)
    if "username" not in kwargs and url.user is not None:
        kwargs["username"] = url.user
    if "password" not in kwargs and url.password is not None:
        kwargs["password"] = url.password
    if url.flags.get("ssl"):
        kwargs["ssl"] = True
        kwargs.update(_tls_kwargs(config))
    return kwargs


def _sentinel_factory(
    config: LookupConfig, name: str, socket_timeout_s: float | None, own_retries: bool
) -> ConnectionFactory:
    """Clients of the master Sentinel names; all share one master-tracking pool.

    The pool asks the sentinels for the master's address whenever it connects, drops
    idle connections when the address changes, and turns READONLY from a demoted
    master into a reconnect, so every client follows a failover by itself.
    """
    from redis.sentinel import SentinelConnectionPool

    url = _multi_host(config)
    if not url.path or len(url.path) > 2 or (len(url.path) == 2 and not url.path[1].isdigit()):
        raise ConfigError(
            f"redis_url={redact_url(config.redis_url)!r}: name the Sentinel service and "
            "optionally the db, e.g. redis+sentinel://h1:26379,h2:26379/mymaster/0"
        )
    kwargs = _node_kwargs(config, name, url, socket_timeout_s)
    if own_retries:
        kwargs["retry"] = Retry(NoBackoff(), 0)
    sentinel_kwargs: dict[str, Any] = {
        # A dead sentinel costs at most this per discovery; the next one is asked.
        "socket_timeout": _SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": _SENTINEL_TIMEOUT_S,
        "socket_keepalive": True,
        "client_name": name,
    }
    if url.flags.get("sentinel_auth"):  # Bitnami's auth.sentinel: same credentials
        sentinel_kwargs.update({k: kwargs[k] for k in ("username", "password") if k in kwargs})
    if url.flags.get("ssl"):
        sentinel_kwargs.update(ssl=True, **_tls_kwargs(config))
    # redis-py 8.2 types Sentinel, the versions before it did not: the ignore is for those.
    sentinel = redis.Sentinel(url.hosts, sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call,unused-ignore]
    db = int(url.path[1]) if len(url.path) == 2 else 0
    pool = SentinelConnectionPool(url.path[0], sentinel, db=db, **kwargs)  # type: ignore[no-untyped-call]
    return lambda: redis.Redis(connection_pool=pool)


_SENTINEL_TIMEOUT_S = 1.0


def _cluster_factory(
    config: LookupConfig, name: str, socket_timeout_s: float | None
) -> ConnectionFactory:
    """Handles on one shared ``RedisCluster`` (thread-safe, one pool per node)."""
    from redis.cluster import ClusterNode, RedisCluster

    from broker_lookup.transport.cluster import SharedCluster

    url = _multi_host(config)
    if url.path:
        raise ConfigError(
            f"redis_url={redact_url(config.redis_url)!r}: Redis Cluster has only db 0; "
            "drop the path, e.g. redis+cluster://h1:6379,h2:6379"
        )
    kwargs = _node_kwargs(config, name, url, socket_timeout_s)
    # Not per-connection options in cluster mode: the cluster client retries itself
    # (re-reading the slot map), and health checks are not passed to node pools.
    retry = kwargs.pop("retry")
    kwargs.pop("health_check_interval")
    nodes = [ClusterNode(h, p) for h, p in url.hosts]  # type: ignore[no-untyped-call]

    def make() -> Any:
        return RedisCluster(
            startup_nodes=nodes,
            retry=retry,
            # Keep the URL's hosts as the entry points for every topology refresh: in
            # Kubernetes they are stable service names while node IPs change.
            dynamic_startup_nodes=False,
            **kwargs,
        )

    return SharedCluster(make).acquire


class PooledFactory:
    """A :data:`ConnectionFactory` over one connection pool, which :meth:`close` disconnects.

    ``Redis.close()`` on a client of a shared pool leaves its sockets open until garbage
    collection; the owner of the factory closes them all at once when it shuts down.
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool

    def __call__(self) -> redis.Redis:
        return redis.Redis(connection_pool=self._pool)

    def close(self) -> None:
        """Disconnect every connection of the pool (idempotent)."""
        self._pool.disconnect()


def close_factory(factory: ConnectionFactory) -> None:
    """Close ``factory``'s connections if it owns a pool (a test's fakeredis factory does not)."""
    close = getattr(factory, "close", None)
    if callable(close):
        close()


def make_factory(
    config: LookupConfig,
    name: str,
    *,
    socket_timeout_s: float | None = None,
    own_retries: bool = False,
) -> ConnectionFactory:
    """A factory of clients for ``config.redis_url``; ``name`` is the CLIENT SETNAME.

    ``socket_timeout_s`` overrides ``socket_timeout_ms`` for a loop that must notice a
    stalled server sooner (a blocking read: BLOCK plus the breaker's threshold).
    ``own_retries``: the loop using it retries itself, so redis-py does not (implied by
    ``socket_timeout_s``); redis-py's retries, connecting again each time, would
    multiply the loop's bound and outlast its stop.
    """
    url = config.redis_url
    scheme = url_scheme(url)
    own_retries = own_retries or socket_timeout_s is not None
    if scheme is Scheme.SENTINEL:
        return _sentinel_factory(config, name, socket_timeout_s, own_retries)
    if scheme is Scheme.CLUSTER:
        # The cluster client's retries follow the slot map (MOVED, a failover): kept.
        return _cluster_factory(config, name, socket_timeout_s)
    kwargs = _common_kwargs(config, name, socket_timeout_s)
    if scheme is Scheme.UNIX:
        # TCP keepalive is a TCP socket option: redis-py's unix connection refuses it.
        del kwargs["socket_keepalive"]
    if own_retries:
        kwargs["retry"] = Retry(NoBackoff(), 0)
    if scheme is Scheme.REDISS:
        kwargs.update(_tls_kwargs(config))
    # What from_url does, but the config's credentials win over the URL's, as documented
    # (from_url lets every URL option win).
    options = {**kwargs, **parse_url(url)}  # type: ignore[no-untyped-call]  # redis-py: untyped
    options.update({k: kwargs[k] for k in ("username", "password") if k in kwargs})
    return PooledFactory(redis.ConnectionPool(**options))


def redis_cli_args(url: str) -> str:
    """``redis-cli`` options that reach the server(s) of ``url`` (no password: REDISCLI_AUTH).

    >>> redis_cli_args("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    '-c -h 10.0.0.1 -p 7000'
    """
    scheme = url_scheme(url)
    if scheme is not None and scheme.multi_host:
        parsed = MultiHostUrl(url, scheme.options)
        (host, port), tls = parsed.hosts[0], " --tls" if parsed.flags.get("ssl") else ""
        if scheme is Scheme.CLUSTER:
            return f"-c -h {host} -p {port}{tls}"
        service = parsed.path[0] if parsed.path else "mymaster"
        db = parsed.path[1] if len(parsed.path) > 1 else "0"
        ask = f"redis-cli -h {host} -p {port}{tls} SENTINEL get-master-addr-by-name {service}"
        return f"-h $({ask} | head -1) -p $({ask} | tail -1) -n {db}{tls}"
    parts = urlsplit(url)
    db = parts.path.strip("/") or "0"
    if scheme is Scheme.UNIX:
        return f"-s {parts.path} -n {dict(parse_qsl(parts.query)).get('db', '0')}"
    tls = " --tls" if scheme is Scheme.REDISS else ""
    return f"-h {parts.hostname or '127.0.0.1'} -p {parts.port or 6379} -n {db}{tls}"


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
