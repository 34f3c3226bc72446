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

    def track(self, loop: str, expected_s: float = 0.0, tolerate: int = 0) -> _RoundTrip:
        """Wrap one round trip of ``loop`` (``with breaker.track(...):``); ``expected_s`` is
        time it may legitimately take (a blocking read's BLOCK) before it counts as a stall.
        ``tolerate`` quick failures in a row do not open the breaker (a loop that redoes
        them at once on a new connection); a failure after a stall always does."""
        return _RoundTrip(self, loop, time.monotonic() + expected_s, tolerate)

    def _began(self, loop: str, since: float) -> None:
        self._busy_since[loop] = since

    def _ended(self, loop: str, since: float, tolerate: int, failed: bool | None) -> None:
        """``failed`` None: the round trip ended by another exception (a bug), which
        neither opens nor closes the breaker."""
        now = time.monotonic()
        stalled = now - since > self._open_after_s
        if stalled and not self._was_open:
            # Every loop was inside a round trip while this one stalled, so none was idle
            # to poll the opening: count it before the round trip's end hides it.
            self._note()
        self._busy_since[loop] = 0.0
        if failed is None:
            return
        if failed:
            self._strikes[loop] += 1
            if self._strikes[loop] > tolerate or stalled:
                self._failed.add(loop)
        else:
            self._strikes[loop] = 0
            self._failed.discard(loop)
        if self._failed or self._was_open:
            self.poll()

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


class _RoundTrip:
    """The context of :meth:`Breaker.track`: a class, not a generator, since the sender and
    the listener enter one per round trip."""

    __slots__ = ("_breaker", "_loop", "_since", "_tolerate")

    def __init__(self, breaker: Breaker, loop: str, since: float, tolerate: int) -> None:
        self._breaker = breaker
        self._loop = loop
        self._since = since
        self._tolerate = tolerate

    def __enter__(self) -> None:
        self._breaker._began(self._loop, self._since)

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        # Returns None: never swallows, the loop handles what it caught.
        failed: bool | None = False
        if kind is not None:
            failed = True if issubclass(kind, (BrokerLookupError, redis.RedisError)) else None
        self._breaker._ended(self._loop, self._since, self._tolerate, failed)
