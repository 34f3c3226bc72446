"""Least-privilege ACL users, one set per engine: ``broker-lookup acl``.

One Redis serves many engines, so a credential must reach only its own engine's keys:
a worker of engine A that could write engine B's keys could forge B's hits. Each user
generated here is scoped to ``bl:{<engine>}:*`` and ``bl:{<engine>@*}:*`` (the
namespaces of that engine's vLLM instances, ``<engine>@<instance>``; a configured id
never holds ``@``, so no other engine's keys match) and ``bl:members:{<engine>}`` (where
its processes announce their namespaces, so a split engine is found), reaches no Pub/Sub
channel, and may run only the commands its role sends, listed below with where
they come from. A Lua script's own commands are checked against the calling user too,
so they are granted as well; scripts run only by ``EVALSHA`` after ``SCRIPT LOAD``,
never by ``EVAL``.

The lines load on Redis 6.2+ and Valkey 7.2+: no rule names a newer command (redis-py's
``CLIENT SETINFO`` handshake, Redis 7.2+, is refused and ignored), and keys are scoped
with ``~`` only (read-only ``%R~`` patterns need 7.0).
"""

from __future__ import annotations

import hashlib

from broker_lookup.errors import ConfigError
from broker_lookup.protocol.keys import PREFIX, configured_patterns, members_key

__all__ = [
    "COMMANDS",
    "DEFAULT_USER",
    "ROLES",
    "ROUTER_KEYS",
    "acl_file",
    "acl_line",
    "key_patterns",
    "router_key_patterns",
]

#: Every connection names itself (CLIENT SETNAME) and may PING (redis-py's health check,
#: the sender's probe, ``/readyz``).
_CONNECTION = ("client|setname", "ping")
#: Run by the owner leases' script (``claim.lua``) on the owner and epoch keys.
_OWNERSHIP = ("get", "set", "hincrby", "pexpire", "del")
#: Per role, the commands granted (lower case; a subcommand as ``cmd|sub``).
COMMANDS: dict[str, tuple[str, ...]] = {
    "scheduler": (
        *_CONNECTION,
        "evalsha",
        "script|load",  # ScriptSet: submit, cancel, deadline, keep
        "hget",
        "hmget",
        "hset",
        "del",
        "time",
        "xadd",
        "pexpire",  # ... and what those scripts call
        "xread",
        "xrevrange",  # the listener: completions, and where to start reading them
        "mget",  # the ranks' heartbeats
        "hgetall",
        "hdel",  # the fingerprint hash (and hset, pexpire)
        *_OWNERSHIP,
    ),
    "worker": (
        *_CONNECTION,
        "xgroup|create",
        "xreadgroup",
        "xack",
        "xinfo|groups",  # its consumer group
        "xadd",  # dead letters
        "evalsha",
        "script|load",  # report, progress
        "hget",
        "hmget",
        "hset",
        "hexists",
        "time",
        "pexpire",  # ... and what those scripts call
        "set",
        "del",  # its heartbeat
        "hgetall",
        "hdel",  # the fingerprint hash
        "xread",
        "rpush",  # the fleet query: its probe stream, and the answers (with pexpire)
        *_OWNERSHIP,
    ),
    # Read-only: ``broker-lookup inspect`` and the redis-cli commands of docs/deploy.md.
    "operator": (
        *_CONNECTION,
        "scan",
        "type",
        "get",
        "mget",
        "pttl",
        "ttl",
        "hget",
        "hgetall",
        "xlen",
        "xrange",
        "xrevrange",
        "xinfo",
        "xpending",
        "info",
    ),
    # Stops a runaway script (one that has not written yet); touches no key.
    "admin": (*_CONNECTION, "script|kill", "info"),
    # A router: the fleet query and its reservations (``FleetClient``), nothing that
    # writes a lookup hash or reports (no EVALSHA); its keys are ROUTER_KEYS alone.
    "router": (
        *_CONNECTION,
        "scan",  # every engine, or a configured id's instances (their epochs keys)
        "hkeys",  # an engine's known ranks (its epochs hash)
        "get",  # their heartbeats (world size, liveness)
        "xadd",
        "pexpire",  # a probe or reserve on the engine's probe stream, and its TTL
        "blpop",  # the ranks' answers
    ),
}
#: A vLLM pod: its EngineCore hosts the scheduler's client and its workers the rank
#: servers, and every process reads one LMCache config and one environment, so they
#: share one credential with both roles' commands.
COMMANDS["vllm"] = tuple(dict.fromkeys((*COMMANDS["scheduler"], *COMMANDS["worker"])))
#: The roles, in the order the shipped file lists them.
ROLES = ("scheduler", "worker", "vllm", "operator", "admin", "router")
#: The keys (their tails after ``bl:{<engine>}:``) a router reaches: an engine's epochs
#: hash, heartbeats, probe stream and answer lists; not its lookup hashes, request stream,
#: leases or metrics.
ROUTER_KEYS = ("epochs", "hb:*", "probes", "probe:*")
#: First line of every file: connections that do not log in can do nothing.
DEFAULT_USER = "user default off resetkeys resetchannels -@all"


def key_patterns(engine_id: str | None) -> list[str]:
    """The ACL key patterns of the configured ``engine_id``: its own keys, its instances'
    and its members hash, no other engine's; every engine's with None (a fleet-wide
    operator).

    Raises:
        ConfigError: ``engine_id`` is not a configured id (an instance's namespace included).
    """
    if engine_id is None:
        return [f"~{PREFIX}:*"]
    patterns = [*configured_patterns(engine_id), members_key(engine_id)]
    return ["~" + pattern for pattern in patterns]


def router_key_patterns(engine_id: str | None) -> list[str]:
    """The ACL key patterns of a router of the configured ``engine_id`` (its instances
    included), or of every engine with None: the ROUTER_KEYS of each.

    Raises:
        ConfigError: ``engine_id`` is not a configured id.
    """
    if engine_id is None:
        return [f"~{PREFIX}:{{*}}:{tail}" for tail in ROUTER_KEYS]
    return ["~" + p for tail in ROUTER_KEYS for p in configured_patterns(engine_id, tail)]


def acl_line(
    role: str,
    engine_id: str | None,
    *,
    user: str | None = None,
    password: str | None = None,
    password_sha256: str | None = None,
) -> str:
    """One ``user ...`` line of an ACL file for ``role`` on ``engine_id``.

    ``user`` defaults to the role's name; the password is stored as its SHA-256 (``#``),
    from ``password`` or ``password_sha256``, or, with neither, as the placeholder
    ``>changeme-<role>-password`` that must be replaced before use.

    Raises:
        ConfigError: an unknown role, a bad engine id or hash, a scheduler or worker
            without an engine id, or a user name an ACL file cannot hold.
    """
    if role not in COMMANDS:
        raise ConfigError(f"role={role!r} is unknown: use one of {', '.join(ROLES)}")
    if engine_id is None and role in ("scheduler", "worker", "vllm"):
        raise ConfigError(f"role={role!r} needs an engine id: it writes that engine's keys")
    name = user or role
    if not name.isprintable() or any(c.isspace() for c in name) or name.startswith((">", "#")):
        raise ConfigError(f"user={name!r} is not a name an ACL file can hold")
    if password is not None:
        secret = "#" + hashlib.sha256(password.encode()).hexdigest()
    elif password_sha256 is not None:
        digest = password_sha256.strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError("password_sha256 must be 64 hex digits (sha256sum's output)")
        secret = "#" + digest
    else:
        secret = f">changeme-{role}-password"
    if role == "router":
        keys = router_key_patterns(engine_id)
    else:
        keys = key_patterns(engine_id) if role != "admin" else []
    grants = [f"+{command}" for command in dict.fromkeys(COMMANDS[role])]
    return " ".join(
        ["user", name, "on", secret, "resetkeys", "resetchannels", *keys, "-@all", *grants]
    )


def acl_file(engine_id: str) -> str:
    """A whole ACL file for one engine: ``default`` off, then every role under its own
    name with a placeholder password (``deploy/users.acl`` is this for ``vllm-engine``)."""
    return "\n".join([DEFAULT_USER, *(acl_line(role, engine_id) for role in ROLES)]) + "\n"
