"""The rank's sweeper thread: watchdog, pin TTL, memo expiry and progress, on their own clock.

It runs apart from the consumer's read loop, so a stalled or unreachable Redis never
pauses them: an engine that never reports is answered and released on time whatever
the network does (a worker always answers; an engine that never reports is answered 0
and cleaned up after its deadline).

It sweeps when its plan says (``Lifecycle.plan_sweep``: the earliest timer or hold), not
on a fixed tick: every wake-up of an idle thread costs a vLLM worker about 0.15 ms of CPU
on a small VM, and a 50 ms tick cost an idle rank 3 ms of CPU a second. Something due
sooner than the planned wake rings it (:meth:`Sweeper.ring`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from broker_lookup.threads import LoopThread

__all__ = ["Plan", "Sweeper"]

#: ``plan(soonest, latest)``: the monotonic time of the next sweep, within those bounds.
Plan = Callable[[float, float], float]


class Sweeper(LoopThread):
    """Calls ``sweep(now)`` (monotonic seconds) when ``plan`` says, until :meth:`stop`.

    Args:
        name: the thread's name.
        sweep: the work, given monotonic ``now``.
        plan: when to sweep next; rings :meth:`ring` when that comes sooner meanwhile.
        min_s: the least time between two sweeps (a busy rank sweeps at this period).
        max_s: the longest sleep without a sweep, so a lost ring costs at most this.
    """

    def __init__(
        self, name: str, sweep: Callable[[float], None], plan: Plan, min_s: float, max_s: float
    ) -> None:
        super().__init__(name)
        self._sweep = sweep
        self._plan = plan
        self._min_s = min_s
        self._max_s = max_s
        self._bell = threading.Event()
        #: Sweeps run (for tests and the idle-cost measurement).
        self.sweeps = 0

    def ring(self) -> None:
        """Something falls due sooner than planned (any thread): plan again now."""
        self._bell.set()

    def stop(self, timeout_s: float) -> bool:
        """Stop the loop and join it (bounded); False if the join timed out."""
        self._stop.set()
        self._bell.set()
        return super().stop(timeout_s)

    def _run(self) -> None:
        last = -math.inf
        while not self._stop.is_set():
            now = time.monotonic()
            wake = self._plan(last + self._min_s, now + self._max_s)
            if wake > now:
                # Rung or timed out, the plan is made again: a ring brings the wake
                # forward, a timeout finds it due. A ring between the wait and the clear
                # is not lost: the plan sees what rang.
                self._bell.wait(wake - now)
                self._bell.clear()
                continue
            last = now
            self.sweeps += 1
            try:
                self._sweep(now)
            except Exception:  # a bug: counted and logged, never a silent dead thread
                self.guard()
