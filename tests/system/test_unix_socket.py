"""``unix://`` URLs, as the README documents them, against a real server on a unix socket:
the Python client, a rank process, ``doctor``, ``inspect`` and ``exporter --once``."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultkit import MakeLookupClient, StartRank, alive, answer, config, prompt

from broker_lookup.processes import child_env, python_module
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def socket_url() -> Iterator[str]:
    """``unix://`` URL of a private server listening on a unix socket (and a TCP port)."""
    # A short directory: a unix socket's path is limited to about 100 bytes.
    with tempfile.TemporaryDirectory(prefix="bl-", dir="/tmp") as tmp:
        path = Path(tmp) / "redis.sock"
        binary = os.environ.get("BROKER_LOOKUP_TEST_SERVER_BINARY") or None
        extra = ["--unixsocket", str(path), "--unixsocketperm", "700"]
        with EmbeddedServer(binary=binary, extra_args=extra):
            yield f"unix://{path}?db=0"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    return subprocess.run(
        python_module("broker_lookup.cli", list(args)),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_rank_process_and_the_client_answer_a_lookup(
    socket_url: str, rank_procs: StartRank, clients: MakeLookupClient, engine_id: str
) -> None:
    tokens = prompt(7000)
    rank = rank_procs(socket_url, engine_id, 1, 0, [{"tokens": tokens}])
    client = clients(config(socket_url, lookup_timeout_ms=10_000), engine_id)
    alive(client)
    assert client.lookup(tokens, "unix-1") is None
    assert answer(client, "unix-1", timeout=30) == len(tokens)
    assert "socket_keepalive" not in rank.log()


def test_doctor_inspect_and_the_exporter_read_the_server(socket_url: str) -> None:
    doctor = _cli("doctor", "--redis-url", socket_url)
    assert "ok    connect" in doctor.stdout, doctor.stderr
    assert "Traceback" not in doctor.stderr
    inspect = _cli("inspect", "--redis-url", socket_url, "--json")
    assert inspect.returncode == 0, inspect.stderr
    assert inspect.stdout.lstrip().startswith("{")
    exporter = _cli("exporter", "--once", "--redis-url", socket_url)
    assert exporter.returncode == 0, exporter.stderr
    assert "broker_lookup_exporter_snapshots" in exporter.stdout
