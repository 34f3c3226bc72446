"""``broker-lookup doctor`` against a healthy setup and each way a setup breaks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
import redis
from faultkit import StartRank
from helpers import RealServer, wait_until

from broker_lookup.cli import main as cli_main
from broker_lookup.config import LookupConfig, env_name
from broker_lookup.errors import AUTH_HINT
from broker_lookup.ops.doctor import Finding, diagnose
from broker_lookup.processes import free_port
from broker_lookup.protocol.fingerprint import member
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


def _status(findings: list[Finding], check: str) -> list[str]:
    return [f"{f.status} {f.detail}" for f in findings if f.check == check]


def _no_wait(_s: float) -> None:
    return None


def test_a_healthy_engine_passes(
    real_server: RealServer, engine_id: str, rank_procs: StartRank
) -> None:
    rank_procs(real_server.url, engine_id, 1, 0, [])  # started as it is made
    r = redis.Redis.from_url(real_server.url)
    try:
        wait_until(lambda: r.exists(KeySpace(engine_id).heartbeat(0)), timeout=120)
    finally:
        r.close()
    config = LookupConfig(redis_url=real_server.url)
    findings = diagnose(config, engine_id)
    assert not [f for f in findings if f.status == "FAIL"], findings
    assert _status(findings, "ranks") == [f"ok {engine_id}: ranks 0 alive of 1"]
    assert _status(findings, "hashing")[0].startswith("ok")


def test_the_cli_exits_0_on_a_healthy_server_and_1_when_unreachable(
    real_server: RealServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["doctor", "--redis-url", real_server.url, "--engine-id", "none-here"]) == 0
    out = capsys.readouterr().out
    assert "ok    connect" in out and "every check passed" in out, out
    port = free_port()  # nothing listens there
    assert cli_main(["doctor", "--redis-url", f"redis://127.0.0.1:{port}/0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  connect" in out and "1 check(s) failed" in out, out


def test_a_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor", "--redis-url", "127.0.0.1:6379"]) == 2
    assert "(flag --redis-url)" in capsys.readouterr().err
    for tool in ("doctor", "inspect"):  # before dialling anything
        assert cli_main([tool, "--redis-url", "redis://127.0.0.1:1/0", "--engine-id", "a{b"]) == 2
        assert "argument --engine-id: 'a{b' is invalid" in capsys.readouterr().err


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedServer]:
    """A private server with a password and an evicting memory policy."""
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
    args = ["--maxmemory-policy", "allkeys-lru"]
    with EmbeddedServer(binary=binary, password="Doc-Pass-19ee", extra_args=args) as server:
        yield server


def test_a_wrong_password_fails_auth_naming_the_setting(
    locked: EmbeddedServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_name("redis_password"), "not-it")
    url = f"redis://127.0.0.1:{locked.port}/0"
    assert cli_main(["doctor", "--redis-url", url]) == 1
    out = capsys.readouterr().out
    assert "ok    connect" in out and "FAIL  auth" in out and AUTH_HINT in out, out


def test_an_evicting_memory_policy_fails(locked: EmbeddedServer) -> None:
    findings = diagnose(LookupConfig(redis_url=locked.url), "none-here", wait=_no_wait)
    [memory] = _status(findings, "memory")
    assert memory.startswith("FAIL maxmemory-policy allkeys-lru") and "noeviction" in memory


def _fake_rank(r: redis.Redis, keys: KeySpace, rank: int, pid: int) -> None:
    """A rank's consumer group and heartbeat, as a rank leaves them."""
    try:
        r.xgroup_create(keys.requests, keys.group(rank), id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: made by an earlier call
        pass
    r.set(keys.heartbeat(rank), json.dumps({"rank": rank, "pid": pid, "host": "h"}), px=60_000)


def test_a_dead_rank_a_duplicate_and_a_hashing_mismatch_fail(
    real_server: RealServer, engine_id: str
) -> None:
    keys = KeySpace(engine_id)
    r = redis.Redis.from_url(real_server.url)
    try:
        for rank in (0, 1, 2):
            _fake_rank(r, keys, rank, 100 + rank)
        r.delete(keys.heartbeat(2))  # rank 2 is dead
        r.hset(keys.fingerprint, member("worker") + "1", json.dumps({"chunk_size": 256}))
        r.hset(keys.fingerprint, member("client") + "2", json.dumps({"chunk_size": 16}))

        def another_process_beats(_s: float) -> None:  # a second rank 1 rewrites its heartbeat
            _fake_rank(r, keys, 1, 999)

        findings = diagnose(
            LookupConfig(redis_url=real_server.url), engine_id, another_process_beats
        )
    finally:
        r.delete(*r.keys(keys.pattern))
        r.close()
    ranks = _status(findings, "ranks")
    assert ranks[0] == f"FAIL {engine_id}: ranks 0,1 alive of 3; 2 without a heartbeat", ranks
    assert ranks[1].startswith(f"FAIL {engine_id}: rank 1 is served twice (h:101 and h:999")
    [hashing] = _status(findings, "hashing")
    assert hashing.startswith("FAIL") and "chunk_size" in hashing


def test_the_hit_rate_comes_from_recent_completions(
    real_server: RealServer, engine_id: str
) -> None:
    keys = KeySpace(engine_id)
    r = redis.Redis.from_url(real_server.url)
    try:
        _fake_rank(r, keys, 0, 1)
        for i, result in enumerate((64, 0, 32, 0)):  # what report.lua appends
            r.xadd(keys.done, {"id": f"l{i}", "gen": 1, "result": result})
        findings = diagnose(LookupConfig(redis_url=real_server.url), engine_id, _no_wait)
    finally:
        r.delete(*r.keys(keys.pattern))
        r.close()
    assert _status(findings, "hit rate") == [
        f"ok {engine_id}: 50% of the last 4 completed lookups hit (mean 24 tokens)"
    ]
