"""Publishing and checking hash fingerprints in Redis (what they are:
:mod:`broker_lookup.protocol.fingerprint`).

A process's :class:`Publisher` runs on its beat (:mod:`broker_lookup.transport.beat`),
every :data:`~broker_lookup.protocol.fingerprint.PUBLISH_EVERY_S`; ``doctor`` reads
:func:`live_members`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.fingerprint import (
    PUBLISH_EVERY_S,
    STALE_MS,
    Fingerprint,
    Hasher,
    compare,
    live,
    publish_commands,
)
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.transport.members import announce

__all__ = ["Publisher", "check", "live_members", "publish"]

logger = logging.getLogger(__name__)


def publish(client: redis.Redis, keys: KeySpace, role: str, hasher: Hasher, ttl_ms: int) -> None:
    """Write this process's fingerprint (with ``ts_ms``) and set the key's TTL to ``ttl_ms``
    (the engine's: ``engine_ttl_ms``).

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    (_, key, name, value), (_, _, ttl) = publish_commands(keys, role, hasher, ttl_ms)
    with translate_redis_errors("publishing the hash fingerprint"):
        pipe = client.pipeline(transaction=False)
        pipe.hset(str(key), str(name), str(value))
        pipe.pexpire(str(key), int(ttl))
        pipe.execute()


def check(client: redis.Redis, keys: KeySpace, own: Fingerprint) -> list[str]:
    """Members whose fingerprint differs from ``own`` (``ts_ms`` ignored), sorted; stale
    members are deleted and ignored (see :func:`~broker_lookup.protocol.fingerprint.compare`).

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    with translate_redis_errors("reading hash fingerprints"):
        members: dict[Any, Any] = client.hgetall(keys.fingerprint)
    found = compare(keys, members, own)
    if found.stale:
        with translate_redis_errors("dropping stale hash fingerprints"):
            client.hdel(keys.fingerprint, *found.stale)
    return found.mismatches


def live_members(client: redis.Redis, keys: KeySpace) -> dict[str, dict[str, Any] | None]:
    """Every process's fingerprint (``ts_ms`` dropped; None: undecodable), stale ones left
    out: what ``broker-lookup doctor`` compares. Reads only.

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    with translate_redis_errors("reading hash fingerprints"):
        members: dict[Any, Any] = client.hgetall(keys.fingerprint)
    return live(members)


class Publisher:
    """One process's fingerprint duty: publish and check now, then every PUBLISH_EVERY_S.

    Never raises: failures are logged at WARNING (the fingerprint is a diagnostic). It
    uses the Redis client it is handed, or one of its own made by ``factory``; ``ttl_ms``
    is the key's TTL (the engine's ``engine_ttl_ms``).
    """

    def __init__(
        self,
        keys: KeySpace,
        role: str,
        hasher: Hasher,
        factory: Callable[[], redis.Redis] | None = None,
        *,
        ttl_ms: int,
    ) -> None:
        self._keys = keys
        self._ttl_ms = ttl_ms
        self._role = role
        self._hasher = hasher
        self._factory = factory
        self._own: redis.Redis | None = None
        self._next = 0.0
        #: Members whose hashing differs from ours, as of the last check.
        self.mismatches: list[str] = []

    def run(self, client: redis.Redis | None = None) -> list[str]:
        """Publish and check now; return (and remember) the mismatching members."""
        self._next = time.monotonic() + PUBLISH_EVERY_S
        try:
            if client is None:
                if self._own is None and self._factory is not None:
                    self._own = self._factory()
                client = self._own
            if client is not None:
                publish(client, self._keys, self._role, self._hasher, self._ttl_ms)
                self.mismatches = check(client, self._keys, self._hasher.fingerprint())
                announce(client, self._keys.engine_id, self._ttl_ms, STALE_MS)
        except Exception as exc:  # a diagnostic must never break its host
            logger.warning("hash fingerprint publish/check failed: %s", exc)
        return self.mismatches

    def tick(self, client: redis.Redis | None = None) -> None:
        """:meth:`run` if PUBLISH_EVERY_S has passed since the last run."""
        if time.monotonic() >= self._next:
            self.run(client)

    def close(self) -> None:
        """Close the client this publisher made itself, if any."""
        own = self._own
        self._own = None
        if own is not None:
            own.close()
