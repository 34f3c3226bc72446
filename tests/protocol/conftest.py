"""Fixtures of the protocol tests: a client and worker ranks on the ``backend`` under test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import Backend

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from workers.server import RedisAsyncLookupServer

FAST = {
    "lookup_timeout_ms": 1500,
    "block_ms": 50,
    "heartbeat_interval_ms": 100,
    "heartbeat_ttl_ms": 1500,  # generous: a loaded CI box must not see false dead ranks
    "chunk_size": 4,
    "key_grace_ms": 2000,
}


@pytest.fixture
def config() -> LookupConfig:
    return LookupConfig(**FAST)  # type: ignore[arg-type]


@pytest.fixture
def make_server(
    backend: Backend, engine_id: str, config: LookupConfig
) -> Iterator[Callable[..., RedisAsyncLookupServer]]:
    made: list[RedisAsyncLookupServer] = []

    def make(engine: Any, rank: int = 0, world_size: int = 1, **overrides: Any):
        cfg = LookupConfig(**{**FAST, **overrides}) if overrides else config
        meta = LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=rank)
        server = RedisAsyncLookupServer(engine, meta, cfg, connection_factory=backend.factory)
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


@pytest.fixture
def make_client(
    backend: Backend, engine_id: str, config: LookupConfig
) -> Iterator[Callable[..., RedisAsyncLookupClient]]:
    made: list[RedisAsyncLookupClient] = []

    def make(world_size: int = 1, cls: type = RedisAsyncLookupClient, **overrides: Any):
        cfg = LookupConfig(**{**FAST, **overrides}) if overrides else config
        meta = LookupMetadata(engine_id=engine_id, world_size=world_size)
        client = cls(cfg, meta, connection_factory=backend.factory)
        made.append(client)
        return client

    yield make
    for c in made:
        c.close()
