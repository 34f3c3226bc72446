"""``broker-lookup server``, ``demo --keep`` and every subcommand's ``--help``, as a user runs
them: real processes, every one of them stopped and checked gone."""

from __future__ import annotations

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
from helpers import gone, wait_until

from broker_lookup.cli import COMMANDS
from broker_lookup.cli import main as cli_main
from broker_lookup.processes import child_env, python_module

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


# ``worker --help`` execs ``python -m workers --help``: test_cli runs it as a process.
@pytest.mark.parametrize("command", [None, *(n for n, c in COMMANDS.items() if not c.passthrough)])
def test_help_answers(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:"), out
    if command is not None:
        assert COMMANDS[command].help in " ".join(out.split())


class Served:
    """A ``broker-lookup server`` process and what it printed first."""

    def __init__(self, *args: str) -> None:
        argv = python_module("broker_lookup.cli", ["server", *args])
        self.proc = subprocess.Popen(
            argv,
            env=child_env(os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        # Its banner, up to the line on how to stop it (or its exit): read line by line,
        # never with communicate(), which would skip what readline buffered.
        self.first = ""
        for line in self.proc.stdout:
            self.first += line
            if line.startswith("Stop it with"):
                break

    @property
    def url(self) -> str:
        found = re.match(r"listening on (redis://\S+)", self.first)
        assert found, self.first + self._rest()
        return found.group(1)

    def _rest(self) -> str:
        return (
            ""
            if self.proc.poll() is None
            else (self.proc.stderr.read() if self.proc.stderr else "")
        )

    def server_pid(self) -> int:
        r = redis.Redis.from_url(self.url)
        try:
            return int(r.info("server")["process_id"])
        finally:
            r.close()


@pytest.fixture
def served() -> Iterator[list[Served]]:
    made: list[Served] = []
    try:
        yield made
    finally:
        for s in made:  # SIGTERM: it stops its own server in order
            s.proc.terminate()
            try:
                s.proc.wait(10)
            except subprocess.TimeoutExpired:
                s.proc.kill()
                s.proc.wait()


def test_server_serves_until_ctrl_c_then_stops_its_server(served: list[Served]) -> None:
    served.append(Served("--port", "0"))
    server = served[0]
    pid = server.server_pid()  # it answers: PING/INFO over the printed URL
    server.proc.send_signal(signal.SIGINT)
    out, _err = server.proc.communicate(timeout=60)
    assert server.proc.returncode == 0, _err
    assert f"export BROKER_LOOKUP_REDIS_URL={server.url}" in server.first and "stopping" in out
    wait_until(lambda: gone(pid), timeout=30)


def test_server_on_a_taken_port_says_so(served: list[Served]) -> None:
    served.append(Served("--port", "0"))
    port = served[0].url.rsplit(":", 1)[1].split("/")[0]
    second = Served("--port", port)
    served.append(second)
    _out, err = second.proc.communicate(timeout=60)
    assert second.proc.returncode == 1
    assert f"port {port} is taken" in err and "--port 0" in err


def _path_without_redis_cli(tmp_path: Path) -> str:
    """PATH minus every directory holding redis-cli (setpriv kept: children die with us)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    setpriv = shutil.which("setpriv")
    if setpriv:
        (bin_dir / "setpriv").symlink_to(setpriv)
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    kept = [d for d in dirs if not (Path(d) / "redis-cli").exists()]
    return os.pathsep.join([str(bin_dir), *kept])


# Ten seconds of processes (the demo, then each hint it prints): the long leg; the default
# run keeps the plain demo's tests (test_cli.py), and CI runs `broker-lookup demo` itself.
@pytest.mark.long
def test_demo_keep_leaves_only_the_server_and_its_hints_work(tmp_path: Path) -> None:
    env = child_env(os.environ, {"PATH": _path_without_redis_cli(tmp_path)})
    demo = subprocess.run(
        [sys.executable, "-m", "broker_lookup.cli", "demo", "--keep", "--ranks", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = demo.stdout
    kept = re.search(r"keeps running \(pid (\d+)\): (redis://\S+)", out)
    assert demo.returncode == 0 and kept, out + demo.stderr
    pid, url = int(kept.group(1)), kept.group(2)
    try:
        assert f"Stop it with: kill {pid}" in out
        assert "redis-cli" not in out.replace("redis-cli is not installed", "")
        ranks = [int(p) for p in re.findall(r"started rank \d+: pid (\d+)", out)]
        assert ranks and all(gone(p) for p in ranks)  # the ranks stopped: only the server stays
        hint = re.search(r"^  (.+ inspect --redis-url \S+ --engine-id (\S+) .*)$", out, re.M)
        assert hint and url in hint.group(1), out
        inspect = subprocess.run(
            [*_argv(hint.group(1))], env=env, capture_output=True, text=True, timeout=60
        )
        assert inspect.returncode == 0 and hint.group(2) in inspect.stdout, inspect.stderr
        r = redis.Redis.from_url(url)
        try:
            server_pid = int(r.info("server")["process_id"])
        finally:
            r.close()
    finally:
        os.kill(pid, signal.SIGTERM)  # what the demo told the user to do
    wait_until(lambda: gone(pid), timeout=30)
    wait_until(lambda: gone(server_pid), timeout=30)


def _argv(command: str) -> list[str]:
    """The printed command as argv (it holds no quoted argument)."""
    words = command.split()
    if words[0] == "broker-lookup":
        return python_module("broker_lookup.cli", words[1:])
    return words
