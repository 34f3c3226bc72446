"""Several local ranks: one child process per rank (``python -m workers --rank R``), supervised.

A stop (SIGTERM/SIGINT to the supervisor) is forwarded to every child as SIGTERM;
the supervisor exits 0 when every child exited 0. A child that fails on its own
stops the others, and its exit code becomes the supervisor's, so the pod restarts.
Children die with the supervisor even if it is SIGKILLed (``setpriv --pdeathsig``).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Mapping, Sequence

from broker_lookup.processes import ExitCode, python_module, spawn, terminate

__all__ = ["supervise"]

logger = logging.getLogger(__name__)

#: Longest a child may take to stop after SIGTERM before it is killed.
STOP_GRACE_S = 25.0


def supervise(
    commands: Mapping[int, Sequence[str]],
    env: Mapping[str, str],
    stop: threading.Event,
    poll_s: float = 0.2,
) -> int:
    """Run ``python -m workers <args>`` per rank until ``stop`` or a failure; return the code.

    Args:
        commands: Per rank, the arguments after ``python -m workers``.
        env: The children's environment.
        stop: Set by the signal handlers; forwarded to the children as SIGTERM.
        poll_s: How often children are checked.
    """
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for rank, args in sorted(commands.items()):
            procs[rank] = spawn(python_module("workers", args), env)
            logger.info("started rank %d as pid %d", rank, procs[rank].pid)
        failed = _wait(procs, stop, poll_s)
    finally:
        # Also reached on an exception, so no child outlives the supervisor.
        codes = dict(zip(procs, terminate(list(procs.values()), STOP_GRACE_S), strict=True))
    for rank, code in sorted(codes.items()):
        log = logger.info if code == 0 else logger.error
        log("rank %d exited with code %d", rank, code)
    if failed is not None:
        return _exit_code(codes[failed])
    bad = [code for code in codes.values() if code != 0]
    return _exit_code(bad[0]) if bad else ExitCode.OK


def _exit_code(code: int) -> int:
    # A child killed by a signal has a negative code; the supervisor reports FAILED for it.
    return code if code > 0 else ExitCode.FAILED


def _wait(
    procs: Mapping[int, subprocess.Popen[bytes]], stop: threading.Event, poll_s: float
) -> int | None:
    """Until stopped or every child is gone; the rank that failed on its own, if one did."""
    while not stop.wait(poll_s):
        running = False
        for rank, proc in procs.items():
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0:
                logger.error("rank %d (pid %d) failed with code %d", rank, proc.pid, code)
                return rank
        if not running:
            return None
    return None
