"""Worker ranks as local processes: ``python -m workers`` per rank of one engine, for the tools.

The demo and the soak both run the shipped worker, as a pod would, rather than a server
inside their own process. :class:`LocalRanks` starts one process per rank with its log
(``rank-<r>.log``) and disk tier (``disk-<r>/``) in a work directory, kills and restarts
one as a crash would, and stops them all in a bounded time. No orphans: the processes are
started with :func:`broker_lookup.processes.spawn` and always reaped.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from broker_lookup.processes import python_module, spawn, terminate

__all__ = ["LocalRanks", "write_preload"]

#: How long a rank may take to stop after SIGTERM before it is killed.
STOP_TIMEOUT_S = 30.0
#: A rank just started has no SIGTERM handler until its interpreter is up: give it this long.
_STARTUP_GRACE_S = 0.5


def write_preload(path: Path, prompts: Sequence[Mapping[str, Any]]) -> Path:
    """Write a ``--preload`` file: ``{"prompts": [{"tokens", "ranks", "fraction", "tier"}]}``.

    See ``workers.runtime.rank.preload`` for what each field means.
    """
    path.write_text(json.dumps({"prompts": list(prompts)}))
    return path


class LocalRanks:
    """The rank processes of one engine, started together, stopped together.

    Args:
        engine_id: The engine whose ranks these are.
        envs: Per rank, its whole environment (Redis URL and settings, see
            :func:`~broker_lookup.processes.child_env`); the world size is ``len(envs)``.
        workdir: Where the ranks' logs and disk tiers go (the caller owns and removes it).
        args: Further ``python -m workers`` options for every rank (``--preload``, ...).
    """

    def __init__(
        self,
        engine_id: str,
        envs: Sequence[Mapping[str, str]],
        workdir: Path,
        args: Sequence[str] = (),
    ) -> None:
        self.n = len(envs)
        self.workdir = workdir
        self._envs = list(envs)
        self._args = [
            *("--engine-id", engine_id, "--world-size", str(self.n)),
            *("--metrics-port", "0", "--connect-timeout", "60"),
            *args,
        ]
        self._started: dict[int, float] = {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start_all(self) -> list[subprocess.Popen[bytes]]:
        """Start every rank; returns their processes, by rank."""
        self.procs = [self._start(rank) for rank in range(self.n)]
        return self.procs

    def log(self, rank: int) -> Path:
        """Rank ``rank``'s log file (every start of it appends)."""
        return self.workdir / f"rank-{rank}.log"

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The last ``lines`` lines of rank ``rank``'s log."""
        try:
            text = self.log(rank).read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def exited(self) -> list[int]:
        """The ranks whose process has exited."""
        return [rank for rank, proc in enumerate(self.procs) if proc.poll() is not None]

    def kill_and_restart(self, rank: int) -> None:
        """SIGKILL rank ``rank`` (a crash, no ordered shutdown), reap it, start it again."""
        self.procs[rank].kill()
        self.procs[rank].wait()
        self.procs[rank] = self._start(rank)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
        """SIGTERM every rank, wait up to ``timeout_s``, SIGKILL the rest; their exit codes."""
        if self._started:
            wait_s = max(self._started.values()) + _STARTUP_GRACE_S - time.monotonic()
            time.sleep(max(0.0, wait_s))
        codes = terminate(self.procs, timeout_s)
        self.procs = []
        self._started.clear()
        return codes

    def _start(self, rank: int) -> subprocess.Popen[bytes]:
        args = [*self._args, "--rank", str(rank), "--disk-dir", str(self.workdir / f"disk-{rank}")]
        self._started[rank] = time.monotonic()
        with open(self.log(rank), "ab") as log:
            return spawn(python_module("workers", args), self._envs[rank], output=log)
