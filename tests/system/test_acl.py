"""deploy/users.acl on a real server: the protocol runs end to end as ``scheduler`` and
``worker`` (lookups, cancels, timeouts, partial answers, dead letters) and ``inspect``
as ``operator``, nothing it does is denied (``ACL LOG`` stays empty), and what it does
not need is: FLUSHALL, CONFIG, KEYS, EVAL, another engine's keys (so one engine's
credential cannot forge another's hits), scripts touching such keys, and every
connection that does not log in (``default`` is off).

The shipped users serve the chart's default engine, ``vllm-engine``, and its vLLM
instances (``vllm-engine@<instance>``): each test runs as such an instance."""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from faultkit import alive
from helpers import command, wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_lookup import ChunkedTokenHasher, FleetClient
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.ops.inspect import run_inspect
from broker_lookup.protocol.keys import KeySpace, instance_engine_id
from broker_lookup.stub_engine import StubEngine
from broker_lookup.tools.embedded import EmbeddedServer
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

pytestmark = pytest.mark.real

ACL_FILE = Path(__file__).resolve().parents[2] / "deploy" / "users.acl"
ADMIN = ("bl-test-admin", "admin-only-in-this-test")
FAST: dict[str, Any] = {
    "lookup_timeout_ms": 1500,
    "block_ms": 50,
    "heartbeat_interval_ms": 100,
    "heartbeat_ttl_ms": 1000,
    "chunk_size": 4,
    "key_grace_ms": 2000,
}
TOKENS = list(range(40))
#: The engine the shipped users are scoped to (deploy/users.acl, the chart's default).
SHIPPED_ENGINE = "vllm-engine"


@pytest.fixture
def engine_id() -> str:
    """A fresh vLLM instance of the shipped engine: within the users' scope, and unique."""
    return instance_engine_id(SHIPPED_ENGINE, uuid.uuid4().hex[:5])


def acl_users() -> dict[str, list[str]]:
    """User name -> its rules, as the file has them."""
    users = {}
    for line in ACL_FILE.read_text().splitlines():
        words = line.split()
        if words and words[0] == "user":
            users[words[1]] = words[2:]
    return users


def password(user: str) -> str:
    return next(r[1:] for r in acl_users()[user] if r.startswith(">"))


@pytest.fixture(scope="module")
def _users_server() -> Iterator[tuple[EmbeddedServer, redis.Redis]]:
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None  # CI: Redis 7.0 too
    with EmbeddedServer(binary=binary, password="bootstrap-only") as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port, password="bootstrap-only")
        command(admin, "ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
        command(admin, "AUTH", *ADMIN)
        for user, rules in acl_users().items():
            command(admin, "ACL", "SETUSER", user, "reset", *rules)
        try:
            yield server, admin
        finally:
            admin.close()


@pytest.fixture
def acl_server(
    _users_server: tuple[EmbeddedServer, redis.Redis],
) -> tuple[EmbeddedServer, redis.Redis]:
    """A server running exactly the file's users (plus a test admin), ACL LOG cleared."""
    command(_users_server[1], "ACL", "LOG", "RESET")
    return _users_server


def _config(server: EmbeddedServer, user: str, **overrides: Any) -> LookupConfig:
    return LookupConfig(
        redis_url=f"redis://127.0.0.1:{server.port}/0",
        redis_username=user,
        redis_password=password(user),
        **{**FAST, **overrides},
    )


def _as(server: EmbeddedServer, user: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, username=user, password=password(user))


def test_file_has_least_privilege_users() -> None:
    users = acl_users()
    assert set(users) == {"default", "scheduler", "worker", "vllm", "operator", "admin", "router"}
    assert "off" in users["default"] and "+@all" not in users["default"]
    scoped = [
        f"~bl:{{{SHIPPED_ENGINE}}}:*",
        f"~bl:{{{SHIPPED_ENGINE}@*}}:*",
        f"~bl:members:{{{SHIPPED_ENGINE}}}",
    ]
    for role in ("scheduler", "worker", "vllm", "operator"):
        rules = users[role]
        assert [r for r in rules if r.startswith(("~", "%"))] == scoped
        assert "-@all" in rules and not any(r.startswith("+@") for r in rules)
        assert "+eval" not in rules  # scripts run by EVALSHA alone
    assert "+script|kill" in users["admin"] and not any(r.startswith("~") for r in users["admin"])


#: redis-py's connect handshake; refused on purpose (the rule only parses on Redis 7.2+, and
#: the file must load on 6.2+); redis-py ignores the refusal. See tests/helm/_acl.py.
HANDSHAKE = "client|setinfo"


def _denials(admin: redis.Redis) -> list[dict[str, Any]]:
    return [
        dict(e)
        for e in admin.acl_log()
        if e.get("username") in ("scheduler", "worker", "operator", "router")
        and e.get("object") != HANDSHAKE
    ]


def _protocol_run(server: EmbeddedServer, engine_id: str) -> None:
    """Hit, min over ranks, cancel mid-prefetch, timeout, dead letter, shutdown."""
    engines = [StubEngine("instant", hits=24), StubEngine()]
    ranks = [
        RedisAsyncLookupServer(
            e,
            LookupMetadata(engine_id=engine_id, world_size=2, worker_id=r),
            _config(server, "worker"),
        )
        for r, e in enumerate(engines)
    ]
    meta = LookupMetadata(engine_id=engine_id, world_size=2)
    client = RedisAsyncLookupClient(_config(server, "scheduler"), meta)
    try:
        alive(client, timeout=10)
        client.lookup(TOKENS, "hit")
        wait_until(lambda: "hit" in engines[1].started_ids())
        engines[1].report("hit", 32)
        wait_until(lambda: client.lookup_cache("hit") == 24, timeout=10)
        client.lookup(TOKENS, "cancel")
        wait_until(lambda: "cancel" in engines[1].started_ids())
        client.cancel_lookup("cancel")
        wait_until(lambda: ranks[1].stats().counts.get("aborts", 0) >= 1)
        engines[1].report("cancel", 40)
        client.lookup(TOKENS, "timeout")  # rank 1 never answers this one
        wait_until(lambda: client.lookup_cache("timeout") == 0, timeout=10)
        _as(server, "scheduler").xadd(KeySpace(engine_id).requests, {"m": b"junk"})
        wait_until(lambda: ranks[0].stats().consumer.dead_letters == 1)
        inspect_as_operator(server, engine_id)
    finally:
        client.close()
        for rank in ranks:
            rank.close()
    assert all(rank.stats().reporter_errors == 0 for rank in ranks)
    assert client.stats().redis_errors == 0


def inspect_as_operator(server: EmbeddedServer, engine_id: str) -> None:
    """``broker-lookup inspect --check`` as ``operator``: every rank alive, groups there."""
    out = io.StringIO()
    code = run_inspect(_config(server, "operator"), engine_id, world_size=2, check=True, out=out)
    assert code == 0, out.getvalue()


def test_protocol_runs_under_the_shipped_users(
    acl_server: tuple[EmbeddedServer, redis.Redis], engine_id: str
) -> None:
    server, admin = acl_server
    _protocol_run(server, engine_id)
    assert _denials(admin) == []  # nothing the protocol does needs more than the file grants
    ks = KeySpace(engine_id)
    assert not admin.exists(ks.heartbeat(0), ks.heartbeat(1))  # deleted on close, as allowed
    assert admin.xlen(ks.dead) == 2


def test_partial_answers_run_under_the_shipped_users(
    acl_server: tuple[EmbeddedServer, redis.Redis], engine_id: str, tmp_path: Path
) -> None:
    """progress.lua (worker), deadline.lua and keep.lua (scheduler) need nothing more."""
    server, admin = acl_server
    partial = {"partial_answers": True, "lookup_timeout_ms": 800}
    meta = LookupMetadata(engine_id=engine_id, world_size=2)
    client = RedisAsyncLookupClient(_config(server, "scheduler", **partial), meta)
    engines = [ReferenceEngine(), ReferenceEngine(disk_dir=tmp_path, load_delay_s=0.4)]
    hashes, offsets = client.hasher.hashes_and_offsets(TOKENS)
    engines[0].store(hashes, offsets)
    engines[1].store(hashes[:2], offsets[:2])
    engines[1].store_to_disk(hashes, offsets)
    ranks = [
        RedisAsyncLookupServer(
            e,
            LookupMetadata(engine_id=engine_id, world_size=2, worker_id=r),
            _config(server, "worker", **partial),
        )
        for r, e in enumerate(engines)
    ]
    try:
        alive(client, timeout=10)
        client.lookup(TOKENS, "partial")
        wait_until(lambda: client.lookup_cache("partial") is not None, timeout=10)
        got = client.lookup_cache("partial")
        assert got is not None and 8 <= got < len(TOKENS)
        wait_until(lambda: ranks[0].stats().counts.get("keep_kept", 0) == 1, timeout=10)
        assert ranks[1].stats().counts.get("progress_recorded", 0) >= 1
    finally:
        client.close()
        for rank in ranks:
            rank.close()
        for engine in engines:
            engine.close(timeout_s=1.0)
    assert _denials(admin) == []
    assert client.stats().redis_errors == 0


def test_fleet_query_runs_under_the_shipped_router_and_worker_users(
    acl_server: tuple[EmbeddedServer, redis.Redis], engine_id: str
) -> None:
    """A query with a reservation, as ``router`` (listing every engine of the configured
    id, reading ranks and heartbeats, probing, reserving, waiting on answers), answered
    by a rank as ``worker`` (XREAD, RPUSH, PEXPIRE): nothing is denied."""
    server, admin = acl_server
    engine = ReferenceEngine()
    fleet = FleetClient(_config(server, "router"))
    hashes, offsets = ChunkedTokenHasher(fleet.config).hashes_and_offsets(TOKENS)
    engine.store(hashes[:3], offsets[:3])
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    rank = RedisAsyncLookupServer(engine, meta, _config(server, "worker"))
    try:
        wait_until(lambda: rank.ready and rank.prober.reading.is_set(), timeout=10)
        answer = fleet.query(TOKENS, engines=[engine_id], deadline_ms=3000, reserve_ms=200)
        assert [(e.tokens, e.reserved, e.reason) for e in answer.engines] == [(12, 12, None)]
        wait_until(lambda: len(rank.reservations) == 0, timeout=10)
        every = fleet.query(TOKENS, configured=SHIPPED_ENGINE, deadline_ms=3000)
        assert (engine_id, 12) in [(e.engine_id, e.tokens) for e in every.engines]
    finally:
        fleet.close()
        rank.close()
        engine.close()
    assert _denials(admin) == []


def test_router_user_cannot_report(
    acl_server: tuple[EmbeddedServer, redis.Redis], engine_id: str
) -> None:
    """A router's credential forges no hit: no lookup hash, request or completion written,
    no script run, no heartbeat touched."""
    server, admin = acl_server
    ks = KeySpace(engine_id)
    router = _as(server, "router")
    report = router_attempts(ks)
    for attempt in report:
        with pytest.raises(redis.ResponseError, match=r"NOPERM|No permissions|permission"):
            command(router, *attempt)
    assert admin.exists(ks.lookup("x"), ks.requests, ks.done, ks.heartbeat(0)) == 0


def router_attempts(ks: KeySpace) -> list[tuple[object, ...]]:
    """What a report (or a forged lookup) sends, one command each."""
    return [
        ("HSET", ks.lookup("x"), "r0", "999"),
        ("XADD", ks.requests, "*", "m", "junk"),
        ("XADD", ks.done, "*", "id", "x", "gen", "1", "result", "999"),
        ("EVALSHA", "0" * 40, 2, ks.lookup("x"), ks.done),
        ("SCRIPT", "LOAD", "return 1"),
        ("SET", ks.heartbeat(0), "{}"),
    ]


@pytest.mark.parametrize("user", ["scheduler", "worker"])
@pytest.mark.parametrize(
    "denied",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("KEYS", "*"),
        ("GET", "other:key"),
        ("SET", "other:key", "1"),
        ("DEL", "other:key"),
        ("EVAL", "return redis.call('SET', KEYS[1], '1')", 1, "other:key"),
        ("EVAL", "return redis.call('GET', 'other:key')", 0),
        ("EVAL", "return 1", 0),  # scripts run by EVALSHA alone
        ("XADD", "bl:{other-engine}:done", "*", "id", "x", "gen", "1", "result", "999"),
        ("HSET", "bl:{other-engine}:lookup:x", "r0", "999"),
        ("SET", "bl:{other-engine}:hb:0", "{}"),
        ("SCRIPT", "FLUSH"),
        ("SHUTDOWN",),
        ("ACL", "SETUSER", "evil", "on", "+@all"),
        ("MONITOR",),
    ],
    ids=lambda c: " ".join(map(str, c[:2])) if isinstance(c, tuple) else c,
)
def test_what_the_protocol_does_not_need_is_denied(
    acl_server: tuple[EmbeddedServer, redis.Redis], user: str, denied: tuple[object, ...]
) -> None:
    server, admin = acl_server
    conn = _as(server, user)
    with pytest.raises(redis.ResponseError, match=r"NOPERM|No permissions|permission|can't access"):
        command(conn, *denied)
    assert admin.exists("other:key") == 0
    assert admin.ping()  # still up: SHUTDOWN and FLUSHALL were refused


def test_default_user_is_off(acl_server: tuple[EmbeddedServer, redis.Redis]) -> None:
    server, _ = acl_server
    once = Retry(NoBackoff(), 0)  # an auth failure is a ConnectionError: do not retry it
    anonymous = redis.Redis(host="127.0.0.1", port=server.port, retry=once)
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        anonymous.get("bl:{e}:requests")
    wrong = redis.Redis(
        host="127.0.0.1", port=server.port, username="scheduler", password="wrong", retry=once
    )
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
