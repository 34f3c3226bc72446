"""What a least-privilege ACL user may not read, said in one line.

The tools run as the users the chart and ``broker-lookup acl`` create: ``operator``
(every engine) or ``operator-<engine>`` (one engine and its vLLM instances) for
``inspect`` and ``doctor``, ``exporter`` for the exporter. A read the user may not make
(Redis's ``NOPERM``) is not a crash and not a failed check: the tool says which user,
what it could not do and how to fix it, skips that part and goes on with the rest.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import redis.exceptions as rexc

from broker_lookup.config import LookupConfig

__all__ = ["acting_user", "denial", "denied_line"]


def acting_user(config: LookupConfig) -> str | None:
    """The ACL user ``config`` logs in as (its setting, else the URL's); None: default."""
    if config.redis_username:
        return config.redis_username
    try:
        name = urlsplit(config.redis_url).username
    except ValueError:
        return None
    return unquote(name) if name else None


def denial(exc: BaseException) -> rexc.NoPermissionError | None:
    """Redis's refusal behind ``exc`` (raw, or translated ``from`` it); None for any other
    error."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, rexc.NoPermissionError):
            return seen
        seen = seen.__cause__
    return None


def denied_line(user: str | None, what: str, refusal: BaseException) -> str:
    """One line: ``user`` may not do ``what`` (Redis said ``refusal``), and the fix."""
    who = f"user {user}" if user else "the default user"
    return (
        f"{who} may not {what} (Redis: {refusal}): run as a user whose ACL grants it: "
        "operator (every engine) or operator-<engine> (that engine), as "
        "`broker-lookup acl --role operator [--engine-id E]` prints"
    )
