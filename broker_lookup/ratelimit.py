"""A log line that cannot flood: at most one per interval, the next one counts the rest.

Both sides use it (the rank's dispatcher and watchdog, the client's rank insights), so it
lives here: ``workers`` imports ``broker_lookup``, never the reverse.
"""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["RateLimitedLog"]


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
