"""A rank whose ACL user is scoped to another engine fails as a wrong password does: exit 2
at once, naming the user, the keys it may reach (where the server lets it read its own
rules) and the fix; it never logs that it serves. Users are made as ``broker-lookup acl``
makes them, on a real server."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
import redis
from helpers import command

from broker_lookup.config import env_name
from broker_lookup.ops.acl import acl_line
from broker_lookup.processes import ExitCode, child_env, python_module
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.real, pytest.mark.timeout(180)]

BOOTSTRAP = "acl-rank-bootstrap"
PASSWORD = "acl-rank-Pw-3c1e"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[EmbeddedServer, redis.Redis]]:
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
    with EmbeddedServer(binary=binary, password=BOOTSTRAP) as embedded:
        admin = redis.Redis(host="127.0.0.1", port=embedded.port, password=BOOTSTRAP)
        try:
            yield embedded, admin
        finally:
            admin.close()


def _user(admin: redis.Redis, name: str, engine_id: str, *extra: str) -> None:
    """``name``: the worker user ``broker-lookup acl`` makes for ``engine_id``, plus ``extra``."""
    rules = acl_line("worker", engine_id, user=name, password=PASSWORD).split()[2:]
    command(admin, "ACL", "SETUSER", name, "reset", *rules, *extra)


def _rank(server: EmbeddedServer, engine_id: str, user: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    env |= {env_name("redis_username"): user, env_name("redis_password"): PASSWORD}
    args = ["--engine-id", engine_id, "--world-size", "1", "--rank", "0", "--metrics-port", "0"]
    # A connect timeout far longer than the run's own: retrying would be killed, not exit 2.
    args += ["--redis-url", f"redis://127.0.0.1:{server.port}/0", "--connect-timeout", "3600"]
    return subprocess.run(
        python_module("workers", args),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("extra", "reach"),
    [
        ((), "its own rules are unreadable to it (ACL GETUSER denied)"),
        (("+acl|getuser",), "it may reach keys ~bl:{llama-3}:* ~bl:{llama-3@*}:*"),
    ],
    ids=["getuser-denied", "getuser-allowed"],
)
def test_a_rank_of_another_engines_user_exits_2_at_once_naming_user_keys_and_fix(
    server: tuple[EmbeddedServer, redis.Redis], extra: tuple[str, ...], reach: str
) -> None:
    embedded, admin = server
    user = f"worker-llama-3-{len(extra)}"
    _user(admin, user, "llama-3", *extra)
    proc = _rank(embedded, "mistral-7b", user)
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "may not access" in line]
    assert len(lines) == 1, proc.stderr
    said = lines[0]
    assert f"Redis user '{user}' may not access this engine's keys (bl:{{mistral-7b}}:*)" in said
    # Redis's own words, as the server says them (Valkey: "No permissions to access a key";
    # Redis 7.0: "this user has no permissions to access one of the keys ...").
    assert "no permissions" in said.lower() or "NOPERM" in said, said
    assert reach in said
    assert "broker-lookup acl --engine-id mistral-7b --role worker" in said
    assert "serving" not in proc.stderr and PASSWORD not in proc.stderr


def test_a_rank_of_its_own_engines_user_gets_past_the_check(
    server: tuple[EmbeddedServer, redis.Redis],
) -> None:
    embedded, admin = server
    _user(admin, "worker-own", "own-engine")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    env |= {env_name("redis_username"): "worker-own", env_name("redis_password"): PASSWORD}
    env[env_name("redis_url")] = f"redis://127.0.0.1:{embedded.port}/0"
    # --preload of a missing file: the rank stops right after the access check, exit 2,
    # with the file named, not the access.
    args = ["--engine-id", "own-engine", "--world-size", "1", "--rank", "0"]
    args += ["--metrics-port", "0", "--preload", "/nonexistent/preload.json"]
    proc = subprocess.run(
        python_module("workers", args),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--preload /nonexistent/preload.json" in proc.stderr, proc.stderr
    assert "may not access" not in proc.stderr
