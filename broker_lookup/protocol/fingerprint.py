"""Hash fingerprints: every process says how it hashes chunks, and checks the others.

A scheduler and a worker that hash differently (another ``chunk_size``,
``save_unfull_chunk``, hash algorithm, or an unset ``PYTHONHASHSEED`` with vLLM) never
hit, and LMCache gives no sign of it but a 0% hit rate (its issues #1739, #2979). Each
process therefore writes :meth:`ChunkedTokenHasher.fingerprint` into one hash::

    HSET bl:{E}:fp <role>:<host>:<pid> '{"algorithm": ..., "chunk_size": ..., "ts_ms": ...}'

and compares its own against every other member, logging ``HASH MISMATCH`` loudly.
The key lives as long as the engine (``engine_ttl_ms``, refreshed by each publish and
by every process's beat: see ``lifetime``); members not refreshed within
:data:`STALE_MS` are dropped, so restarts do not pile up.

This module is the data: the member's name and value, and how a hash's members compare.
The reads and writes are :mod:`broker_lookup.transport.fingerprint`'s.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace

__all__ = [
    "PUBLISH_EVERY_S",
    "STALE_MS",
    "Compared",
    "Fingerprint",
    "Hasher",
    "compare",
    "live",
    "member",
    "publish_commands",
]

logger = logging.getLogger(__name__)

#: A member whose ``ts_ms`` is older than this is gone (its process stopped publishing).
STALE_MS = 60_000
#: How often a live process re-publishes.
PUBLISH_EVERY_S = 10.0

#: One process's fingerprint as published (``ts_ms`` included).
Fingerprint = Mapping[str, Any]


class Hasher(Protocol):
    """Anything with LMCache-compatible hashing that can describe itself."""

    def fingerprint(self) -> dict[str, str | int | bool]: ...


class Compared(NamedTuple):
    """A fingerprint hash's members against this process's own, both lists sorted."""

    stale: list[str]  #: not refreshed within STALE_MS: to drop
    mismatches: list[str]  #: hash differently (or undecodable)


def member(role: str) -> str:
    """This process's field in the fingerprint hash: ``<role>:<host>:<pid>``."""
    return f"{role}:{socket.gethostname()}:{os.getpid()}"


def publish_commands(keys: KeySpace, role: str, hasher: Hasher, ttl_ms: int) -> list[Command]:
    """The writes of this process's fingerprint (with ``ts_ms``) and of the key's TTL
    (``ttl_ms``: the engine's ``engine_ttl_ms``)."""
    value = json.dumps({**hasher.fingerprint(), "ts_ms": int(time.time() * 1000)}, sort_keys=True)
    return [("HSET", keys.fingerprint, member(role), value), ("PEXPIRE", keys.fingerprint, ttl_ms)]


def _text(raw: str | bytes) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _decode(raw: str | bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def compare(keys: KeySpace, members: Mapping[Any, Any], own: Fingerprint) -> Compared:
    """``members`` (an HGETALL of the hash) against ``own`` (``ts_ms`` ignored).

    Each mismatch is logged at ERROR with ``HASH MISMATCH`` and both fingerprints; an
    undecodable member counts as one.
    """
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
    return Compared(sorted(stale), sorted(bad))


def live(members: Mapping[Any, Any]) -> dict[str, dict[str, Any] | None]:
    """Every process's fingerprint in ``members`` (``ts_ms`` dropped; None: undecodable),
    stale ones left out: what ``broker-lookup doctor`` compares."""
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
