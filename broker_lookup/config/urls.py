"""The Redis URL: the schemes this project connects to, and how a URL is shown.

The one owner of the scheme set: the config accepts a ``redis_url`` only with one of
:class:`Scheme`'s prefixes, and the transport picks how to connect by :func:`url_scheme`.
A new scheme is a member here plus its branch in ``transport.connection``.
"""

from __future__ import annotations

import enum
import re
from urllib.parse import parse_qsl, unquote, urlsplit

__all__ = [
    "MultiHostUrl",
    "Scheme",
    "given_credentials",
    "redact_url",
    "scheme_hint",
    "url_problem",
    "url_scheme",
]


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

    @property
    def options(self) -> tuple[str, ...]:
        """The ``?option=true|false`` a multi-host URL of this scheme takes."""
        return {"redis+sentinel": ("ssl", "sentinel_auth"), "redis+cluster": ("ssl",)}.get(
            self.value, ()
        )


_BY_VALUE = {s.value: s for s in Scheme}
_NETLOC_END = re.compile(r"[/?#]")
#: A query option that carries a secret (redis-py reads ``?password=`` on every scheme):
#: its key, then its value up to the next option.
_SECRET_OPTION = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


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
    unencoded ``@`` inside a password does not leave its tail in a log line. A query
    option naming a password (``?password=``, which redis-py reads too) is hidden alike.
    """
    return _SECRET_OPTION.sub(r"\1***", _redact_netloc(url))


def _redact_netloc(url: str) -> str:
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


class MultiHostUrl:
    """The parts of ``redis+sentinel://`` and ``redis+cluster://`` URLs.

    ``[user[:password]@]host:port[,host:port...][/path...][?option=value&...]``; hosts
    may be IPv6 in brackets. Options are booleans (``true``/``false``, ``1``/``0``).

    >>> MultiHostUrl("redis+cluster://h1:7000,h2:7000?ssl=true", ("ssl",)).hosts
    [('h1', 7000), ('h2', 7000)]

    Raises:
        ValueError: A host is not ``host:port``, a port is out of range or an option is
            unknown or not a boolean; the message shows no secret.
    """

    def __init__(self, url: str, options: tuple[str, ...]) -> None:
        parts = urlsplit(url)
        creds, _, hostpart = parts.netloc.rpartition("@")
        user, _, password = creds.partition(":") if creds else ("", "", "")
        self.user = unquote(user) or None
        self.password = unquote(password) or None
        self.hosts: list[tuple[str, int]] = []
        # Errors name a host by its place, never by its text: a password with an unencoded
        # '/' leaves its head in the netloc, where it would be read as a host.
        for n, item in enumerate(hostpart.split(","), 1):
            host, _, port = item.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"host {n} is not host:port")
            _check_port(port, f"host {n}")
            self.hosts.append((host.strip("[]"), int(port)))
        self.path = [unquote(p) for p in parts.path.split("/") if p]
        self.flags: dict[str, bool] = {}
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            if key not in options or value.lower() not in _BOOLS:
                # An unknown option's value is never shown: it may be a secret
                # (``?password=``, which these schemes do not read).
                shown = f"{key}={value!r}" if key in options else key
                raise ValueError(
                    f"option {shown} is not one of {', '.join(options) or '(none)'} "
                    "with a value of true or false"
                )
            self.flags[key] = _BOOLS[value.lower()]


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_MAX_PORT = 65535


def url_problem(url: str) -> str | None:
    """What makes ``url`` unusable, said without its secrets; None if nothing does.

    Checks what a connection would otherwise fail on later with a traceback: the scheme,
    a port out of range, a multi-host URL's hosts and options.

    >>> url_problem("redis://cache:99999/0")
    'the port of the host is out of range 0-65535'
    """
    scheme = url_scheme(url)
    if scheme is None:
        return "must start with one of " + ", ".join(s.prefix for s in Scheme) + scheme_hint(url)
    try:
        if scheme.multi_host:
            MultiHostUrl(url, scheme.options)
        elif scheme is not Scheme.UNIX:
            netloc = urlsplit(url).netloc.rpartition("@")[2]
            _, colon, port = ("", "", "") if netloc.endswith("]") else netloc.rpartition(":")
            if colon and port:  # an empty port is the default port, as redis-py reads it
                _check_port(port, "the host")
    except ValueError as exc:
        return str(exc)
    return None


def _check_port(port: str, where: str) -> None:
    if not port.isdigit():
        raise ValueError(f"the port of {where} is not a number")
    if int(port) > _MAX_PORT:
        raise ValueError(f"the port of {where} is out of range 0-{_MAX_PORT}")


def given_credentials(url: str) -> tuple[bool, bool]:
    """Whether ``url`` gives (a user, a password): in its netloc or as ``?password=``.

    Never raises: a URL urllib cannot split gives neither (the config refuses it).
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return False, False
    creds, at, _ = parts.netloc.rpartition("@")
    user, colon, password = creds.partition(":")
    in_query = any(k == "password" for k, _ in parse_qsl(parts.query))
    return bool(at and user), bool((at and colon and password) or in_query)
