"""The Redis URL: the schemes this project connects to, and how a URL is shown.

The one owner of the scheme set: the config accepts a ``redis_url`` only with one of
:class:`Scheme`'s prefixes, and the transport picks how to connect by :func:`url_scheme`.
A new scheme is a member here plus its branch in ``transport.connection``.
"""

from __future__ import annotations

import enum
import re

__all__ = ["Scheme", "redact_url", "scheme_hint", "url_scheme"]


class Scheme(enum.StrEnum):
    """A supported ``redis_url`` scheme (the text before ``://``).

    >>> url_scheme("rediss://cache:6380/0") is Scheme.REDISS
    True
    """

    REDIS = "redis"  #: plain TCP
    REDISS = "rediss"  #: TLS (``ssl_*`` fields: CA, client certificate)
    UNIX = "unix"  #: a unix socket, ``unix:///path?db=0``
    SENTINEL = "redis+sentinel"  #: sentinels, following a service's master through failovers
    CLUSTER = "redis+cluster"  #: Redis Cluster entry points, for slot-map discovery

    @property
    def prefix(self) -> str:
        """How a URL of this scheme starts: ``redis+sentinel://``."""
        return f"{self.value}://"

    @property
    def multi_host(self) -> bool:
        """Whether the URL lists several ``host:port`` (sentinels or cluster nodes)."""
        return self in (Scheme.SENTINEL, Scheme.CLUSTER)


_BY_VALUE = {s.value: s for s in Scheme}
_NETLOC_END = re.compile(r"[/?#]")


def url_scheme(url: str) -> Scheme | None:
    """The scheme of ``url``; None where it has none this project supports."""
    head, sep, _ = url.partition("://")
    return _BY_VALUE.get(head) if sep else None


def scheme_hint(url: str) -> str:
    """``" (e.g. redis://HOST:PORT/0)"`` for a URL given without its scheme, else ``""``."""
    if "://" in url or not url:
        return ""
    return f" (e.g. {redact_url(Scheme.REDIS.prefix + url.rstrip('/'))}/0)"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``; never raises.

    The password runs to the netloc's last ``@``, as redis-py (``urllib``) reads it, so an
    unencoded ``@`` inside a password does not leave its tail in a log line.
    """
    head, sep, rest = url.partition("://")
    found = _NETLOC_END.search(rest)
    cut = rest.rfind("@", 0, found.start() if found else len(rest))
    if cut < 0:
        # No '@' in the netloc: a password holding an unencoded '/', '?' or '#' would
        # show through, so hide up to the last '@' anywhere (at worst too much is hidden).
        cut = rest.rfind("@")
    user, colon, _ = rest[: max(cut, 0)].partition(":")
    if not (sep and cut >= 0 and colon):
        return url
    return f"{head}://{user}:***{rest[cut:]}"
