"""Keeps a background loop alive through an unexpected exception, loudly.

Redis and broker errors are handled where they happen. Anything else is a bug; the
loop must not die silently because of it (a dead listener would leave every lookup
waiting for its timeout), so it is counted, logged with its traceback, and the loop
backs off briefly and goes on.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LoopGuard"]

logger = logging.getLogger(__name__)


class LoopGuard:
    """Call from an ``except Exception`` block of a loop body."""

    def __init__(self, name: str, stop: threading.Event, backoff_s: float = 0.2) -> None:
        self.name = name
        self.count = 0
        self._stop = stop
        self._backoff_s = backoff_s

    def __call__(self) -> None:
        """Count and log the exception being handled, then back off (unless stopping)."""
        logger.exception("%s: unexpected error #%d; the loop goes on", self.name, self.count + 1)
        self.count += 1  # after the log line, so whoever sees the count can find the line
        self._stop.wait(self._backoff_s)
