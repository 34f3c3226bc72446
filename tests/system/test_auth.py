"""A wrong or missing password is reported as such, at once, naming the setting to fix; and
the client counts it (and an unreachable Redis) as ``unavailable``, never ``dead_rank``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
from helpers import wait_until

from broker_lookup.cli import main as cli_main
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.errors import AUTH_HINT, AuthFailed, BrokerUnavailable, translate_redis_errors
from broker_lookup.processes import ExitCode, child_env, free_port, python_module
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.transport.connection import make_factory

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

RIGHT = "Auth-Right-41f0"
WRONG = "Auth-Wrong-77c2"


@pytest.fixture(scope="module")
def locked() -> Iterator[EmbeddedServer]:
    """A private server with a password (requirepass)."""
    binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
    with EmbeddedServer(binary=binary, password=RIGHT) as server:
        yield server


def _url(server: EmbeddedServer, password: str | None = None) -> str:
    auth = f":{password}@" if password else ""
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def test_the_hint_names_the_settings() -> None:
    assert env_name("redis_password") in AUTH_HINT and env_name("redis_username") in AUTH_HINT


@pytest.mark.parametrize("password", [None, WRONG], ids=["missing", "wrong"])
def test_a_refused_password_is_auth_failed_with_the_hint(
    locked: EmbeddedServer, password: str | None
) -> None:
    conn = make_factory(LookupConfig(redis_url=_url(locked), redis_password=password), "t")()
    try:
        with pytest.raises(AuthFailed) as err, translate_redis_errors("pinging"):
            conn.ping()
    finally:
        conn.close()
    assert isinstance(err.value, BrokerUnavailable)  # every caller's handling still holds
    assert "refused the credentials" in str(err.value) and AUTH_HINT in str(err.value)


@pytest.mark.parametrize("password", [None, WRONG], ids=["missing", "wrong"])
def test_a_rank_with_a_refused_password_exits_2_at_once(
    locked: EmbeddedServer, password: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    if password:
        env[env_name("redis_password")] = password
    # A connect timeout far longer than the run's own: retrying would be killed, not exit 2.
    args = ["--engine-id", "auth", "--world-size", "1", "--rank", "0", "--metrics-port", "0"]
    args += ["--redis-url", _url(locked), "--connect-timeout", "3600"]
    proc = subprocess.run(
        python_module("workers", args),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "refused the credentials" in proc.stderr
    assert env_name("redis_password") in proc.stderr
    assert "not reachable yet" not in proc.stderr  # not retried
    assert WRONG not in proc.stderr


def _outcomes_of_a_lookup(config: LookupConfig) -> dict[str, int]:
    client = RedisAsyncLookupClient(config, LookupMetadata(engine_id="auth", world_size=2))
    try:
        assert client.lookup(list(range(64)), "l1") == 0  # answered at once, not timed out
        assert client.lookup_cache("l1") == 0
        stats = client.stats()
        outcomes = dict(stats.outcomes)
        assert outcomes.get("unavailable") == 1 and not outcomes.get("dead_rank"), outcomes
        assert not stats.liveness_known
        return outcomes
    finally:
        client.close()


def _config(url: str) -> LookupConfig:
    # A lookup timeout far longer than the test: an answer of 0 came at once, not by timeout.
    return LookupConfig(
        redis_url=url, chunk_size=16, block_ms=50, socket_timeout_ms=1500, lookup_timeout_ms=30_000
    )


def test_a_client_refused_by_redis_counts_unavailable_not_dead_rank(
    locked: EmbeddedServer,
) -> None:
    config = _config(_url(locked, WRONG))
    outcomes = _outcomes_of_a_lookup(config)
    assert outcomes.get("unavailable") == 1 and not outcomes.get("dead_rank"), outcomes


def test_a_client_of_an_unreachable_redis_counts_unavailable_not_dead_rank() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    outcomes = _outcomes_of_a_lookup(_config(url))
    assert outcomes.get("unavailable") == 1 and not outcomes.get("dead_rank"), outcomes


def test_a_client_with_the_right_password_still_sees_dead_ranks(locked: EmbeddedServer) -> None:
    config = _config(_url(locked, RIGHT))
    client = RedisAsyncLookupClient(config, LookupMetadata(engine_id="auth-up", world_size=2))
    try:
        wait_until(lambda: client.stats().liveness_known, timeout=30)
        assert client.lookup(list(range(64)), "l1") == 0  # no rank runs: fails fast
        assert client.stats().outcomes.get("dead_rank") == 1
    finally:
        client.close()


def test_inspect_with_a_wrong_password_names_the_setting(
    locked: EmbeddedServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_name("redis_password"), WRONG)
    code = cli_main(["inspect", "--redis-url", _url(locked), "--engine-id", "e"])
    err = capsys.readouterr().err
    assert code != 0 and AUTH_HINT in err and WRONG not in err, err


def _ping(config: LookupConfig) -> bool:
    conn = make_factory(config, "t")()
    try:
        return bool(conn.ping())
    finally:
        conn.close()


def test_the_readme_session_takes_the_password_from_the_environment(
    locked: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env_name("redis_password"), RIGHT)
    assert _ping(LookupConfig(redis_url=_url(locked), enable_async_loading=True))
    assert _ping(LookupConfig.load(redis_url=_url(locked)))
    # The client the README builds from it connects: it reads liveness, it does not
    # count the lookup unavailable.
    config = _config(_url(locked))
    client = RedisAsyncLookupClient(config, LookupMetadata(engine_id="auth-env", world_size=1))
    try:
        wait_until(lambda: client.stats().liveness_known, timeout=30)
        assert client.lookup(list(range(64)), "l1") == 0
        assert client.stats().outcomes.get("dead_rank") == 1
    finally:
        client.close()


def test_the_configs_password_wins_over_the_urls(
    locked: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env_name("redis_password"), raising=False)
    assert _ping(LookupConfig(redis_url=_url(locked, WRONG), redis_password=RIGHT))
    # A unix socket's URL alike (no socket here: the pool's options are what is checked).
    url = f"unix:///nonexistent.sock?db=0&password={WRONG}"
    client = make_factory(LookupConfig(redis_url=url, redis_password=RIGHT), "t")()
    assert client.connection_pool.connection_kwargs["password"] == RIGHT


def _cli_output(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    return subprocess.run(
        python_module("broker_lookup.cli", list(args)),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("tool", ["doctor", "inspect"])
def test_a_password_in_the_query_is_used_and_never_printed(
    locked: EmbeddedServer, tool: str
) -> None:
    url = f"redis://127.0.0.1:{locked.port}/0?password={RIGHT}"
    proc = _cli_output(tool, "--redis-url", url)
    assert proc.returncode == 0, proc.stderr
    assert "password=***" in proc.stdout
    assert RIGHT not in proc.stdout + proc.stderr


def test_a_rank_never_logs_a_password_given_in_the_query(locked: EmbeddedServer) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    url = f"redis://127.0.0.1:{locked.port}/0?password={WRONG}"
    args = ["--engine-id", "auth", "--world-size", "1", "--rank", "0", "--metrics-port", "0"]
    args += ["--redis-url", url, "--connect-timeout", "3600", "--log-level", "DEBUG"]
    proc = subprocess.run(
        python_module("workers", args),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert "connecting to redis://127.0.0.1" in proc.stderr and "password=***" in proc.stderr
    assert WRONG not in proc.stderr
