"""A vLLM instance's ranks serve ``<engine_id>@<instance>``; their heartbeat still names the
engine id the operator configured, so ``inspect`` and metrics can show it."""

from __future__ import annotations

from faultkit import beat, config, ready
from helpers import Backend

from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.keys import KeySpace, instance_engine_id
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer


def test_the_heartbeat_names_the_configured_engine_id(backend: Backend, engine_id: str) -> None:
    derived = instance_engine_id(engine_id, "3f2a1")
    meta = LookupMetadata(engine_id=derived, world_size=1, configured_engine_id=engine_id)
    server = RedisAsyncLookupServer(
        StubEngine(), meta, config(), connection_factory=backend.factory
    )
    plain = RedisAsyncLookupServer(
        StubEngine(),
        LookupMetadata(engine_id=engine_id, world_size=1),
        config(),
        connection_factory=backend.factory,
    )
    try:
        ready(server, plain)
        conn = backend.factory()
        assert beat(conn, KeySpace(derived).heartbeat(0))["configured_engine_id"] == engine_id
        assert "configured_engine_id" not in beat(conn, KeySpace(engine_id).heartbeat(0))
    finally:
        server.close()
        plain.close()
