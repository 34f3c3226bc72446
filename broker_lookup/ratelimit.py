"""A log line that cannot flood: at most one per interval, the next one counts the rest.

The one throttle of every repeated log line, on both sides: the contract path's refused
calls and trimmed prompts, the loops' Redis errors, the sender's losses, the rank's
dispatcher and watchdog, the client's rank insights, the exporter's skipped keys. The
first line of a kind goes out at once, so a problem shows when it starts; while it lasts,
one line per interval says how many were held back. It lives here, below both sides:
``workers`` imports ``broker_lookup``, never the reverse.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs one line per ``every_s`` at most; the next line says how many were skipped."""

    def __init__(
        self,
        log: logging.Logger,
        every_s: float = 10.0,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._log = log
        self._every_s = every_s
        self._clock = clock or time.monotonic  # looked up now: a test may patch it
        self._next = 0.0
        self._skipped = 0
        self._lock = threading.Lock()

    def __call__(self, level: int, msg: str, *args: object) -> None:
        """Log ``msg % args`` at ``level`` unless a line went out less than ``every_s`` ago."""
        now = self._clock()
        with self._lock:
            if now < self._next:
                self._skipped += 1
                return
            skipped, self._skipped, self._next = self._skipped, 0, now + self._every_s
        if skipped:
            msg += " (%d similar line(s) skipped)"
            args = (*args, skipped)
        self._log.log(level, msg, *args)
