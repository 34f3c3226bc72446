"""The one exception tree of broker-lookup.

::

    BrokerLookupError                 root: catch this to catch everything we raise
    ├── ConfigError (ValueError)      a bad config value; names field, value, its origin
    ├── InvalidRequest (ValueError)   a lookup the caller asked for breaks a documented limit
    ├── MalformedMessage              a wire entry could not be decoded; keeps ``.payload``
    ├── BrokerUnavailable             Redis unreachable or timed out (translated here)
    │   └── AuthFailed                Redis refused our credentials: a config error, not retried
    ├── BrokerResponseError           Redis answered with an error we do not handle
    │   ├── NoGroup                   a consumer group is gone (NOGROUP): re-create it
    │   └── NoPermission              the ACL denies this user a command or key (NOPERM)
    ├── UnknownScheme (ValueError)    an external lookup URI names a scheme nobody registered
    ├── UsageError                    a bad flag, env var or preload file of ``python -m workers``
    └── BenchError (RuntimeError)     ``broker-lookup bench`` could not run

``UsageError`` lives in ``workers.runtime.rank`` and ``BenchError`` in
``benchmarks.bench.measure``, next to the code that raises them.

Redis exceptions never escape the package: :func:`translate_redis_errors` maps them
at the boundary, always ``from`` the original so the cause stays in the traceback.
"""

from __future__ import annotations

from types import TracebackType
from typing import NoReturn

import redis.exceptions as rexc

__all__ = [
    "AUTH_HINT",
    "REDIS_ERRORS",
    "AuthFailed",
    "BrokerLookupError",
    "BrokerResponseError",
    "BrokerUnavailable",
    "ConfigError",
    "InvalidRequest",
    "MalformedMessage",
    "NoGroup",
    "NoPermission",
    "UnknownScheme",
    "raise_translated",
    "translate_redis_errors",
    "translated",
]


class BrokerLookupError(Exception):
    """Root of every error broker-lookup raises."""


class ConfigError(BrokerLookupError, ValueError):
    """A configuration value is invalid; the message names the field, the value and where
    it came from (a flag, a file, an environment variable)."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        shown: str = "",
        problem: str = "",
        other: str | None = None,
        other_shown: str = "",
    ) -> None:
        super().__init__(message)
        #: The field at fault, if one is, with its value as shown (secrets redacted) and
        #: what is wrong with it: a loader that knows where the value came from says so.
        self.field = field
        self.shown = shown
        self.problem = problem
        #: The second field of a combination refused (its value can't go with the
        #: first's), with its value as shown: the loader names where it came from too.
        self.other = other
        self.other_shown = other_shown


class InvalidRequest(BrokerLookupError, ValueError):
    """A lookup request breaks a documented limit (id length, chunk count, configs size)."""


class MalformedMessage(BrokerLookupError):
    """A stream entry could not be decoded into a known message."""

    def __init__(self, reason: str, payload: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.payload = payload


class BrokerUnavailable(BrokerLookupError):
    """The Redis server could not be reached, or a call timed out."""


class AuthFailed(BrokerUnavailable):
    """Redis refused the password or user (WRONGPASS, NOAUTH): waiting will not help."""


#: How to give the credentials, appended to every :class:`AuthFailed` message. The names
#: are ``config.env_name("redis_password")`` and ``("redis_username")`` (config is a layer
#: above this module; a test keeps them equal).
AUTH_HINT = (
    "set BROKER_LOOKUP_REDIS_PASSWORD (and BROKER_LOOKUP_REDIS_USERNAME for an ACL user), "
    "or give them in the URL: redis://[USER]:PASSWORD@HOST:PORT/0"
)


class BrokerResponseError(BrokerLookupError):
    """The Redis server answered with an error this package does not handle itself."""


class NoGroup(BrokerResponseError):
    """A stream command named a consumer group the server does not have (Redis's NOGROUP)."""


class NoPermission(BrokerResponseError):
    """Redis's ACL denies this user a command or a key (NOPERM): waiting will not help."""


class UnknownScheme(BrokerLookupError, ValueError):
    """An external lookup URI uses a scheme that no plugin registered."""


class translate_redis_errors:  # lower case: it reads as the function it replaced
    """Translate redis-py exceptions raised inside the block into our tree.

    ``what`` says what was being done, e.g. ``"submitting lookups"``; it ends up in
    the message so a log line is actionable without a traceback. A class, not a
    ``@contextmanager`` generator: hot loops enter one per turn, and the generator's
    machinery costs four calls more each time.
    """

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        ours = translated(exc, self._what)
        if ours is not None:
            raise ours from exc


#: What :func:`translated` maps: a hot loop catches these around its whole turn and calls
#: :func:`raise_translated`, which costs nothing while no error is raised (the context
#: manager costs three calls each time it is entered).
REDIS_ERRORS = (rexc.RedisError, rexc.RedisClusterException)


def translated(exc: BaseException, what: str) -> BrokerLookupError | None:
    """Our exception for redis-py's ``exc`` raised while doing ``what``; None for any
    other exception (it propagates as it is). Raise the result ``from exc``."""
    if isinstance(exc, rexc.AuthenticationError):  # a ConnectionError: test it first
        return AuthFailed(f"Redis refused the credentials while {what} ({exc}): {AUTH_HINT}")
    if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError)):
        return BrokerUnavailable(f"Redis unavailable while {what}: {exc}")
    if isinstance(exc, rexc.InvalidResponse):  # the URL's port is some other server's
        return BrokerUnavailable(
            f"no Redis answered while {what}: the server does not speak the Redis protocol "
            f"({exc}); check redis_url's host and port"
        )
    if isinstance(exc, (rexc.RedisClusterException, rexc.ClusterError)):
        # Redis Cluster: slot not covered, CLUSTERDOWN, redirects exhausted ("TTL
        # exhausted"), no node reachable. RedisClusterException is no RedisError, and
        # ClusterError no ConnectionError: untranslated, they would end a loop thread.
        return BrokerUnavailable(f"Redis Cluster unavailable while {what}: {exc}")
    if isinstance(exc, rexc.NoPermissionError):
        return NoPermission(f"Redis denied it while {what}: {exc}")
    if isinstance(exc, rexc.ResponseError):
        # Redis 7 answers a blocked XREADGROUP whose stream was deleted (expired, flushed)
        # with UNBLOCKED, not NOGROUP: the group went with the stream all the same.
        if str(exc).startswith(("NOGROUP", "UNBLOCKED the stream key no longer exists")):
            return NoGroup(f"consumer group missing while {what}: {exc}")
        return BrokerResponseError(f"Redis error while {what}: {exc}")
    return None


def raise_translated(exc: BaseException, what: str) -> NoReturn:
    """Raise our exception for ``exc`` (from it), or ``exc`` itself where we have none:
    ``except REDIS_ERRORS as exc: raise_translated(exc, "doing what")``."""
    ours = translated(exc, what)
    if ours is None:
        raise exc
    raise ours from exc
