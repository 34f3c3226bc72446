"""Worker ranks as real ``python -m workers`` processes against the session's real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis
from faultkit import MakeLookupClient, alive
from helpers import RealServer, gone, wait_until
from prometheus_client import CollectorRegistry, generate_latest

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig
from broker_lookup.ops.metrics import ClientCollector
from broker_lookup.processes import child_env, free_port, python_module, spawn, terminate
from broker_lookup.protocol.keys import KeySpace

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(300)]

CHUNK = 16
FULL = list(range(100, 100 + 8 * CHUNK))  # on every rank
PARTIAL = list(range(500, 500 + 8 * CHUNK))  # rank 0 all, rank 1 half
ZERO = list(range(900, 900 + 8 * CHUNK))  # nowhere
SETTINGS = {
    "chunk_size": CHUNK,
    "block_ms": 100,
    "heartbeat_interval_ms": 200,
    "heartbeat_ttl_ms": 1500,
    "lookup_timeout_ms": 10_000,
}
STARTUP_S = 90.0  # a rank imports torch: slow on a loaded 2-core machine


def _env(url: str) -> dict[str, str]:
    extra = {f"BROKER_LOOKUP_{k.upper()}": str(v) for k, v in SETTINGS.items()}
    return child_env(os.environ, {**extra, "BROKER_LOOKUP_REDIS_URL": url})


@pytest.fixture
def preload(tmp_path: Path) -> Path:
    path = tmp_path / "preload.json"
    prompts = [
        {"tokens": FULL, "ranks": None, "fraction": 1.0},
        {"tokens": PARTIAL, "ranks": [0], "fraction": 1.0},
        {"tokens": PARTIAL, "ranks": [1], "fraction": 0.5},
    ]
    path.write_text(json.dumps({"prompts": prompts}))
    return path


@pytest.fixture
def start_rank(
    real_server: RealServer, engine_id: str, preload: Path, tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start ``python -m workers`` (one rank by default); every process is stopped at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str, world_size: int = 2, rank: int | None = 0) -> subprocess.Popen[bytes]:
        argv = ["--engine-id", engine_id, "--world-size", str(world_size)]
        argv += ["--metrics-port", "0", "--preload", str(preload), *args]
        if rank is not None:
            argv += ["--rank", str(rank)]
        log = tmp_path / f"worker-{len(procs)}.log"
        with open(log, "wb") as out:
            proc = spawn(python_module("workers", argv), _env(real_server.url), output=out)
        procs.append(proc)
        return proc

    yield start
    terminate(procs, 15.0)


@pytest.fixture
def redis_client(real_server: RealServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(real_server.url)
    yield client
    client.close()


class TwoRanks(NamedTuple):
    """What ``two_ranks`` started: a client that sees both ranks alive, and rank 1's process."""

    client: RedisAsyncLookupClient
    rank1: subprocess.Popen[bytes]


@pytest.fixture
def two_ranks(
    start_rank: Callable[..., subprocess.Popen[bytes]],
    clients: MakeLookupClient,
    redis_client: redis.Redis,
    real_server: RealServer,
    engine_id: str,
) -> TwoRanks:
    """Rank processes 0 and 1 beating, and a client of both (closed after the test)."""
    start_rank(rank=0)
    rank1 = start_rank(rank=1)
    _beating(redis_client, KeySpace(engine_id), 0, 1)
    config = LookupConfig(redis_url=real_server.url, **SETTINGS)  # type: ignore[arg-type]
    client = clients(config, engine_id, 2)
    alive(client, timeout=10)
    return TwoRanks(client, rank1)


def _beating(redis_client: redis.Redis, keys: KeySpace, *ranks: int) -> None:
    wait_until(
        lambda: redis_client.exists(*[keys.heartbeat(r) for r in ranks]) == len(ranks),
        timeout=STARTUP_S,
        interval=0.05,
        message=f"heartbeats of ranks {ranks}",
    )


def _result(client: RedisAsyncLookupClient, tokens: list[int], lookup_id: str) -> int:
    assert client.lookup(tokens, lookup_id) is None
    value = wait_until(lambda: client.lookup_cache(lookup_id) is not None, timeout=15)
    assert value
    result = client.lookup_cache(lookup_id)
    assert result is not None
    client.clear_lookup_status(lookup_id)
    return result


def test_full_partial_zero_across_two_rank_processes(
    two_ranks: TwoRanks, redis_client: redis.Redis, engine_id: str
) -> None:
    keys = KeySpace(engine_id)
    client = two_ranks.client
    assert _result(client, FULL, "full") == len(FULL)
    assert _result(client, PARTIAL, "partial") == len(PARTIAL) // 2  # min over ranks
    fields = redis_client.hgetall(keys.lookup("partial"))
    assert fields[b"r0"] == str(len(PARTIAL)).encode()
    assert fields[b"r1"] == str(len(PARTIAL) // 2).encode()
    assert _result(client, ZERO, "zero") == 0
    assert client.stats().outcomes["hit"] == 2
    assert client.stats().outcomes["miss"] == 1
    registry = CollectorRegistry()
    registry.register(ClientCollector(client))
    text = generate_latest(registry).decode()
    assert 'broker_lookup_client_lookups_total{outcome="hit"} 2.0' in text


def test_sigterm_exits_zero_quickly_and_deletes_the_heartbeat(
    start_rank: Callable[..., subprocess.Popen[bytes]],
    redis_client: redis.Redis,
    engine_id: str,
    tmp_path: Path,
) -> None:
    keys = KeySpace(engine_id)
    proc = start_rank(rank=0, world_size=1)
    _beating(redis_client, keys, 0)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert redis_client.exists(keys.heartbeat(0)) == 0  # deleted, not left to expire
    log = (tmp_path / "worker-0.log").read_text()
    assert "SIGTERM received" in log
    assert "rank 0 stopped after" in log and "requests=0" in log


def test_killed_rank_is_dead_fast_and_recovers_after_restart(
    start_rank: Callable[..., subprocess.Popen[bytes]],
    two_ranks: TwoRanks,
    redis_client: redis.Redis,
    engine_id: str,
) -> None:
    keys = KeySpace(engine_id)
    client, victim = two_ranks
    assert _result(client, FULL, "before") == len(FULL)

    victim.kill()
    victim.wait(timeout=10)
    wait_until(lambda: client.stats().dead_ranks == (1,), timeout=10, message="rank 1 dead")
    started = time.monotonic()
    assert client.lookup(FULL, "while-dead") == 0  # answered at once, not after the timeout
    assert client.lookup_cache("while-dead") == 0
    assert time.monotonic() - started < 1.0
    assert client.stats().outcomes["dead_rank"] >= 1
    client.clear_lookup_status("while-dead")

    start_rank(rank=1)  # same consumer name: replays its own pending entries first
    _beating(redis_client, keys, 1)
    alive(client, timeout=10)
    assert _result(client, FULL, "after") == len(FULL)


def test_ranks_all_supervises_one_child_per_rank(
    start_rank: Callable[..., subprocess.Popen[bytes]], redis_client: redis.Redis, engine_id: str
) -> None:
    keys = KeySpace(engine_id)
    supervisor = start_rank("--ranks", "all", rank=None)
    _beating(redis_client, keys, 0, 1)
    beats = [json.loads(redis_client.get(keys.heartbeat(r)) or b"{}") for r in (0, 1)]
    pids = [b["pid"] for b in beats]
    assert supervisor.pid not in pids and len(set(pids)) == 2  # one process per rank
    supervisor.send_signal(signal.SIGTERM)  # forwarded to both children
    assert supervisor.wait(timeout=30) == 0
    assert redis_client.exists(keys.heartbeat(0), keys.heartbeat(1)) == 0
    assert all(gone(pid) for pid in pids)


def test_supervisor_exits_with_the_failure_of_a_child(
    start_rank: Callable[..., subprocess.Popen[bytes]], redis_client: redis.Redis, engine_id: str
) -> None:
    keys = KeySpace(engine_id)
    supervisor = start_rank("--ranks", "all", rank=None)
    _beating(redis_client, keys, 0, 1)
    child = json.loads(redis_client.get(keys.heartbeat(1)) or b"{}")["pid"]
    os.kill(child, signal.SIGKILL)
    assert supervisor.wait(timeout=30) == 1  # it stopped rank 0 too, so the pod restarts
    assert redis_client.exists(keys.heartbeat(0)) == 0


_ONE_RANK = ["--engine-id", "e", "--world-size", "1", "--rank", "0"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--world-size", "2", "--rank", "0"], {}, "--engine-id (env BROKER_LOOKUP_ENGINE_ID)"),
        (["--engine-id", "e", "--world-size", "2", "--rank", "5"], {}, "--rank"),
        (["--engine-id", "e", "--rank", "0"], {"BROKER_LOOKUP_WORLD_SIZE": "x"}, "WORLD_SIZE"),
        (
            ["--engine-id", "e", "--world-size", "1", "--rank", "0"],
            {"BROKER_LOOKUP_BLOCK_MS": "-1"},
            "BROKER_LOOKUP_BLOCK_MS",
        ),
        (["--engine-id", "e", "--world-size", "1"], {}, "BROKER_LOOKUP_RANK"),
        (["--engine-id", "e", "--world-size", "x", "--rank", "0"], {}, "--world-size='x'"),
        (
            [*_ONE_RANK, "--redis-url", "127.0.0.1:16379"],
            {"BROKER_LOOKUP_REDIS_URL": "redis://h/0"},
            "redis_url='127.0.0.1:16379' (flag --redis-url) is invalid",
        ),
        (
            _ONE_RANK,
            {"BROKER_LOOKUP_REDIS_URL": "127.0.0.1:16379"},
            "(env BROKER_LOOKUP_REDIS_URL) is invalid",
        ),
        (
            _ONE_RANK,
            {"BROKER_LOOKUP_" + "CHUNK_SZE": "16"},  # two parts: the repository scan skips it
            "(did you mean BROKER_LOOKUP_CHUNK_SIZE?)",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(
    args: list[str], env: dict[str, str], message: str, tmp_path: Path
) -> None:
    proc = _workers([*args, "--metrics-port", "0"], env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    if "flag" in message:  # the variable was set too, but the value at fault is the flag's
        assert "(env BROKER_LOOKUP_REDIS_URL)" not in proc.stderr


def _workers(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    return subprocess.run(
        python_module("workers", args),
        env=child_env({**environ, **env}),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_bad_value_in_the_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_size: 0\n")
    proc = _workers([*_ONE_RANK, "--metrics-port", "0", "--config", str(path)], {})
    assert proc.returncode == 2, proc.stderr
    assert f"chunk_size=0 (file {path}) is invalid" in proc.stderr
    assert "BROKER_LOOKUP_CHUNK_SIZE" not in proc.stderr


def test_unreachable_redis_at_startup_exits_3(engine_id: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    argv = ["--engine-id", engine_id, "--world-size", "1", "--rank", "0", "--metrics-port", "0"]
    proc = subprocess.run(
        python_module("workers", [*argv, "--redis-url", url, "--connect-timeout", "1"]),
        env=child_env(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert "Redis unreachable" in proc.stderr


def test_help_answers_without_loading_torch() -> None:
    # torch takes seconds to import: --help, and a usage error, must not wait for it.
    code = (
        "import sys; from workers.runtime.runner import main; "
        "rc = main(sys.argv[1:]); print('torch' in sys.modules); sys.exit(rc)"
    )
    for args, rc in ((["--help"], 0), (["--world-size", "x"], 2)):
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=child_env(os.environ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == rc, proc.stderr
        assert proc.stdout.splitlines()[-1] == "False", proc.stdout
