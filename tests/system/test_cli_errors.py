"""A bad value given to a tool is one clear line naming the value and where it came from
(the flag, or the variable), with exit code 2; a port that is no Redis server's is one line
too. Never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from broker_lookup.cli import main as cli_main
from broker_lookup.config import env_name
from broker_lookup.processes import ExitCode, child_env, python_module

pytestmark = [pytest.mark.timeout(180)]

TOOLS = [["doctor"], ["inspect"], ["exporter", "--once"]]
TOOL_IDS = ["doctor", "inspect", "exporter"]


def _workers(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    return subprocess.run(
        python_module("workers", list(args)),
        env=child_env(clean, env or {}),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def not_redis() -> Iterator[str]:
    """``redis://`` URL of a port that answers as a web server does."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(1024)
                conn.sendall(b"<html>400 Bad Request</html>\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    # close() alone leaves accept() blocked until join() times out; shutdown() wakes it now.
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(5)
    assert not thread.is_alive(), "the fake web server's thread did not stop"


@pytest.mark.parametrize("tool", TOOLS, ids=TOOL_IDS)
def test_a_port_that_is_not_redis_is_one_line(
    not_redis: str,
    tool: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(env_name("redis_url"), raising=False)
    code = cli_main([*tool, "--redis-url", not_redis])
    out = capsys.readouterr()
    assert code in (ExitCode.FAILED, ExitCode.UNREACHABLE), out
    said = [line for line in (out.out + out.err).splitlines() if "Redis protocol" in line]
    assert len(said) == 1 and "check redis_url's host and port" in said[0], out
    assert "Traceback" not in out.err


def test_a_rank_on_a_port_that_is_not_redis_exits_3_in_one_line(not_redis: str) -> None:
    proc = _workers(
        *("--engine-id", "e", "--world-size", "1", "--rank", "0", "--metrics-port", "0"),
        *("--redis-url", not_redis, "--connect-timeout", "1"),
    )
    assert proc.returncode == ExitCode.UNREACHABLE, proc.stderr
    assert "does not speak the Redis protocol" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("tool", [*TOOLS, ["worker-process"]], ids=[*TOOL_IDS, "worker"])
def test_a_port_out_of_range_is_refused_naming_the_flag(
    tool: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(env_name("redis_url"), raising=False)
    url = "redis://cache:99999/0"
    if tool == ["worker-process"]:
        proc = _workers("--engine-id", "e", "--world-size", "1", "--rank", "0", "--redis-url", url)
        code, text = proc.returncode, proc.stderr
    else:
        code = cli_main([*tool, "--redis-url", url])
        out = capsys.readouterr()
        text = out.out + out.err
    assert code == ExitCode.USAGE, text
    assert "redis_url='redis://cache:99999/0' (flag --redis-url) is invalid: the port" in text
    assert "out of range 0-65535" in text and "Traceback" not in text


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["inspect", "--watch", "-1"], "argument --watch: -1 is not > 0"),
        (["inspect", "--limit", "x"], "argument --limit: 'x' is not an integer"),
        (["exporter", "--port", "70000"], "argument --port: 70000 is not in [0, 65535]"),
        (["doctor", "--connect-timeout", "0"], "argument --connect-timeout: 0 is not > 0"),
        (["inspect", "--engine-id", "a{b}"], "argument --engine-id: 'a{b}' is invalid"),
        (["acl", "--engine-id", "a b"], "argument --engine-id: 'a b' is invalid"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(args) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--claim-timeout", "-1"], "argument --claim-timeout: -1 is not >= 0"),
        (["--connect-timeout", "-5"], "argument --connect-timeout: -5 is not > 0"),
        (["--engine-id", "a{b}"], "--engine-id='a{b}' is invalid"),
    ],
)
def test_a_bad_worker_flag_exits_2_naming_the_flag(args: list[str], said: str) -> None:
    base = ["--engine-id", "e", "--world-size", "1", "--rank", "0"]
    proc = _workers(*base, *args, "--redis-url", "redis://127.0.0.1:1/0")
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert said in proc.stderr and "env BROKER_LOOKUP_ENGINE_ID" not in proc.stderr


def test_a_bad_engine_id_variable_is_blamed_on_the_variable() -> None:
    proc = _workers(
        *("--world-size", "1", "--rank", "0", "--redis-url", "redis://127.0.0.1:1/0"),
        env={env_name("engine_id"): "a{b}"},
    )
    assert proc.returncode == ExitCode.USAGE, proc.stderr
    assert f"env {env_name('engine_id')}='a{{b}}' is invalid" in proc.stderr
