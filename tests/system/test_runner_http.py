"""The rank's HTTP endpoint (``/healthz``, ``/readyz``, ``/metrics``) on a real process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from helpers import RealServer, wait_until
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup.ops.metrics import METRIC_NAMES
from broker_lookup.processes import child_env, free_port, python_module, spawn, terminate
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(300)]

STARTUP_S = 90.0
#: A rank process exports its own series and which LMCache it runs.
WORKER_NAMES = {n for n in METRIC_NAMES if n.startswith("broker_lookup_worker_")} | {
    "broker_lookup_lmcache_info"
}


def _free_ports(span: int = 2) -> int:
    """A port P such that P .. P+span-1 are all free now (supervised ranks use P+rank)."""
    while True:
        port = free_port()
        if port + span <= 65536 and all(_bindable(p) for p in range(port + 1, port + span)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _get(port: int, path: str) -> tuple[int, str]:
    """(status, body); (0, reason) when nothing answers yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


@pytest.fixture
def start_worker(
    engine_id: str, tmp_path: Path
) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], int]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str, *args: str) -> tuple[subprocess.Popen[bytes], int]:
        port = _free_ports()
        argv = ["--engine-id", engine_id, "--world-size", "2", "--metrics-port", str(port)]
        env = child_env(
            os.environ,
            {
                "BROKER_LOOKUP_REDIS_URL": url,
                "BROKER_LOOKUP_HEARTBEAT_INTERVAL_MS": "200",
                "BROKER_LOOKUP_HEARTBEAT_TTL_MS": "800",
                "BROKER_LOOKUP_SOCKET_TIMEOUT_MS": "2000",
            },
        )
        with open(tmp_path / f"worker-{len(procs)}.log", "wb") as out:
            procs.append(spawn(python_module("workers", [*argv, *args]), env, output=out))
        return procs[-1], port

    yield start
    terminate(procs, 15.0)


def _ready(port: int) -> bool:
    return _get(port, "/readyz")[0] == 200


def test_health_ready_and_metrics_then_not_ready_without_redis(
    fresh_real_server: EmbeddedServer,
    start_worker: Callable[..., tuple[subprocess.Popen[bytes], int]],
) -> None:
    proc, port = start_worker(fresh_real_server.url, "--rank", "1")
    wait_until(lambda: _get(port, "/readyz")[0] == 200, timeout=STARTUP_S, interval=0.1)
    assert _get(port, "/healthz") == (200, "ok\n")
    assert _get(port, "/readyz") == (200, "ready\n")

    status, text = _get(port, "/metrics")
    assert status == 200
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    assert {s.name for s in samples} == WORKER_NAMES
    assert all(s.labels["rank"] == "1" for s in samples if s.name != "broker_lookup_lmcache_info")
    assert _get(port, "/nope")[0] == 404

    fresh_real_server.stop()

    def not_ready() -> str | None:
        status, body = _get(port, "/readyz")
        return body if status == 503 else None

    body = wait_until(not_ready, timeout=15, interval=0.1)
    assert "not ready" in str(body)
    assert _get(port, "/healthz")[0] == 200  # liveness never depends on Redis

    fresh_real_server.start()  # same port: the rank reconnects by itself
    wait_until(lambda: _get(port, "/readyz")[0] == 200, timeout=30, interval=0.1)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert _get(port, "/healthz")[0] == 0  # the port is closed


def test_supervised_ranks_serve_on_port_plus_rank(
    real_server: RealServer, start_worker: Callable[..., tuple[subprocess.Popen[bytes], int]]
) -> None:
    proc, port = start_worker(real_server.url, "--ranks", "all")
    for rank in (0, 1):
        wait_until(partial(_ready, port + rank), timeout=STARTUP_S)
        status, text = _get(port + rank, "/metrics")
        assert status == 200
        assert f'broker_lookup_worker_requests_total{{rank="{rank}"}}' in text
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
