"""Every tool gives up on a stalled Redis within the connect timeout it prints, and takes a
flag to change it: ``doctor``, ``inspect``, ``exporter --once`` and a rank process.

The fault proxy holds every connection (sockets open, nothing forwarded): what a
partition or a SIGSTOPped server looks like. Before, each tool took 45-50 s, retrying
the socket timeout three times.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from datetime import datetime

import pytest

from broker_lookup.cli import main as cli_main
from broker_lookup.config import env_name
from broker_lookup.processes import ExitCode, child_env, python_module
from faultproxy.proxy import FaultProxy

# Each test waits out a connect timeout against a held server (seconds, and timing is the
# outcome): in the long leg (`-m long`), to keep the default run within its CI budget.
pytestmark = [pytest.mark.real, pytest.mark.long, pytest.mark.timeout(180)]

TIMEOUT_S = 2.0
#: What a give-up may take past the timeout: connecting, closing, a loaded machine.
SLACK_S = 2.5


@pytest.mark.parametrize(
    ("tool", "code"),
    [
        (["doctor"], ExitCode.FAILED),
        (["inspect"], ExitCode.UNREACHABLE),
        (["inspect", "--engine-id", "e"], ExitCode.UNREACHABLE),
        (["exporter", "--once"], ExitCode.UNREACHABLE),
    ],
    ids=["doctor", "inspect", "inspect-engine", "exporter"],
)
def test_a_tool_gives_up_on_a_stalled_server_within_its_connect_timeout(
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tool: list[str],
    code: int,
) -> None:
    monkeypatch.delenv(env_name("redis_url"), raising=False)
    fault_proxy.hold()
    started = time.monotonic()
    got = cli_main([*tool, "--redis-url", fault_proxy.url, "--connect-timeout", f"{TIMEOUT_S:g}"])
    took = time.monotonic() - started
    out = capsys.readouterr()
    assert got == code, out
    assert took < TIMEOUT_S + SLACK_S, f"{tool} gave up after {took:.1f}s"
    assert f"--connect-timeout {TIMEOUT_S:g}s" in out.out + out.err
    assert "Traceback" not in out.err


def test_the_default_connect_timeout_is_printed_in_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for tool in ("doctor", "inspect", "exporter"):
        assert cli_main([tool, "--help"]) == 0
        help_text = " ".join(capsys.readouterr().out.split())
        assert "--connect-timeout SECONDS" in help_text and "(default 5)" in help_text


_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _stamp(log: str, text: str) -> datetime:
    line = next(line for line in log.splitlines() if text in line)
    found = _STAMP.match(line)
    assert found, line
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f")


def test_a_rank_gives_up_within_the_timeout_it_logs(fault_proxy: FaultProxy) -> None:
    fault_proxy.hold()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    args = ["--engine-id", "stall", "--world-size", "1", "--rank", "0", "--metrics-port", "0"]
    args += ["--redis-url", fault_proxy.url, "--connect-timeout", "3", "--log-level", "INFO"]
    proc = subprocess.run(
        python_module("workers", args),
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == ExitCode.UNREACHABLE, proc.stderr
    assert "(up to 3s, --connect-timeout)" in proc.stderr
    began = _stamp(proc.stderr, "connecting to")
    ended = _stamp(proc.stderr, "Redis unreachable after 3s")
    assert (ended - began).total_seconds() < 3 + SLACK_S, proc.stderr
