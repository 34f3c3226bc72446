"""The rank's sweeper thread: watchdog, pin TTL, memo expiry and progress, on their own clock.

It runs apart from the consumer's read loop, so a stalled or unreachable Redis never
pauses them: an engine that never reports is answered and released on time whatever
the network does (DESIGN rules 4 and 11).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from broker_lookup.threads import LoopThread

__all__ = ["Sweeper"]


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
