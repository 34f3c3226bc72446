"""Every CLI tool as the least-privilege user meant for it, on a real server loaded with the
users the chart renders (``operator-<engine>``, ``exporter``, ``admin``: the chart's ACL is
``broker-lookup acl``'s lines, tests/helm/test_chart_acl.py checks that line for line):
``inspect`` and ``doctor`` as an operator, the exporter as ``exporter``, ``SCRIPT KILL`` as
``admin``. What the user may not read is one line naming the user, the command or key and
the fix, and a check it stops is skipped, not failed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers import command

from broker_lookup.cli import main as cli_main
from broker_lookup.config import env_name
from broker_lookup.ops.acl import acl_line
from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, instance_engine_id
from broker_lookup.protocol.snapshot import MetricsPublisher
from broker_lookup.protocol.stats import ClientStats
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = pytest.mark.real

#: The chart's default engine, a vLLM instance of it, and another engine on the server.
ENGINE = "vllm-engine"
INSTANCE = instance_engine_id(ENGINE, "1796611254403740308")
OTHER = "llama-70b"
ADMIN = ("bl-test-admin", "admin-only-in-this-test")
#: Each user the chart renders for these tools: (role, engine scope), password = name.
USERS = {f"operator-{ENGINE}": ("operator", ENGINE), "exporter": ("operator", None)}
USERS["admin"] = ("admin", None)
HANDSHAKE = "client|setinfo"  # redis-py's, refused on purpose (see tests/helm/_acl.py)


def _keys(admin: redis.Redis, engine: str, pid: int) -> None:
    """What a live engine leaves: rank 0's group and heartbeat, the scheduler's lease and
    snapshot, a completion."""
    keys = KeySpace(engine)
    admin.xgroup_create(keys.requests, keys.group(0), id="0", mkstream=True)
    beat = {"rank": 0, "pid": pid, "host": "node-a", "ts_ms": 1}
    admin.set(keys.heartbeat(0), json.dumps(beat), px=600_000)
    who = {"host": "node-a", "pid": pid + 1, "started_ms": 1, "nonce": "ab"}
    admin.set(keys.owner(SCHEDULER_ROLE), "1.ab " + json.dumps(who), px=600_000)
    admin.xadd(keys.done, {"id": "l1", "gen": 1, "result": 16})
    publisher = MetricsPublisher(
        keys, SCHEDULER_ROLE, "client", ClientStats, interval_ms=1, ttl_ms=600_000
    )
    set_snapshot = publisher.command(1e12)
    assert set_snapshot is not None
    command(admin, *set_snapshot)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
    with EmbeddedServer(binary=binary, password="bootstrap-only") as server:
        admin = redis.Redis(host="127.0.0.1", port=server.port, password="bootstrap-only")
        command(admin, "ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", "~*", "&*", "+@all")
        command(admin, "AUTH", *ADMIN)
        command(admin, "ACL", "SETUSER", "default", "off")
        for user, (role, engine) in USERS.items():
            rules = acl_line(role, engine, user=user, password=user).split()[2:]
            command(admin, "ACL", "SETUSER", user, "reset", *rules)
        _keys(admin, INSTANCE, 100)
        _keys(admin, OTHER, 200)
        admin.close()
        yield server


@pytest.fixture
def admin(server: EmbeddedServer) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=server.port, username=ADMIN[0], password=ADMIN[1])
    command(client, "ACL", "LOG", "RESET")
    yield client
    client.close()


def _as(
    user: str, server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, *argv: str
) -> list[str]:
    monkeypatch.setenv(env_name("redis_username"), user)
    monkeypatch.setenv(env_name("redis_password"), user)
    return [argv[0], "--redis-url", f"redis://127.0.0.1:{server.port}/0", *argv[1:]]


def _finding(out: str, status: str, check: str) -> list[str]:
    """The details of ``doctor``'s lines of ``check`` with ``status``."""
    found = [line.split(None, 2) for line in out.splitlines() if line.startswith("  ")]
    return [w[2] for w in found if len(w) == 3 and w[0] == status and w[1] == check]


def _denials(admin: redis.Redis) -> list[dict[str, Any]]:
    return [dict(e) for e in admin.acl_log() if e.get("object") != HANDSHAKE]


def test_an_engines_operator_runs_doctor_and_inspect_on_its_engine(
    server: EmbeddedServer,
    admin: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    user = f"operator-{ENGINE}"
    assert cli_main(_as(user, server, monkeypatch, "doctor", "--engine-id", ENGINE)) == 0
    out = capsys.readouterr().out
    assert "every check passed" in out and "skip" not in out, out
    assert _finding(out, "ok", "memory") == ["maxmemory-policy noeviction"]
    assert _finding(out, "ok", "owners") == [f"{INSTANCE}: no role claimed twice"]
    assert (
        cli_main(_as(user, server, monkeypatch, "inspect", "--engine-id", ENGINE, "--check")) == 0
    )
    assert "CHECK OK" in capsys.readouterr().out
    assert _denials(admin) == []


def test_an_engines_operator_reading_the_fleet_skips_the_other_engines_in_one_line(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    user = f"operator-{ENGINE}"
    assert cli_main(_as(user, server, monkeypatch, "doctor")) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    (skip,) = _finding(captured.out, "skip", "ranks")
    assert f"user {user} may not read the keys of engine {OTHER}" in skip
    # Redis's refusal in its own words (Valkey's and Redis 7.0's differ in case and length).
    assert "no permissions to access" in skip.lower() and "broker-lookup acl" in skip
    assert "every check that ran passed, 1 skipped" in captured.out
    assert cli_main(_as(user, server, monkeypatch, "inspect", "--check")) == 0
    out = capsys.readouterr().out
    assert "SKIPPED (1 engines)" in out and f"engine {OTHER}: user {user} may not" in out
    assert f"  {INSTANCE}  live" in out
    # Another engine by name: one line, not a traceback.
    assert cli_main(_as(user, server, monkeypatch, "inspect", "--engine-id", OTHER)) == 3
    (line,) = capsys.readouterr().err.splitlines()
    assert f"user {user} may not read these keys" in line and "broker-lookup acl" in line


def test_the_exporter_user_runs_doctor_and_the_exporter_on_every_engine(
    server: EmbeddedServer,
    admin: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(_as("exporter", server, monkeypatch, "doctor")) == 0
    out = capsys.readouterr().out
    assert "every check passed" in out, out
    assert _finding(out, "ok", "engines") == [f"2: {OTHER}, {INSTANCE}"]
    assert cli_main(_as("exporter", server, monkeypatch, "exporter", "--once")) == 0
    out = capsys.readouterr().out
    assert f'engine="{INSTANCE}"' in out and f'engine="{OTHER}"' in out
    assert 'broker_lookup_exporter_snapshots{state="read"} 2.0' in out
    assert _denials(admin) == []


def test_admin_runs_script_kill_and_doctor_skips_what_it_may_not_read(
    server: EmbeddedServer,
    admin: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    as_admin = redis.Redis(host="127.0.0.1", port=server.port, username="admin", password="admin")
    try:
        with pytest.raises(redis.ResponseError, match="NOTBUSY"):  # allowed; nothing runs
            as_admin.script_kill()
    finally:
        as_admin.close()
    assert cli_main(_as("admin", server, monkeypatch, "doctor")) == 0
    out = capsys.readouterr().out
    assert _finding(out, "ok", "memory") == ["maxmemory-policy noeviction"], out
    (skip,) = _finding(out, "skip", "engines")
    assert "user admin may not list the engines (SCAN)" in skip and "'scan'" in skip


def test_the_exporter_as_an_engines_operator_serves_its_engine_and_counts_the_rest(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    user = f"operator-{ENGINE}"
    assert cli_main(_as(user, server, monkeypatch, "exporter", "--once")) == 0
    out = capsys.readouterr().out
    assert f'engine="{INSTANCE}"' in out and f'engine="{OTHER}"' not in out
    assert 'broker_lookup_exporter_snapshots{state="denied"} 1.0' in out
    assert (
        cli_main(_as(user, server, monkeypatch, "exporter", "--once", "--engine-id", ENGINE)) == 0
    )
    out = capsys.readouterr().out
    assert 'broker_lookup_exporter_snapshots{state="denied"} 0.0' in out
    assert (
        f'broker_lookup_engine_split{{configured_engine_id="{ENGINE}",engine="{INSTANCE}"}} 0.0'
        in out
    )
