"""Hash fingerprints: processes that hash differently are named loudly, on both backends."""

from __future__ import annotations

import json
import logging
import time

import pytest
from faultkit import CHUNK, MakeClient, MakeServer
from helpers import Backend, text, wait_until
from redis import Redis

from broker_lookup.protocol import fingerprint
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport import fingerprint as fingerprints

CLIENT = fingerprint.member("client")
RANK0 = fingerprint.member("rank0")


def published(redis: Redis, engine_id: str, *members: str) -> bool:
    names = {text(m) for m in redis.hkeys(KeySpace(engine_id).fingerprint)}
    return set(members) <= names


def test_same_hashing_no_mismatch(
    make_server: MakeServer,
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    redis = backend.factory()
    server = make_server(StubEngine())
    wait_until(lambda: published(redis, engine_id, RANK0), message="server fingerprint")
    client = make_client()
    assert client.fingerprint.mismatches == []
    assert published(redis, engine_id, RANK0, CLIENT)
    assert server.fingerprint.run() == []
    key = KeySpace(engine_id).fingerprint
    assert 0 < redis.pttl(key) <= client.config.engine_ttl_ms
    value = json.loads(text(redis.hget(key, CLIENT)))
    assert value.pop("ts_ms") > 0
    assert value == client.hasher.fingerprint()
    assert "HASH MISMATCH" not in caplog.text


def test_other_chunk_size_is_a_loud_mismatch(
    make_server: MakeServer,
    make_client: MakeClient,
    backend: Backend,
    engine_id: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR)
    redis = backend.factory()
    assert CHUNK == 4  # the client's; the rank below hashes in chunks of 8
    server = make_server(StubEngine(), chunk_size=8)
    wait_until(lambda: published(redis, engine_id, RANK0), message="server fingerprint")
    client = make_client()
    assert client.fingerprint.mismatches == [RANK0]
    errors = [r.getMessage() for r in caplog.records if "HASH MISMATCH" in r.getMessage()]
    assert errors and RANK0 in errors[0] and engine_id in errors[0]
    assert '"chunk_size": 8' in errors[0] and '"chunk_size": 4' in errors[0]
    # The worker sees it too, from its side.
    assert server.fingerprint.run() == [CLIENT]


def test_stale_members_are_dropped_and_garbage_is_a_mismatch(
    backend: Backend, engine_id: str
) -> None:
    redis = backend.factory()
    keys = KeySpace(engine_id)
    own = ChunkedTokenHasher().fingerprint()
    old = int(time.time() * 1000) - fingerprint.STALE_MS - 1000
    redis.hset(keys.fingerprint, "rank9:gone:1", json.dumps({**own, "chunk_size": 1, "ts_ms": old}))
    redis.hset(keys.fingerprint, "rank8:odd:2", b"\xff not json")
    redis.hset(
        keys.fingerprint, "rank7:same:3", json.dumps({**own, "ts_ms": int(time.time() * 1000)})
    )
    assert fingerprints.check(redis, keys, own) == ["rank8:odd:2"]
    names = {text(m) for m in redis.hkeys(keys.fingerprint)}
    assert names == {"rank8:odd:2", "rank7:same:3"}


@pytest.mark.parametrize("backend", ["fake"], indirect=True)  # connection loss: fakeredis
def test_publisher_never_raises(
    backend: Backend, engine_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend.fake.connected = False
    publisher = fingerprints.Publisher(
        KeySpace(engine_id), "client", ChunkedTokenHasher(), backend.factory, ttl_ms=60_000
    )
    assert publisher.run() == []
    assert "fingerprint publish/check failed" in caplog.text
    publisher.close()
