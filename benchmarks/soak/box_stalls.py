"""When the box itself stalled: the server or the soak's own process did not run for a while.

A lease says that a process is alive and connected. On a box starved of CPU, the server
or a process may not run at all for longer than a lease; every heartbeat then lapses,
whatever the ranks do, and a client rightly takes a rank for dead. The liveness soak
counts the ``dead_rank`` answers of such a moment apart from the others:
:class:`BoxStalls` pings the server from a thread of its own, on a direct connection,
and records each ping that took ``threshold_s`` or more, and each step of the soak's
loop that came ``threshold_s`` or more late, as a stall ``(start, end)`` in
``time.monotonic()`` seconds.
"""

from __future__ import annotations

import threading
import time

import redis

__all__ = ["BoxStalls"]

_PING_EVERY_S = 0.1


class BoxStalls:
    """The box's stalls, watched until :meth:`stop`."""

    def __init__(self, conn: redis.Redis, threshold_s: float = 1.0) -> None:
        self._conn, self.threshold_s = conn, threshold_s
        self.stalls: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="box-stalls", daemon=True)
        self._last_step = time.monotonic()

    def start(self) -> BoxStalls:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def step(self, now: float) -> None:
        """One step of the soak's loop at ``now``: a late one is a stall of this process."""
        if now - self._last_step >= self.threshold_s:
            self._add(self._last_step, now)
        self._last_step = now

    def _watch(self) -> None:
        while not self._stop.wait(_PING_EVERY_S):
            sent = time.monotonic()
            try:
                self._conn.ping()
            except redis.RedisError:
                pass  # a ping that timed out still took its time: judged below
            done = time.monotonic()
            if done - sent >= self.threshold_s:
                self._add(sent, done)

    def _add(self, start: float, end: float) -> None:
        with self._lock:
            self.stalls.append((start, end))

    def explains(self, at: float, grace_s: float) -> bool:
        """Whether a stall was going on at ``at``, or ended less than ``grace_s`` before."""
        with self._lock:
            return any(start <= at <= end + grace_s for start, end in self.stalls)

    def total_s(self) -> float:
        """Seconds of stall, all together (a stall both watches saw counts twice)."""
        with self._lock:
            return round(sum(end - start for start, end in self.stalls), 1)
