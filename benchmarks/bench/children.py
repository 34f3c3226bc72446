"""Child processes of ``python -m benchmarks.bench``: rank hosts and engine drivers.

A child speaks to the bench in lines on its stdout that start with ``@bench`` (``@bench
ready <rank> <pid>``, ``@bench result <json>``); everything else it prints is kept as a
short log tail for error messages. A reader thread drains the pipe all the time, so a
chatty child never blocks on a full pipe. Children die with us: they are started with
:func:`broker_lookup.processes.spawn` (the kernel SIGTERMs them if we die), and
:meth:`Child.stop` sends SIGTERM, then SIGKILL, and always reaps.
"""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

from benchmarks.bench.measure import BenchError
from broker_lookup.processes import child_env, spawn, terminate

__all__ = ["TAG", "Child", "emit", "start_rank_host", "stop_all"]

logger = logging.getLogger(__name__)

#: Prefix of the lines a child sends to the bench.
TAG = "@bench"
_TAIL_LINES = 40


def emit(kind: str, payload: str) -> None:
    """In a child: send one ``@bench <kind> <payload>`` line (one write, so never torn)."""
    sys.stdout.write(f"{TAG} {kind} {payload}\n")
    sys.stdout.flush()


class Child:
    """One child process and the ``@bench`` lines it sent."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str]) -> None:
        self.name = name
        self._lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self.proc = spawn(argv, child_env(env), output=subprocess.PIPE, stdin=subprocess.PIPE)
        self._reader = threading.Thread(target=self._read, name=f"bench-child-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # created with stdout=PIPE
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(TAG + " "):
                kind, _, payload = line[len(TAG) + 1 :].partition(" ")
                self._lines.put((kind, payload))
            else:
                self._tail.append(line)
        self._lines.put(("eof", ""))

    def expect(self, kind: str, timeout_s: float) -> str:
        """Wait for the next ``@bench <kind>`` line and return its payload.

        Raises:
            BenchError: the child exited, sent something else, or said nothing in time.
        """
        try:
            got, payload = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise BenchError(
                f"{self.name} sent no '{kind}' within {timeout_s:.0f}s{self.tail()}"
            ) from None
        if got != kind:
            raise BenchError(f"{self.name} sent {got!r} instead of {kind!r}{self.tail()}")
        return payload

    def send(self, line: str) -> None:
        """Write one line to the child's stdin."""
        assert self.proc.stdin is not None  # created with stdin=PIPE
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def tail(self) -> str:
        """The last lines the child logged, for an error message."""
        if not self._tail:
            return ""
        return "; its output ends with:\n  " + "\n  ".join(self._tail)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait, SIGKILL if needed, reap; return the exit code."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        code = terminate([self.proc], timeout_s)[0]
        self._reader.join(timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


def stop_all(children: Sequence[Child], timeout_s: float = 10.0) -> None:
    """Stop every child (each bounded by ``timeout_s``), logging failures, never raising."""
    for child in children:
        try:
            code = child.stop(timeout_s)
        except Exception:  # cleanup must reach the next child whatever happened
            logger.exception("stopping %s failed", child.name)
            continue
        if code not in (0, -15):
            logger.warning("%s exited with %d%s", child.name, code, child.tail())


def start_rank_host(
    name: str, argv: Sequence[str], env: dict[str, str], n_ranks: int, timeout_s: float
) -> tuple[Child, dict[str, dict[int, int]]]:
    """Start a rank host and wait until all ``n_ranks`` said ``ready <engine> <rank> <pid>``.

    Returns:
        The host and the pid of every rank, by engine id then rank. The host is stopped
        again if a rank fails to come up.
    """
    host = Child(name, argv, env)
    pids: dict[str, dict[int, int]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(n_ranks):
            left = max(0.1, deadline - time.monotonic())
            engine_id, rank, pid = host.expect("ready", left).split()
            pids.setdefault(engine_id, {})[int(rank)] = int(pid)
    except BaseException:
        stop_all([host])
        raise
    return host, pids
