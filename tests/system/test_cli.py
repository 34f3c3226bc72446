"""``broker-lookup demo``, ``inspect`` and ``worker`` as a user runs them: subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import RealServer, engine_keys, gone, wait_until

from broker_lookup.config import LookupConfig
from broker_lookup.processes import child_env, free_port, python_module, spawn, terminate
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(300)]

STARTUP_S = 90.0
FAST = {
    "BROKER_LOOKUP_HEARTBEAT_INTERVAL_MS": "200",
    "BROKER_LOOKUP_HEARTBEAT_TTL_MS": "800",
    "BROKER_LOOKUP_BLOCK_MS": "100",
}


def _cli(*args: str) -> list[str]:
    """``broker-lookup ARGS`` (the console script when installed, else ``python -m``)."""
    script = Path(sys.executable).with_name("broker-lookup")
    if script.exists():
        return [str(script), *args]
    return python_module("broker_lookup.cli", args)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cli(*args), env=child_env(os.environ), capture_output=True, text=True, timeout=timeout
    )


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline:
                found.append(int(entry.name))
    return found


def _check_demo_output(out: str, hints: bool = True) -> list[int]:
    """Assert the demo's story; return every pid it started. ``hints``: the server stays,
    so the commands to inspect it are printed (redis-cli's only where it is installed)."""
    for case in ("FULL", "PARTIAL", "ZERO"):
        assert re.search(rf"^{case} .*expected +\d+ +got +\d+ +OK", out, re.M), out
    assert re.search(r"^CANCEL ", out, re.M) and "exists=0" in out and "lookup_cache=-1" in out
    assert "per-rank hits (HGETALL): r0=" in out
    if not hints:  # never a command pointing at the server the demo stops
        assert "redis-cli" not in out and " inspect --redis-url" not in out
        assert "broker-lookup demo --keep" in out
    elif shutil.which("redis-cli"):
        for command in ("--scan --pattern", "HGETALL", "TTL", "XINFO GROUPS", "XPENDING", "XLEN"):
            pattern = rf"^  redis-cli -h 127\.0\.0\.1 -p \d+ -n 0 {command} 'bl:{{"
            assert re.search(pattern, out, re.M)
    if hints:
        assert re.search(r"(broker-lookup|-m broker_lookup\.cli) inspect --redis-url", out)
    assert re.search(r"ranks stopped: r0=0", out)
    assert out.rstrip().endswith("demo OK")
    return [int(p) for p in re.findall(r"pid (\d+)", out)]


def test_demo_with_embedded_server_exits_0_and_leaves_no_process() -> None:
    proc = _run("demo", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = _check_demo_output(proc.stdout, hints=False)
    assert len(pids) == 3  # the embedded server and two ranks
    assert all(gone(pid) for pid in pids)
    engine = re.search(r"engine: (\S+)", proc.stdout)
    assert engine is not None
    assert _processes_mentioning(engine.group(1)) == []


def test_demo_on_a_given_server_with_one_rank(real_server: RealServer) -> None:
    proc = _run("demo", "--redis-url", real_server.url, "--ranks", "1", timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = _check_demo_output(proc.stdout)
    assert len(pids) == 1 and gone(pids[0])
    assert "(given)" in proc.stdout
    engine = re.search(r"engine: (\S+)", proc.stdout)
    assert engine is not None
    left = engine_keys(redis.Redis.from_url(real_server.url), engine.group(1))
    assert left  # its streams stay, until they expire: nothing is left without a TTL
    ttl = LookupConfig().engine_ttl_ms
    assert {key: pttl for key, pttl in left.items() if not 0 < pttl <= ttl} == {}


@pytest.fixture
def live_engine(
    real_server: RealServer, engine_id: str, tmp_path: Path
) -> Iterator[dict[int, subprocess.Popen[bytes]]]:
    """Ranks 0 and 1 of ``engine_id`` as processes, heartbeating."""
    env = child_env(os.environ, {**FAST, "BROKER_LOOKUP_REDIS_URL": real_server.url})
    procs = {}
    for rank in (0, 1):
        argv = ["--engine-id", engine_id, "--world-size", "2", "--rank", str(rank)]
        with open(tmp_path / f"rank-{rank}.log", "wb") as out:
            procs[rank] = spawn(python_module("workers", [*argv, "--metrics-port", "0"]), env, out)
    client = redis.Redis.from_url(real_server.url)
    keys = KeySpace(engine_id)
    try:
        wait_until(
            lambda: client.exists(keys.heartbeat(0), keys.heartbeat(1)) == 2,
            timeout=STARTUP_S,
            interval=0.05,
        )
        yield procs
    finally:
        client.close()
        terminate(list(procs.values()), 15.0)


def test_inspect_json_shows_live_ranks_and_check_follows_them(
    real_server: RealServer, engine_id: str, live_engine: dict[int, subprocess.Popen[bytes]]
) -> None:
    proc = _run("inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--json")
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert sorted(snap["ranks"]) == ["0", "1"]
    assert {snap["ranks"][str(r)]["pid"] for r in (0, 1)} == {p.pid for p in live_engine.values()}
    assert sorted(g["name"] for g in snap["groups"]) == ["rank-0", "rank-1"]
    assert snap["world_size"] == 2 and snap["check"] == {"ok": True, "reasons": []}

    check = ["inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--check"]
    ok = _run(*check, "--world-size", "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "CHECK OK" in ok.stdout

    live_engine[1].send_signal(signal.SIGTERM)
    assert live_engine[1].wait(timeout=10) == 0
    failed = _run(*check)  # world size from the groups, which outlive the rank
    assert failed.returncode == 1, failed.stdout
    assert "CHECK FAILED" in failed.stdout and "rank 1: no heartbeat" in failed.stdout


def test_inspect_shows_a_pending_lookup_with_its_missing_rank(
    real_server: RealServer, engine_id: str
) -> None:
    client = redis.Redis.from_url(real_server.url)
    key = KeySpace(engine_id).lookup("req-7")
    try:
        client.hset(key, mapping={"state": "pending", "gen": "1", "expected": "0,1", "r0": "32"})
        client.pexpire(key, 60_000)
        proc = _run("inspect", "--redis-url", real_server.url, "--engine-id", engine_id)
        as_json = _run(
            "inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--json"
        )
    finally:
        client.delete(key)
        client.close()
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  pending .* - +r0=32 +1 +req-7$", proc.stdout, re.M), proc.stdout
    (item,) = json.loads(as_json.stdout)["lookups"]["shown"]
    assert item["id"] == "req-7" and item["hits"] == {"0": 32} and item["missing"] == [1]
    assert 0 < item["ttl_ms"] <= 60_000


def test_inspect_never_prints_the_password(
    fresh_real_server: EmbeddedServer, engine_id: str
) -> None:
    url = fresh_real_server.url.replace("redis://", "redis://:s3cret-pw@")  # wrong password
    proc = _run("inspect", "--redis-url", url, "--engine-id", engine_id, "--check")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "s3cret-pw" not in out and "redis://:***@127.0.0.1" in out


def test_inspect_watch_repeats_until_ctrl_c(
    real_server: RealServer, engine_id: str, tmp_path: Path
) -> None:
    out_path = tmp_path / "watch.out"
    conn = redis.Redis.from_url(real_server.url)
    conn.set(KeySpace(engine_id).heartbeat(0), "{}", px=60_000)  # the engine exists
    conn.close()
    argv = ["inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--watch", "0.2"]
    with open(out_path, "wb") as out:
        proc = spawn(_cli(*argv), child_env(os.environ), out)
    try:
        wait_until(lambda: out_path.read_text().count("-" * 72) >= 2, timeout=60, interval=0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        terminate([proc], 5.0)


def test_inspect_unreachable_redis_exits_3() -> None:
    port = free_port()  # nothing listens there
    proc = _run("inspect", "--redis-url", f"redis://127.0.0.1:{port}/0", "--engine-id", "e")
    assert proc.returncode == 3
    assert "cannot inspect redis://127.0.0.1" in proc.stderr


def test_worker_subcommand_is_python_m_workers() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    proc = subprocess.run(
        _cli("worker", "--world-size", "1", "--rank", "0"),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--engine-id (env BROKER_LOOKUP_ENGINE_ID) is required" in proc.stderr
    help_text = _run("worker", "--help")
    assert help_text.returncode == 0 and "python -m workers" in help_text.stdout


def test_cli_usage_errors_exit_2() -> None:
    assert _run("nope").returncode == 2
    assert _run("inspect", "--engine-id", "no{braces}").returncode == 2
    assert _run("demo", "--ranks", "0").returncode == 2


def test_inspect_shows_the_callers_id_of_a_digest_key(
    real_server: RealServer, engine_id: str
) -> None:
    client = redis.Redis.from_url(real_server.url)
    hostile = "user's id {with} spaces"
    key = KeySpace(engine_id).lookup(hostile)
    try:
        client.hset(key, mapping={"state": "pending", "gen": "1", "expected": "0", "id": hostile})
        client.pexpire(key, 60_000)
        as_json = _run(
            "inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--json"
        )
    finally:
        client.delete(key)
        client.close()
    (item,) = json.loads(as_json.stdout)["lookups"]["shown"]
    assert item["id"] == hostile


def test_inspect_of_an_engine_id_that_matches_nothing_exits_1(
    real_server: RealServer, engine_id: str
) -> None:
    proc = _run("inspect", "--redis-url", real_server.url, "--engine-id", engine_id)
    assert proc.returncode == 1
    assert f"no key of engine {engine_id} on redis://" in proc.stderr


def test_inspect_allow_absent_passes_an_engine_with_no_key_yet(
    real_server: RealServer, engine_id: str
) -> None:
    """A fresh install: nothing has served the engine; Redis answered, so the check passes."""
    argv = ["inspect", "--redis-url", real_server.url, "--engine-id", engine_id, "--check"]
    proc = _run(*argv, "--allow-absent")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"no process of engine {engine_id} has registered" in proc.stdout
    as_json = json.loads(_run(*argv, "--allow-absent", "--json").stdout)
    assert as_json["instances"] == [] and as_json["check"]["ok"] is True
    unreachable = _run(*argv[:2], f"redis://127.0.0.1:{free_port()}/0", *argv[3:], "--allow-absent")
    assert unreachable.returncode == 3, unreachable.stdout + unreachable.stderr


def test_inspect_of_the_fleet_lists_engines_and_check_fails_on_a_conflict(
    real_server: RealServer,
    engine_id: str,
    live_engine: dict[int, subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    fleet = ["inspect", "--redis-url", real_server.url]
    proc = _run(*fleet, "--json")
    assert proc.returncode == 0, proc.stderr
    (mine,) = [e for e in json.loads(proc.stdout)["engines"] if e["engine_id"] == engine_id]
    assert mine["live"] and sorted(mine["ranks"]) == ["0", "1"]
    assert {mine["ranks"][str(r)]["owner"]["pid"] for r in (0, 1)} == {
        p.pid for p in live_engine.values()
    }
    # A second rank-1 process of the same engine: it waits, and the fleet check fails.
    env = child_env(os.environ, {**FAST, "BROKER_LOOKUP_REDIS_URL": real_server.url})
    argv = ["--engine-id", engine_id, "--world-size", "2", "--rank", "1", "--metrics-port", "0"]
    with open(tmp_path / "dup.log", "wb") as out:
        dup = spawn(python_module("workers", argv), env, out)
    try:
        conn = redis.Redis.from_url(real_server.url)
        wait_until(lambda: conn.exists(KeySpace(engine_id).contender("1")), timeout=STARTUP_S)
        conn.close()
        failed = _run(*fleet, "--check")
        assert failed.returncode == 1, failed.stdout
        line = next(x for x in failed.stdout.splitlines() if f"engine {engine_id} rank 1" in x)
        assert f"pid {live_engine[1].pid}" in line and f"pid {dup.pid}" in line
        assert "CHECK FAILED" in failed.stdout
        one = _run(*fleet, "--engine-id", engine_id, "--check", "--world-size", "2")
        assert one.returncode == 1 and f"pid {dup.pid}" in one.stdout
    finally:
        terminate([dup], 15.0)
