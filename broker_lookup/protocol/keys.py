"""The key scheme: the only module that formats a Redis key or group name.

Every key of one engine carries the hash tag ``{<engine_id>}`` so that, on Redis
Cluster, all of them live in one slot and every Lua script is legal.

==========================  =======  ====================================================
key                         type     content
==========================  =======  ====================================================
``bl:{E}:requests``         stream   lookup and abort entries; one group ``rank-<r>`` per rank
``bl:{E}:lookup:<id>``      hash     one lookup's state (fields: ``lookup_hash``); PEXPIRE
                                     always set (``<id>`` is ``~<sha256>`` for ids a key
                                     should not hold)
``bl:{E}:done``             stream   completion events for the scheduler's listener
``bl:{E}:hb:<r>``           string   rank heartbeat (JSON), PX TTL
``bl:{E}:dead``             stream   dead-lettered entries with the reason
``bl:{E}:fp``               hash     hashing fingerprint per process
==========================  =======  ====================================================
"""

from __future__ import annotations

import hashlib
import re

from broker_lookup.errors import ConfigError
from broker_lookup.protocol import lookup_hash

__all__ = [
    "DIGEST_MARK",
    "EVERY_REQUEST_STREAM",
    "PREFIX",
    "KeySpace",
    "engine_of_request_stream",
    "validate_engine_id",
]

#: First segment of every key, so an ACL can grant ``~bl:*``.
PREFIX = "bl"

_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
#: Lookup ids used verbatim in a key; any other id is keyed by a digest (see KeySpace.lookup).
_PLAIN_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
#: First character of a digest-keyed id's key part: never in a plain id, so never a collision.
DIGEST_MARK = "~"


#: SCAN pattern of every engine's request stream: one key per engine on the server.
EVERY_REQUEST_STREAM = PREFIX + ":{*}:requests"


def engine_of_request_stream(key: str | bytes) -> str | None:
    """The engine id of a key :data:`EVERY_REQUEST_STREAM` matched (None: not one)."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head, tail = PREFIX + ":{", "}:requests"
    if not (text.startswith(head) and text.endswith(tail)):
        return None
    engine_id = text[len(head) : -len(tail)]
    return engine_id if _ENGINE_ID_RE.match(engine_id) else None


def validate_engine_id(engine_id: str) -> str:
    """Return ``engine_id`` if it can sit inside a hash tag, else raise ConfigError."""
    if not isinstance(engine_id, str) or not _ENGINE_ID_RE.match(engine_id):
        raise ConfigError(
            f"engine_id={engine_id!r} is invalid: use 1-128 characters of "
            "A-Z a-z 0-9 _ . : - (no braces, it becomes a Redis Cluster hash tag)"
        )
    return engine_id


class KeySpace:
    """All key and group names of one engine.

    >>> ks = KeySpace("vllm-0")
    >>> ks.lookup("req-1")
    'bl:{vllm-0}:lookup:req-1'
    """

    __slots__ = ("_base", "dead", "done", "engine_id", "fingerprint", "requests")

    def __init__(self, engine_id: str) -> None:
        self.engine_id = validate_engine_id(engine_id)
        self._base = f"{PREFIX}:{{{engine_id}}}:"
        self.requests = self._base + "requests"
        self.done = self._base + "done"
        self.dead = self._base + "dead"
        self.fingerprint = self._base + "fp"

    def lookup(self, lookup_id: str) -> str:
        """Hash holding the state of one lookup, for any ``str`` id.

        Ids of up to 128 characters of ``A-Z a-z 0-9 _ . : -`` (what vLLM generates) are
        used as they are, so ``redis-cli`` shows them; any other id (a client's
        ``X-Request-Id`` with spaces, non-ASCII, braces, 10 KB) is keyed by
        ``~<sha256 hex>`` and the hash's ``id`` field keeps the original.
        """
        if _PLAIN_ID_RE.match(lookup_id):
            return self._base + "lookup:" + lookup_id
        raw = lookup_id.encode("utf-8", "surrogatepass")
        return self._base + "lookup:" + DIGEST_MARK + hashlib.sha256(raw).hexdigest()

    def lookup_id_of(self, key: str | bytes) -> str | None:
        """Inverse of :meth:`lookup` for plain ids; None for a digest key (read its ``id``)."""
        text = key.decode() if isinstance(key, bytes) else key
        part = text[len(self._base) + len("lookup:") :]
        return None if part.startswith(DIGEST_MARK) else part

    @property
    def lookup_pattern(self) -> str:
        """SCAN pattern matching every lookup hash of this engine."""
        return self._base + "lookup:*"

    def heartbeat(self, rank: int) -> str:
        """String key a live rank keeps refreshed with a PX TTL."""
        return f"{self._base}hb:{rank}"

    @property
    def heartbeat_pattern(self) -> str:
        """SCAN pattern matching every heartbeat key of this engine."""
        return self._base + "hb:*"

    @property
    def pattern(self) -> str:
        """SCAN pattern matching every key of this engine."""
        return self._base + "*"

    @staticmethod
    def group(rank: int) -> str:
        """Consumer group of one rank on the request stream."""
        return f"rank-{rank}"

    @staticmethod
    def consumer(rank: int) -> str:
        """Stable consumer name, so a restarted rank re-reads its own pending entries."""
        return f"rank-{rank}"

    @staticmethod
    def rank_field(rank: int) -> str:
        """Field of the lookup hash holding one rank's hit count (see ``lookup_hash``)."""
        return lookup_hash.rank_field(rank)
