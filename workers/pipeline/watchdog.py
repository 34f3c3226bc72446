"""The rank's sweeper thread: watchdog, pin TTL and memo expiry, on their own clock.

It runs apart from the consumer's read loop, so a stalled or unreachable Redis never
pauses them: an engine that never reports is answered and released on time whatever
the network does (DESIGN rules 4 and 11).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from broker_lookup.threads import LoopThread

__all__ = ["RateLimitedLog", "Sweeper"]


class RateLimitedLog:
    """Logs one line per ``every_s`` at most; the next line says how many were skipped."""

    def __init__(self, log: logging.Logger, every_s: float = 10.0) -> None:
        self._log = log
        self._every_s = every_s
        self._next = 0.0
        self._skipped = 0
        self._lock = threading.Lock()

    def __call__(self, level: int, msg: str, *args: object) -> None:
        """Log ``msg % args`` at ``level`` unless a line went out less than ``every_s`` ago."""
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                self._skipped += 1
                return
            skipped, self._skipped, self._next = self._skipped, 0, now + self._every_s
        if skipped:
            msg += " (%d similar line(s) skipped)"
            args = (*args, skipped)
        self._log.log(level, msg, *args)


class Sweeper(LoopThread):
    """Calls ``sweep(now)`` (monotonic seconds) every ``interval_s`` until :meth:`stop`."""

    def __init__(self, name: str, interval_s: float, sweep: Callable[[float], None]) -> None:
        super().__init__(name)
        self._interval_s = interval_s
        self._sweep = sweep

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._sweep(time.monotonic())
            except Exception:  # a bug: counted and logged, never a silent dead thread
                self.guard()
