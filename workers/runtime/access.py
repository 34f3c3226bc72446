"""Whether this process's Redis user may reach its engine's keys, asked once at startup.

A rank whose ACL user is scoped to another engine would connect, log that it serves,
and then have every command refused (NOPERM) for as long as it runs. Asked before it
starts, the refusal is a config error like a wrong password: one line naming the user,
what it may reach (where the server lets it read its own rules) and the fix.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import redis

from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.errors import BrokerLookupError, NoPermission, translate_redis_errors
from broker_lookup.protocol.keys import KeySpace, rank_role
from broker_lookup.transport.connection import close_factory, make_factory

__all__ = ["denied_access"]


def _user(config: LookupConfig) -> str:
    """The ACL user the connection logs in as (``default`` when none is named)."""
    if config.redis_username:
        return config.redis_username
    creds = urlsplit(config.redis_url).netloc.rpartition("@")[0]
    return unquote(creds.partition(":")[0]) or "default"


def _reach(client: redis.Redis, user: str) -> str:
    """The key patterns ``user`` may reach, as far as it may read them."""
    try:
        with translate_redis_errors(f"reading ACL GETUSER {user}"):
            rules = client.acl_getuser(user)
    except BrokerLookupError:
        return "its own rules are unreadable to it (ACL GETUSER denied), so not known here"
    keys: object = rules.get("keys") if isinstance(rules, dict) else None
    shown = [k.decode() if isinstance(k, bytes) else str(k) for k in _listed(keys)]
    return f"it may reach keys {' '.join(shown)}" if shown else "it may reach no key"


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else []


def denied_access(config: LookupConfig, metadata: LookupMetadata, timeout_s: float) -> str | None:
    """None if the rank's user may read its own lease key; else the line to exit with.

    A GET of the rank's owner key, the first key it touches: the ACL checks the key
    pattern (and the command) without the key having to exist. Any other failure is
    left to the rank's own handling (it is not an access problem).
    """
    keys = KeySpace(metadata.engine_id)
    key = keys.owner(rank_role(metadata.worker_id))
    wait_s = min(timeout_s, config.socket_timeout_ms / 1000)
    factory = make_factory(config, "bl-worker-startup", socket_timeout_s=wait_s)
    client = factory()
    try:
        try:
            with translate_redis_errors(f"reading {key}"):
                client.get(key)
            return None
        except NoPermission as exc:
            denied = exc
        except BrokerLookupError:
            return None
        user = _user(config)
        configured = metadata.configured_engine_id or metadata.engine_id
        return (
            f"Redis user {user!r} may not access this engine's keys ({keys.pattern}): "
            f"{denied}; {_reach(client, user)}. Fix: give rank {metadata.worker_id} a user "
            f"scoped to engine {configured!r} (`broker-lookup acl --engine-id {configured} "
            f"--role worker`, or --role vllm for a vLLM pod) and set "
            f"{env_name('redis_username')}/{env_name('redis_password')} to it"
        )
    finally:
        client.close()
        close_factory(factory)
