"""Hash fingerprints: every process says how it hashes chunks, and checks the others.

A scheduler and a worker that hash differently (another ``chunk_size``,
``save_unfull_chunk``, hash algorithm, or an unset ``PYTHONHASHSEED`` with vLLM) never
hit, and LMCache gives no sign of it but a 0% hit rate (its issues #1739, #2979). Each
process therefore writes :meth:`ChunkedTokenHasher.fingerprint` into one hash::

    HSET bl:{E}:fp <role>:<host>:<pid> '{"algorithm": ..., "chunk_size": ..., "ts_ms": ...}'

and compares its own against every other member, logging ``HASH MISMATCH`` loudly.
The key lives as long as the engine (``engine_ttl_ms``, refreshed by each publish and
by every process's beat: see ``lifetime``); members not refreshed within
:data:`STALE_MS` are dropped by :func:`check`, so restarts do not pile up.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import redis

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.members import announce

__all__ = [
    "PUBLISH_EVERY_S",
    "STALE_MS",
    "Publisher",
    "check",
    "live_members",
    "member",
    "publish",
]

logger = logging.getLogger(__name__)

#: A member whose ``ts_ms`` is older than this is gone (its process stopped publishing).
STALE_MS = 60_000
#: How often a live process re-publishes.
PUBLISH_EVERY_S = 10.0

Fingerprint = Mapping[str, Any]


class Hasher(Protocol):
    """Anything with LMCache-compatible hashing that can describe itself."""

    def fingerprint(self) -> dict[str, str | int | bool]: ...


def member(role: str) -> str:
    """This process's field in the fingerprint hash: ``<role>:<host>:<pid>``."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


def publish(client: redis.Redis, keys: KeySpace, role: str, hasher: Hasher, ttl_ms: int) -> None:
    """Write this process's fingerprint (with ``ts_ms``) and set the key's TTL to ``ttl_ms``
    (the engine's: ``engine_ttl_ms``).

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    value = json.dumps({**hasher.fingerprint(), "ts_ms": int(time.time() * 1000)}, sort_keys=True)
    with translate_redis_errors("publishing the hash fingerprint"):
        pipe = client.pipeline(transaction=False)
        pipe.hset(keys.fingerprint, member(role), value)
        pipe.pexpire(keys.fingerprint, ttl_ms)
        pipe.execute()


def _text(raw: str | bytes) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _decode(raw: str | bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def check(client: redis.Redis, keys: KeySpace, own: Fingerprint) -> list[str]:
    """Members whose fingerprint differs from ``own`` (``ts_ms`` ignored), sorted.

    Each mismatch is logged at ERROR with ``HASH MISMATCH`` and both fingerprints.
    Members not refreshed for :data:`STALE_MS` are deleted and ignored; an undecodable
    member counts as a mismatch.

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    with translate_redis_errors("reading hash fingerprints"):
        members: dict[Any, Any] = client.hgetall(keys.fingerprint)
    ours = {k: v for k, v in own.items() if k != "ts_ms"}
    cutoff = int(time.time() * 1000) - STALE_MS
    stale: list[str] = []
    bad: list[str] = []
    for raw_name, raw_value in members.items():
        name = _text(raw_name)
        theirs = _decode(raw_value)
        ts = theirs.pop("ts_ms", None) if theirs is not None else None
        if isinstance(ts, int) and ts < cutoff:
            stale.append(name)
        elif theirs != ours:
            bad.append(name)
            _report(keys, name, theirs, ours)
    if stale:
        with translate_redis_errors("dropping stale hash fingerprints"):
            client.hdel(keys.fingerprint, *stale)
    return sorted(bad)


def live_members(client: redis.Redis, keys: KeySpace) -> dict[str, dict[str, Any] | None]:
    """Every process's fingerprint (``ts_ms`` dropped; None: undecodable), stale ones left
    out: what ``broker-lookup doctor`` compares. Reads only.

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    with translate_redis_errors("reading hash fingerprints"):
        members: dict[Any, Any] = client.hgetall(keys.fingerprint)
    cutoff = int(time.time() * 1000) - STALE_MS
    found: dict[str, dict[str, Any] | None] = {}
    for raw_name, raw_value in members.items():
        theirs = _decode(raw_value)
        ts = theirs.pop("ts_ms", None) if theirs is not None else None
        if not (isinstance(ts, int) and ts < cutoff):
            found[_text(raw_name)] = theirs
    return found


def _report(keys: KeySpace, name: str, theirs: dict[str, Any] | None, ours: Fingerprint) -> None:
    logger.error(
        "HASH MISMATCH on engine %s: %s hashes with %s but this process (%s:%d) hashes "
        "with %s. Their chunk hashes never equal ours, so lookups between them always "
        "miss: use the same chunk_size, save_unfull_chunk, pre_caching_hash_algorithm "
        "and PYTHONHASHSEED everywhere.",
        keys.engine_id,
        name,
        "an undecodable fingerprint" if theirs is None else json.dumps(theirs, sort_keys=True),
        socket.gethostname(),
        os.getpid(),
        json.dumps(dict(ours), sort_keys=True),
    )


class Publisher:
    """One process's fingerprint duty: publish and check now, then every PUBLISH_EVERY_S;
    with it, the announcement of its namespace (:func:`~broker_lookup.protocol.members.announce`).

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
