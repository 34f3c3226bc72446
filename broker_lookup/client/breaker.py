"""The client's circuit breaker: is Redis answering right now?

Each loop that talks to Redis (the sender, the listener) wraps every round trip in
:meth:`Breaker.track`. The breaker is open while any loop's last round trip failed,
or while one has been outstanding longer than ``breaker_open_ms`` (a server stopped
with SIGSTOP, a partition that drops packets without a reset). ``lookup()`` reads
:meth:`Breaker.is_open` before it queues anything: while open, a lookup answers 0 at
once instead of waiting for its timeout, and nothing piles up in memory. It closes by
itself with the next successful round trip of every loop that failed.

The hot path only reads plain attributes: no lock, no I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from broker_lookup.errors import BrokerLookupError

__all__ = ["Breaker"]

logger = logging.getLogger(__name__)


class Breaker:
    """Open while a loop's round trip failed or has been outstanding too long."""

    def __init__(self, open_after_s: float, loops: tuple[str, ...]) -> None:
        self._open_after_s = open_after_s
        #: Start (monotonic) of each loop's outstanding round trip; 0.0 when idle.
        self._busy_since = dict.fromkeys(loops, 0.0)
        #: Loops whose last two round trips failed (one reset connection, redone at once
        #: on a new one, is no outage: it must not turn a second of hits into 0).
        self._failed: set[str] = set()
        self._strikes = dict.fromkeys(loops, 0)
        self.openings = 0
        self._was_open = False

    @contextmanager
    def track(self, loop: str, expected_s: float = 0.0, tolerate: int = 0) -> Iterator[None]:
        """Wrap one round trip of ``loop``; ``expected_s`` is time it may legitimately take
        (a blocking read's BLOCK) before it counts as a stall. ``tolerate`` quick failures
        in a row do not open the breaker (a loop that redoes them at once on a new
        connection); a failure after a stall always does."""
        since = time.monotonic() + expected_s
        self._busy_since[loop] = since
        try:
            yield
        except (BrokerLookupError, redis.RedisError):
            self._strikes[loop] += 1
            stalled = time.monotonic() - since > self._open_after_s
            if self._strikes[loop] > tolerate or stalled:
                self._failed.add(loop)
                self._note()
            raise
        finally:
            self._busy_since[loop] = 0.0
        self._strikes[loop] = 0
        if loop in self._failed:
            self._failed.discard(loop)
            self._note()

    def failing(self, loop: str) -> bool:
        """Whether ``loop``'s last round trip failed (it should probe before it waits)."""
        return loop in self._failed

    def is_open(self, now: float | None = None) -> bool:
        """True if Redis failed or stalled: lookups should answer 0 without queuing."""
        if self._failed:
            return True
        if now is None:
            now = time.monotonic()
        limit = now - self._open_after_s
        for since in self._busy_since.values():
            if 0.0 < since < limit:
                return True
        return False

    def poll(self) -> None:
        """Count and log a stall that opened or closed the breaker (a loop's idle tick:
        the hot path only reads :meth:`is_open`, it never logs)."""
        if self.is_open() != self._was_open:
            self._note()

    def _note(self) -> None:
        # Called by the loops on transitions only: logs once per opening and closing.
        now_open = self.is_open()
        if now_open and not self._was_open:
            self.openings += 1
            logger.warning(
                "Redis is failing (%s): lookups answer 0 at once until it answers again",
                ", ".join(sorted(self._failed)) or "stalled",
            )
        elif self._was_open and not now_open:
            logger.info("Redis answers again: lookups go to the ranks")
        self._was_open = now_open
