"""Child processes of the CLI, the demo and the rank supervisor: start them, stop them, no orphans.

A child is started with ``setpriv --pdeathsig TERM`` (from the main thread) so the kernel
SIGTERMs it if we die, even of SIGKILL; :func:`terminate` sends SIGTERM, waits a bounded
time, then SIGKILLs what is left and always reaps.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = ["ExitCode", "child_env", "python_module", "spawn", "terminate"]

logger = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """The exit codes of every process we ship: ``broker-lookup``, ranks, tools."""

    OK = 0  #: done, or stopped by a signal, cleanly
    FAILED = 1  #: the work failed: a loop died, a child failed, a target was missed
    USAGE = 2  #: bad arguments, environment or config
    UNREACHABLE = 3  #: Redis did not answer in time at startup
    INTERRUPTED = 130  #: Ctrl-C


#: The directory holding the ``broker_lookup`` and ``workers`` packages.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


def child_env(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` plus ``extra``, with our packages importable even when not installed."""
    env = {**base, **(extra or {})}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _SOURCE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *paths])
    return env


def python_module(module: str, args: Sequence[str]) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def _parent_death_wrapper() -> list[str]:
    # The kernel tracks the thread that forked: a child started from a short-lived
    # thread would be killed when that thread ends, so only the main thread uses it.
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "TERM", "--"]


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    output: IO[bytes] | int | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child that dies with us; ``output`` takes its stdout and stderr."""
    return subprocess.Popen(
        [*_parent_death_wrapper(), *argv],
        env=dict(env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
    )


def terminate(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    """SIGTERM every live child, wait up to ``timeout_s`` in all, SIGKILL the rest.

    Returns:
        Each child's exit code, in order (negative: killed by that signal).
    """
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    codes: list[int] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logger.error("pid %d ignored SIGTERM for %.0fs; killing it", proc.pid, timeout_s)
            proc.kill()
            codes.append(proc.wait())
    return codes
