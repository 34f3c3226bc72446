"""Which namespaces of one configured engine id are alive: where a split engine's other
half lives.

Every process (a scheduler, each rank) announces its namespace with its hashing
fingerprint (every ``PUBLISH_EVERY_S``)::

    HSET bl:members:{<configured id>} <namespace> <ts_ms>

and drops the members nobody refreshed within ``STALE_MS``; the key's TTL is the engine's
(``engine_ttl_ms``), so it goes with the last process. A scheduler missing ranks reads it
to find the namespaces its ranks may have landed in (:mod:`broker_lookup.client.split`),
with no ``SCAN`` (which a least-privilege user may not run).
"""

from __future__ import annotations

import time

import redis

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.keys import members_key

__all__ = [
    "LWS_PREFIX",
    "RENDEZVOUS_PREFIX",
    "announce",
    "live_namespaces",
]

#: Instance part of a namespace keyed on a LeaderWorkerSet group's leader address.
LWS_PREFIX = "lws-"
#: Instance part of a namespace keyed on a multi-node engine's rendezvous address.
RENDEZVOUS_PREFIX = "mn-"


def _text(raw: str | bytes) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _fresh(raw: dict[bytes | str, bytes | str], now_ms: int, stale_ms: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for field, value in raw.items():
        try:
            stamp = int(_text(value))
        except ValueError:
            stamp = 0  # not ours to read: dropped as stale
        out[_text(field)] = stamp if now_ms - stamp <= stale_ms else -1
    return out


def announce(client: redis.Redis, namespace: str, ttl_ms: int, stale_ms: int) -> dict[str, int]:
    """Announce ``namespace`` and return every live member (namespace -> ts_ms), after
    deleting those older than ``stale_ms``; the key's TTL becomes ``ttl_ms``.

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    key, now_ms = members_key(namespace), int(time.time() * 1000)
    with translate_redis_errors("announcing the engine's namespace"):
        pipe = client.pipeline(transaction=False)
        pipe.hset(key, namespace, str(now_ms))
        pipe.pexpire(key, ttl_ms)
        pipe.hgetall(key)
        found = _fresh(pipe.execute()[2], now_ms, stale_ms)
        stale = [field for field, stamp in found.items() if stamp < 0]
        if stale:
            client.hdel(key, *stale)
    return {field: stamp for field, stamp in found.items() if stamp >= 0}


def live_namespaces(client: redis.Redis, namespace: str, stale_ms: int) -> list[str]:
    """The other live namespaces of ``namespace``'s configured id, sorted.

    Raises:
        BrokerUnavailable: Redis could not be reached.
        BrokerResponseError: Redis refused a command.
    """
    now_ms = int(time.time() * 1000)
    with translate_redis_errors("reading the engine's namespaces"):
        raw = client.hgetall(members_key(namespace))
    found = _fresh(raw, now_ms, stale_ms)
    return sorted(n for n, stamp in found.items() if stamp >= 0 and n != namespace)
