"""Fixtures of the system tests: rank processes, clients and fault proxies, always cleaned up.

Rank processes are real ``python -m workers`` children (the shipped runner), so a
SIGKILL, SIGSTOP or SIGTERM lands on the same code a pod runs. Every child is killed
when the fixture ends, whatever the test did.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import MakeLookupClient, StartRank
from helpers import RealServer

from broker_lookup.tools.embedded import EmbeddedServer
from faultproxy.proxy import FaultProxy


@pytest.fixture
def rank_procs(tmp_path: Path) -> Iterator[StartRank]:
    """Start rank processes: ``start(url, engine_id, world_size, rank, prompts, **config)``."""
    with StartRank(tmp_path) as start:
        yield start


@pytest.fixture
def clients() -> Iterator[MakeLookupClient]:
    """``make(config, engine_id, world_size, cls=...)``; every client is closed at the end."""
    with MakeLookupClient() as make:
        yield make


@pytest.fixture
def fault_proxy(real_server: RealServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's real server; stopped after the test."""
    with FaultProxy.for_url(real_server.url).start() as proxy:
        yield proxy


@pytest.fixture
def fresh_fault_proxy(fresh_real_server: EmbeddedServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of a private server (``fresh_real_server``); stopped after."""
    with FaultProxy.for_url(fresh_real_server.url).start() as proxy:
        yield proxy
