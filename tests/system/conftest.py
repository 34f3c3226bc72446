"""Fixtures of the system tests: rank processes, clients and fault proxies, always cleaned up.

Rank processes are real ``python -m workers`` children (the shipped runner), so a
SIGKILL, SIGSTOP or SIGTERM lands on the same code a pod runs. Every child is killed
in the fixture's ``finally``, whatever the test did.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import FAST, MakeLookupClient, RankProcess, StartRank
from helpers import RealServer

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.processes import child_env, long_options
from broker_lookup.tools.embedded import EmbeddedServer
from faultproxy.proxy import FaultProxy


@pytest.fixture
def rank_procs(tmp_path: Path) -> Iterator[StartRank]:
    """Start rank processes: ``start(url, engine_id, world_size, rank, prompts, **config)``."""
    made: list[RankProcess] = []
    started: list[tuple[str, int]] = []

    def start(
        url: str,
        engine_id: str,
        world_size: int,
        rank: int,
        prompts: list[dict[str, Any]],
        load_delay_ms: float = 0.0,
        options: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> RankProcess:
        # A second process for one rank (an ownership test) gets files of its own.
        seen = started.count((engine_id, rank))
        started.append((engine_id, rank))
        tag = f"{engine_id}-{rank}" + (f"-{seen}" if seen else "")
        preload = tmp_path / f"preload-{tag}.json"
        preload.write_text(json.dumps({"prompts": prompts}))
        values = {**FAST, **overrides, "redis_url": url}
        extra = {env_name(k): str(v) for k, v in values.items()}
        flags = {
            "engine-id": engine_id,
            "world-size": world_size,
            "rank": rank,
            "metrics-port": 0,
            "preload": preload,
            "load-delay-ms": load_delay_ms,
            "disk-dir": tmp_path / f"disk-{tag}",
            "connect-timeout": 30,
            "log-level": "INFO",
            **(options or {}),
        }
        argv = [sys.executable, "-m", "workers", *long_options(flags)]
        log = tmp_path / f"rank-{tag}.log"
        made.append(RankProcess(argv, child_env(os.environ, extra), log))
        return made[-1]

    try:
        yield start
    finally:
        for proc in made:
            proc.cleanup()


@pytest.fixture
def clients() -> Iterator[MakeLookupClient]:
    """``make(config, engine_id, world_size, cls=...)``; every client is closed at the end."""
    made: list[RedisAsyncLookupClient] = []

    def make(
        cfg: LookupConfig,
        engine_id: str,
        world_size: int = 1,
        cls: type[RedisAsyncLookupClient] = RedisAsyncLookupClient,
    ) -> RedisAsyncLookupClient:
        client = cls(cfg, LookupMetadata(engine_id=engine_id, world_size=world_size))
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            client.close()


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
