"""The one scaffold of every background loop: its thread, stop event, guard, bounded join.

:class:`LoopThread` is what the client's sender and listener and the rank's consumer
and sweeper are built on. :class:`LoopGuard` keeps a loop alive through an unexpected
exception, loudly: Redis and broker errors are handled where they happen; anything
else is a bug, and the loop must not die silently because of it (a dead listener
would leave every lookup waiting for its timeout), so it is counted, logged with its
traceback, and the loop backs off briefly and goes on.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LoopGuard", "LoopThread", "set_from_signal"]

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


class LoopThread:
    """A daemon thread running :meth:`_run` until :meth:`stop`; subclasses write ``_run``.

    ``_run`` checks ``self._stop`` (and waits on it instead of sleeping, so a stop is
    never delayed) and calls ``self.guard()`` from its ``except Exception`` block.
    """

    def __init__(self, name: str, thread_name: str | None = None) -> None:
        self._stop = threading.Event()
        self.guard = LoopGuard(name, self._stop)
        self._thread = threading.Thread(
            target=self._run, name=f"broker-lookup-{thread_name or name}", daemon=True
        )

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Ask the loop to stop and join it (bounded); False if the join timed out."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()


def set_from_signal(event: threading.Event) -> None:
    """Set ``event`` from a signal handler, which must never set it itself.

    Python runs a handler on the main thread between two bytecodes, and that may be inside
    ``event.wait()`` while the main thread holds the event's own lock: ``event.set()``
    there waits for that lock forever, and a SIGTERM hangs the process instead of stopping
    it. A short-lived thread sets it instead, as soon as the main thread lets go.
    """
    threading.Thread(target=event.set, name="broker-lookup-signal", daemon=True).start()
