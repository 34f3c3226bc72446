"""Helpers shared by every test suite: waiting without sleeping, and the backend handle.

Importable from any test as ``from helpers import Backend, wait_until``: pytest puts
``tests/support`` on ``sys.path`` (``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol, Self, TypeVar

import fakeredis
import pytest
import redis
from redis.typing import EncodableT, FieldT

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import LookupRequest, request_fields
from broker_lookup.tools.embedded import EmbeddedServer

__all__ = [
    "Backend",
    "Made",
    "RealServer",
    "command",
    "engine_keys",
    "epoch_ms",
    "holds_for",
    "lookup_request",
    "request_entry",
    "stream_entries",
    "stream_fields",
    "text",
    "wait_until",
]


def gone(pid: int) -> bool:
    """Whether no process ``pid`` exists any more (signal 0 finds none)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_until(
    predicate: Callable[[], object],
    timeout: float = 5.0,
    interval: float = 0.005,
    message: str = "",
    *,
    ignoring: tuple[type[Exception], ...] = (),
    process: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> object:
    """Poll ``predicate`` until it returns something truthy, and return that.

    Tests synchronise with this, never with a bare ``time.sleep``. ``ignoring``: errors
    of ``predicate`` that count as a falsy answer (a server still starting). ``process``:
    a child the wait is for; its exit fails the wait at once, with ``log``'s tail.

    Raises:
        AssertionError: ``predicate`` stayed falsy for ``timeout`` seconds, or
            ``process`` exited; the message says what was awaited and the last value seen.
    """
    deadline = time.monotonic() + timeout
    what = message or getattr(predicate, "__name__", repr(predicate))
    while True:
        try:
            value = predicate()
        except ignoring as exc:
            value = exc
        if value and not isinstance(value, Exception):
            return value
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log is not None else ""
            raise AssertionError(f"exited {process.returncode} before {what}:\n{tail}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g}s for {what}; last value: {value!r}")
        time.sleep(interval)


def holds_for(
    predicate: Callable[[], object], seconds: float, interval: float = 0.1, message: str = ""
) -> None:
    """Assert ``predicate`` stays truthy, polled every ``interval``, for ``seconds``: for
    what must last (a key that must not expire while its engine lives).

    Raises:
        AssertionError: ``predicate`` was falsy once; the message says when and what.
    """
    started = time.monotonic()
    while True:
        value = predicate()
        elapsed = time.monotonic() - started
        if not value:
            what = message or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"{what} stopped holding after {elapsed:.1f}s: {value!r}")
        if elapsed >= seconds:
            return
        time.sleep(interval)


def lookup_request(
    lookup_id: str = "a",
    gen: int = 1,
    *,
    chunks: int = 2,
    expected: Sequence[int] = (0,),
    **fields: Any,
) -> LookupRequest:
    """A request for ``chunks`` chunks of 4 tokens (hashes 1, 2, ...) from the ranks
    ``expected``, with no deadline: ``fields`` sets any other field (``deadline_ms``,
    ``budget_ms``...) or replaces one of these."""
    values: dict[str, Any] = {
        "hashes": list(range(1, chunks + 1)),
        "offsets": [4] * chunks,
        "expected": list(expected),
        "deadline_ms": 0,
        "tokens": 4 * chunks,
        **fields,
    }
    return LookupRequest(lookup_id=lookup_id, gen=gen, **values)


def request_entry(request: LookupRequest) -> dict[FieldT, EncodableT]:
    """``request`` as the fields of its stream entry, as ``XADD`` takes them."""
    return stream_fields(request_fields(request))


def epoch_ms() -> int:
    """Now, in milliseconds since the epoch: the clock of ``deadline_ms``."""
    return int(time.time() * 1000)


def engine_keys(conn: redis.Redis, engine_id: str) -> dict[str, int]:
    """Every key of ``engine_id`` on ``conn``'s server, with its PTTL (-1: no TTL); a key
    that expired between the SCAN and its PTTL is left out."""
    pattern = KeySpace(engine_id).pattern
    found = sorted({text(k) for k in conn.scan_iter(match=pattern, count=500)})
    ttls = {key: int(conn.pttl(key)) for key in found}
    return {key: ttl for key, ttl in ttls.items() if ttl != -2}


def text(value: object) -> str:
    """A reply of redis-py (bytes or str) as str; fails the test on anything else (nil)."""
    if isinstance(value, bytes):
        return value.decode()
    assert isinstance(value, str), f"expected a string reply, got {value!r}"
    return value


def stream_fields(
    fields: Mapping[str, bytes | str | int | float] | Mapping[bytes, bytes],
) -> dict[FieldT, EncodableT]:
    """``fields`` as the type ``XADD`` takes (redis-py's dict is invariant in its keys)."""
    out: dict[FieldT, EncodableT] = {}
    for name, value in fields.items():
        out[name] = value
    return out


def command(conn: redis.Redis | redis.client.Pipeline, *args: object) -> Any:
    """A raw command (``INCR``, not redis-py's ``INCRBY``; ``ACL``...): redis-py leaves
    ``execute_command`` untyped."""
    return conn.execute_command(*args)  # type: ignore[no-untyped-call]


def stream_entries(reply: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """An ``XRANGE`` reply of a bytes client, typed; fails the test on nil."""
    assert isinstance(reply, list), f"expected stream entries, got {reply!r}"
    return [(entry_id, dict(fields or {})) for entry_id, fields in reply]


@dataclass(frozen=True)
class RealServer:
    """The session's real server: ``kind`` is ``"external"`` (env URL) or ``"embedded"``."""

    url: str
    kind: Literal["external", "embedded"]
    server: EmbeddedServer | None = None  #: the process, when embedded; never restart it


@dataclass
class Backend:
    """One Redis backend a protocol test runs against: fakeredis or a real server.

    Attributes:
        kind: ``"fake"`` or ``"real"``.
        url: The real server's URL; None for fake.
        fake_server: The test's own ``fakeredis.FakeServer``; set
            ``fake_server.connected = False`` to simulate losing the connection. None for real.
    """

    kind: Literal["fake", "real"]
    url: str | None = None
    fake_server: fakeredis.FakeServer | None = None
    _clients: list[redis.Redis] = field(default_factory=list, repr=False)

    @property
    def fake(self) -> fakeredis.FakeServer:
        """The fake server (the ``fake`` leg only): ``backend.fake.connected = False``."""
        assert self.fake_server is not None, "a fake-only test ran on a real server"
        return self.fake_server

    def factory(self, **kwargs: Any) -> redis.Redis:
        """A NEW client each call (extra kwargs such as ``decode_responses`` pass through).

        Every client made here is closed when the test ends.
        """
        client: redis.Redis
        if self.kind == "fake":
            client = fakeredis.FakeRedis(server=self.fake_server, **kwargs)
        else:
            assert self.url is not None
            client = redis.Redis.from_url(self.url, **kwargs)
        self._clients.append(client)
        return client

    def close(self) -> None:
        """Close every client :meth:`factory` made (the fixture calls this)."""
        for client in self._clients:
            client.close()
        self._clients.clear()


class Closes(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closes)


class Made:
    """What a factory fixture made, each closed in the order made when it ends.

    The fixture is ``with Made() as made: yield make``, ``make`` returning
    ``made.keep(thing)``; a factory class subclasses it, its ``__call__`` the ``make``.
    """

    def __init__(self) -> None:
        self._made: list[Closes] = []

    def keep(self, thing: C) -> C:
        """``thing``, to be closed when the fixture ends."""
        self._made.append(thing)
        return thing

    def close(self) -> None:
        for thing in self._made:
            thing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def optional_extension(module: str, build: str = "pip install -e .") -> ModuleType:
    """The optional C extension ``module`` (dotted name); skips the test where it was not
    built, except under ``CI``, which must build every one (with ``build``)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        name = module.rpartition(".")[2]
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the C extension {name} ({build})")
        pytest.skip(f"the {name} extension is not built")
