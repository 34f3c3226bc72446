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
``bl:{E}:owner:<role>``     string   the lease of one role (``<r>`` a rank, ``sched`` the
                                     scheduler): ``<token> <identity JSON>``, PX lease
``bl:{E}:epochs``           hash     per role, the last epoch handed out (fencing tokens)
``bl:{E}:contender:<role>`` string   a process waiting for that role's lease (identity JSON),
                                     PX lease: a conflict, for ``inspect``
``bl:{E}:metrics:<role>``   string   the role holder's counters and histograms (JSON, see
                                     ``snapshot``), PX a few publish intervals: what
                                     ``broker-lookup exporter`` serves
``bl:{E}:probes``           stream   fleet queries (``probe``) each rank answers, read with
                                     plain XREAD (no group); trimmed, PX ``PROBES_TTL_MS``
``bl:{E}:probe:<qid>``      list     one query's answers, a line per rank; PX its deadline
``bl:members:{C}``          hash     per configured id ``C``, every namespace of it a live
                                     process announced (``members``): where a split
                                     engine's other half lives
==========================  =======  ====================================================

The streams and ``fp`` live as long as the engine (:attr:`KeySpace.lasting`, see
``lifetime``); a lookup hash, a heartbeat and a metrics snapshot carry their own, shorter
TTL.
"""

from __future__ import annotations

import hashlib
import re

from broker_lookup.errors import ConfigError
from broker_lookup.protocol import lookup_hash

__all__ = [
    "DIGEST_MARK",
    "EVERY_REQUEST_STREAM",
    "FLEET_PATTERN",
    "INSTANCE_MARK",
    "METRICS_FLEET_PATTERN",
    "PREFIX",
    "SCHEDULER_ROLE",
    "KeySpace",
    "configured_of",
    "configured_patterns",
    "engine_of",
    "instance_engine_id",
    "instance_of",
    "members_key",
    "rank_role",
    "selected_patterns",
    "validate_configured_id",
    "validate_engine_id",
]

#: First segment of every key, so an ACL can grant ``~bl:*``.
PREFIX = "bl"

# Both are applied with ``fullmatch``: ``re.match`` with ``$`` accepts a trailing newline.
#: A configured engine id: what an operator writes (``kv_transfer_config.engine_id``,
#: ``--engine-id``, an ACL's engine). Never holds INSTANCE_MARK.
_CONFIGURED_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
#: Joins a configured engine id and an instance's id into that instance's namespace. A
#: configured id cannot hold it, so ``a`` + instance ``b`` is never configured ``a.b``'s
#: namespace, and the ACL pattern ``bl:{<configured>@*}:*`` matches that id's instances
#: only (``llama-3@*`` never matches ``llama-3.1-8b@...``). Not special in a glob.
INSTANCE_MARK = "@"
_INSTANCE_RE = r"[A-Za-z0-9_.:\-]{1,64}"
#: An engine namespace: a configured id, or a configured id and an instance's id.
_ENGINE_ID_RE = re.compile(
    rf"(?P<configured>[A-Za-z0-9_.:\-]{{1,128}})(?:{INSTANCE_MARK}(?P<instance>{_INSTANCE_RE}))?"
)
#: Lookup ids used verbatim in a key; any other id is keyed by a digest (see KeySpace.lookup).
_PLAIN_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
#: First character of a digest-keyed id's key part: never in a plain id, so never a collision.
DIGEST_MARK = "~"
_NOT_IN_INSTANCE = re.compile(r"[^A-Za-z0-9_.:\-]")
#: Longest instance id kept; a longer one keeps its head and a digest of the whole.
_INSTANCE_MAX = 64
#: The role of an engine's scheduler (its lookup client) in the ownership keys.
SCHEDULER_ROLE = "sched"


def rank_role(rank: int) -> str:
    """The role of one rank in the ownership keys."""
    return str(rank)


#: SCAN pattern matching every key of every engine on a server.
FLEET_PATTERN = PREFIX + ":{*"
#: SCAN pattern of every engine's request stream: one key per engine on the server
#: (:func:`engine_of` reads the engine id back).
EVERY_REQUEST_STREAM = PREFIX + ":{*}:requests"
#: SCAN pattern matching every metrics snapshot of every engine on a server.
METRICS_FLEET_PATTERN = PREFIX + ":{*}:metrics:*"


def engine_of(key: str | bytes) -> str | None:
    """The engine id in ``key``'s hash tag (``bl:{<engine>}:...``); None for another key."""
    text = key.decode(errors="replace") if isinstance(key, bytes) else key
    head = PREFIX + ":{"
    end = text.find("}:", len(head))
    if not text.startswith(head) or end < 0:
        return None
    engine = text[len(head) : end]
    return engine if _ENGINE_ID_RE.fullmatch(engine) else None


def validate_engine_id(engine_id: str, name: str = "engine_id") -> str:
    """Return ``engine_id`` if it is an engine namespace (a configured id, or
    ``<configured>@<instance>``) that can sit inside a hash tag, else raise ConfigError
    naming it ``name`` (the flag, field or variable it came from)."""
    if not isinstance(engine_id, str) or not _ENGINE_ID_RE.fullmatch(engine_id):
        raise ConfigError(
            f"{name}={engine_id!r} is invalid: use 1-128 characters of "
            "A-Z a-z 0-9 _ . : - (no braces, it becomes a Redis Cluster hash tag), "
            f"optionally followed by {INSTANCE_MARK}<instance> (1-64 of the same characters)"
        )
    return engine_id


def validate_configured_id(engine_id: str, name: str = "engine_id") -> str:
    """Return ``engine_id`` if it is a configured engine id, else raise ConfigError naming
    it ``name``. Unlike a namespace it may not hold INSTANCE_MARK, which joins a configured
    id to an instance's id: that is what keeps the namespaces (and ACL patterns) of
    different configured ids apart."""
    if isinstance(engine_id, str) and INSTANCE_MARK in engine_id:
        raise ConfigError(
            f"{name}={engine_id!r} is invalid: {INSTANCE_MARK!r} is reserved (it joins a "
            "configured engine id to an instance's id); use 1-128 characters of "
            "A-Z a-z 0-9 _ . : -"
        )
    if not isinstance(engine_id, str) or not _CONFIGURED_ID_RE.fullmatch(engine_id):
        raise ConfigError(
            f"{name}={engine_id!r} is invalid: use 1-128 characters of "
            "A-Z a-z 0-9 _ . : - (no braces, it becomes a Redis Cluster hash tag)"
        )
    return engine_id


def configured_of(engine_id: str) -> str:
    """The configured engine id of the namespace ``engine_id``: itself for a configured id,
    the part before INSTANCE_MARK for an instance's (``llama@1796611254`` -> ``llama``).
    Namespaces of one configured id are one engine's instances, or one engine split.

    >>> configured_of("llama-3.1-8b@r3f9a0c2d4e6b8a10")
    'llama-3.1-8b'
    """
    return engine_id.partition(INSTANCE_MARK)[0]


def instance_of(engine_id: str) -> str | None:
    """The instance part of the namespace ``engine_id``; None for a configured id."""
    _, mark, instance = engine_id.partition(INSTANCE_MARK)
    return instance if mark else None


def configured_patterns(engine_id: str, tail: str = "*") -> tuple[str, str]:
    """SCAN/ACL glob patterns of every key ``bl:{<engine>}:<tail>`` of the configured id
    ``engine_id`` and of its instances, and of no other engine (none has INSTANCE_MARK in
    its configured id, so ``<engine>@*`` starts only its own instances' namespaces). An
    ACL also grants the id's :func:`members_key`.

    >>> configured_patterns("llama-3")
    ('bl:{llama-3}:*', 'bl:{llama-3@*}:*')

    Raises:
        ConfigError: ``engine_id`` is not a configured id.
    """
    validate_configured_id(engine_id)
    return (
        f"{PREFIX}:{{{engine_id}}}:{tail}",
        f"{PREFIX}:{{{engine_id}{INSTANCE_MARK}*}}:{tail}",
    )


def selected_patterns(engine_id: str, tail: str = "*") -> tuple[str, ...]:
    """SCAN patterns of the keys ``bl:{<namespace>}:<tail>`` that ``--engine-id engine_id``
    selects: a configured id and its instances (:func:`configured_patterns`), or one
    instance's namespace alone."""
    if instance_of(engine_id) is None:
        return configured_patterns(engine_id, tail)
    return (f"{PREFIX}:{{{engine_id}}}:{tail}",)


def members_key(engine_id: str) -> str:
    """The hash of every live namespace of the configured id of ``engine_id`` (a namespace
    or a configured id): ``bl:members:{<configured>}``. Outside every engine's keys (so no
    fleet reader takes it for an engine), in the configured id's slot, and matched by
    that id's ACL users (see :func:`configured_patterns`)."""
    return f"{PREFIX}:members:{{{configured_of(engine_id)}}}"


def instance_engine_id(engine_id: str, instance_id: str) -> str:
    """The namespace of one instance of the configured ``engine_id``:
    ``<engine_id>@<instance_id>``.

    vLLM replicas started from one manifest share ``kv_transfer_config.engine_id``; each
    instance's scheduler and ranks share their own namespace only if it carries the
    instance's identity too (see ``broker_lookup.integrations.identity``). Characters an
    instance id cannot hold become ``-``; one of more than 64 characters keeps its head and
    16 hex digits of its digest. The configured id is never cut, so the ACL patterns of
    :func:`configured_patterns` match every instance whatever the lengths.

    >>> instance_engine_id("llama-70b", "3f2a1")
    'llama-70b@3f2a1'

    Raises:
        ConfigError: ``engine_id`` is not a configured id, or ``instance_id`` is empty.
    """
    validate_configured_id(engine_id)
    instance = _NOT_IN_INSTANCE.sub("-", instance_id)
    if not instance:
        raise ConfigError(f"instance_id={instance_id!r} is empty: no instance namespace")
    if len(instance) > _INSTANCE_MAX:
        digest = hashlib.sha256(instance_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        instance = instance[: _INSTANCE_MAX - len(digest) - 1] + "-" + digest
    return validate_engine_id(engine_id + INSTANCE_MARK + instance)


class KeySpace:
    """All key and group names of one engine.

    >>> ks = KeySpace("vllm-0")
    >>> ks.lookup("req-1")
    'bl:{vllm-0}:lookup:req-1'
    """

    __slots__ = (
        "_base",
        "dead",
        "done",
        "engine_id",
        "epochs",
        "fingerprint",
        "lasting",
        "probes",
        "requests",
    )

    def __init__(self, engine_id: str) -> None:
        self.engine_id = validate_engine_id(engine_id)
        self._base = f"{PREFIX}:{{{engine_id}}}:"
        self.requests = self._base + "requests"
        self.done = self._base + "done"
        self.dead = self._base + "dead"
        self.fingerprint = self._base + "fp"
        #: The keys that live as long as the engine: every live process refreshes their
        #: TTL (``engine_ttl_ms``), so they expire once the last one is gone.
        self.lasting = (self.requests, self.done, self.dead, self.fingerprint)
        #: Per role, the last fencing epoch handed out by ``claim.lua``.
        self.epochs = self._base + "epochs"
        #: Fleet queries for every rank of this engine (``protocol.probe``).
        self.probes = self._base + "probes"

    def probe_reply(self, query_id: str) -> str:
        """List where the ranks answer one fleet query (``query_id`` is made key-safe by
        its maker, ``protocol.probe.new_query_id``)."""
        return f"{self._base}probe:{query_id}"

    def lookup(self, lookup_id: str) -> str:
        """Hash holding the state of one lookup, for any ``str`` id.

        Ids of up to 128 characters of ``A-Z a-z 0-9 _ . : -`` (what vLLM generates) are
        used as they are, so ``redis-cli`` shows them; any other id (a client's
        ``X-Request-Id`` with spaces, non-ASCII, braces, 10 KB) is keyed by
        ``~<sha256 hex>`` and the hash's ``id`` field keeps the original.
        """
        if _PLAIN_ID_RE.fullmatch(lookup_id):
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

    def owner(self, role: str) -> str:
        """String key holding the lease of ``role`` (:func:`rank_role` or SCHEDULER_ROLE)."""
        return f"{self._base}owner:{role}"

    @property
    def owner_pattern(self) -> str:
        """SCAN pattern matching every lease of this engine."""
        return self._base + "owner:*"

    def contender(self, role: str) -> str:
        """String key a process waiting for ``role``'s lease keeps refreshed: a conflict."""
        return f"{self._base}contender:{role}"

    def metrics(self, role: str) -> str:
        """String key holding the metrics snapshot the holder of ``role`` publishes."""
        return f"{self._base}metrics:{role}"

    @property
    def metrics_pattern(self) -> str:
        """SCAN pattern matching every metrics snapshot of this engine."""
        return self._base + "metrics:*"

    @property
    def contender_pattern(self) -> str:
        """SCAN pattern matching every contender key of this engine."""
        return self._base + "contender:*"

    def part(self, key: str | bytes) -> str:
        """What follows this engine's prefix in ``key`` (``owner:0``, ``hb:1``, ``done``)."""
        text = key.decode(errors="replace") if isinstance(key, bytes) else key
        return text[len(self._base) :] if text.startswith(self._base) else text

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
