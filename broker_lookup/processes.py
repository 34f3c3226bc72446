"""Child processes of the CLI, the tools and the rank supervisor: start them, stop them, no orphans.

Two ways to make a child die with its parent, one per way of starting it:

* an exec'd child (:func:`spawn`) runs under ``setpriv --pdeathsig TERM``
  (:func:`parent_death_prefix`), so the kernel SIGTERMs it if we die, even of SIGKILL;
* a forked child (no exec) calls :func:`die_with_parent` first, which asks the kernel
  for the same thing with ``prctl(PR_SET_PDEATHSIG)``.

:func:`terminate` sends SIGTERM, waits a bounded time, then SIGKILLs what is left and
always reaps. :class:`ExitCode` names the exit status of every process we ship, and
:func:`bounded` is the argparse ``type`` of their numeric flags (the scheduler's CLI and
``python -m workers`` alike, so it sits below both).
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

__all__ = [
    "ExitCode",
    "bounded",
    "child_env",
    "die_with_parent",
    "free_port",
    "long_options",
    "parent_death_prefix",
    "python_module",
    "spawn",
    "terminate",
]

logger = logging.getLogger(__name__)


class ExitCode(enum.IntEnum):
    """The exit codes of every process we ship: ``broker-lookup``, ranks, tools."""

    OK = 0  #: done, or stopped by a signal, cleanly
    FAILED = 1  #: the work failed: a loop died, a child failed, a target was missed
    USAGE = 2  #: bad arguments, environment or config (a password Redis refuses, too)
    UNREACHABLE = 3  #: Redis did not answer in time at startup
    #: another live process holds this rank of this engine id (its lease): this one did
    #: not get it within ``--claim-timeout`` (two processes started for one rank)
    NOT_OWNER = 4
    INTERRUPTED = 130  #: Ctrl-C


#: The directory holding the ``broker_lookup`` and ``workers`` packages.
_SOURCE_ROOT = str(Path(__file__).resolve().parent.parent)


def bounded(
    kind: Callable[[str], float], low: float, high: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: ``kind`` of the text, refused unless ``>= low`` (``> low`` with
    ``above``) and ``<= high``; argparse's error then names the flag and the value.

    >>> bounded(int, 0, 65535)("70000")
    Traceback (most recent call last):
    argparse.ArgumentTypeError: 70000 is not in [0, 65535]
    """

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {_KINDS.get(kind, 'valid')}"
            ) from None
        if (
            value != value
            or (value <= low if above else value < low)
            or (high is not None and value > high)
        ):
            rule = f"> {low:g}" if above else f">= {low:g}"
            if high is not None:
                rule = f"in {'(' if above else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text} is not {rule}")
        return value

    parse.__name__ = kind.__name__  # argparse names the kind in its message with it
    return parse


_KINDS: dict[object, str] = {int: "an integer", float: "a number"}


def child_env(base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` plus ``extra``, with our packages importable even when not installed."""
    env = {**base, **(extra or {})}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _SOURCE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_SOURCE_ROOT, *paths])
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now, for a child server to bind (the
    kernel picked it; another process may take it before the child does, so a caller that
    must succeed retries on a fresh one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def python_module(module: str, args: Sequence[str] = ()) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def long_options(options: Mapping[str, object]) -> list[str]:
    """``{"port": 6379, "save": ""}`` -> ``["--port", "6379", "--save", ""]``: options as argv."""
    args: list[str] = []
    for name, value in options.items():
        args += [f"--{name}", str(value)]
    return args


def parent_death_prefix() -> list[str]:
    """argv prefix ``setpriv --pdeathsig TERM --``: the kernel SIGTERMs the child if we die.

    Empty when ``setpriv`` is missing, or when called off the main thread.
    """
    # The kernel ties PDEATHSIG to the thread that forked: a child started from a
    # short-lived thread would be killed when that thread ends, so only the main thread uses it.
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "TERM", "--"]


#: ``prctl`` option: the signal this process gets when its parent thread dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a forked child that does not exec: have the kernel send ``sig`` when the parent dies.

    Call it first thing after the fork. Outside Linux it does nothing: the parent still
    stops its children itself (SIGTERM, then SIGKILL).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        pass


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    output: IO[bytes] | int | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: IO[bytes] | int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as a child that dies with us.

    Args:
        argv: The command; :func:`parent_death_prefix` is put in front of it.
        env: The child's whole environment (see :func:`child_env`).
        output: Takes its stdout and stderr (a file, ``subprocess.PIPE``); None: ours.
        cwd: Its working directory; None: ours.
        stdin: Its stdin; ``subprocess.PIPE`` to write to it (default: nothing).
    """
    return subprocess.Popen(
        [*parent_death_prefix(), *argv],
        env=dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=output,
        stderr=subprocess.STDOUT if output is not None else None,
    )


def run_in_group(
    argv: Sequence[str],
    env: Mapping[str, str],
    log: Path,
    timeout_s: float,
    cwd: str | os.PathLike[str] | None = None,
) -> int:
    """Run ``argv`` in a process group of its own, its output to ``log``; its exit code, or
    -1 past ``timeout_s``. The whole group (what it started: vLLM's engine and workers)
    is ended after, as :func:`end_group` does."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            end_group(proc)


def end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL, the process group ``proc`` leads (all it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig is signal.SIGTERM:
            time.sleep(0.5)  # the group's other members (vLLM's workers) get their moment too


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
