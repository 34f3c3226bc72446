"""A thread that drains a queue into one pipelined round trip per batch.

The client's sender and each rank's reporter are this thread with a different
``_send_batch``: callers only append to a deque, and ring a doorbell only if the thread
sleeps (no I/O, no lock, no sleep on their side; a burst costs one wake-up, not one per
item); the thread owns one :class:`~broker_lookup.transport.link.Link` (a lean
connection, or redis-py's pipeline on Redis Cluster) and hands it to every hook,
retries a failed batch a bounded number of times with backoff, and survives
unexpected errors loudly. Once stopping it makes one attempt per batch, none after one
failed and none past the stop's grace: its owner closes the connections then, and
nothing may connect again behind it (a stalled server would otherwise keep it
reconnecting long after).

What a subclass gets and gives, in the order an item travels: its public methods
queue with :meth:`Batcher._put` (any thread); this loop hands each batch to the one
hook on an item's way, ``_send_batch`` (this thread), which builds the script calls,
runs them in ``for attempt in self._attempts(n): with attempt: ...`` (the retries,
their backoff and the stop's grace are this class's; the round trip is written where
it is read), then settles each item. Off that way, a subclass may say how long the
thread sleeps (``_tick``), and work on each wake-up (``_idle``) and as the thread
ends (``_closing``).
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

import redis

from broker_lookup.errors import BrokerLookupError
from broker_lookup.threads import LoopThread
from broker_lookup.transport.link import Link, open_link
from broker_lookup.transport.script_runner import ScriptSet

__all__ = ["Attempt", "Batcher"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The longest an idle thread sleeps between its :meth:`Batcher._idle` calls.
IDLE_TICK_S = 0.1


class Batcher(LoopThread, Generic[T]):
    """Owns one connection and one thread; subclasses turn a batch into script calls."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], redis.Redis],
        scripts: ScriptSet,
        retries: int,
        max_batch: int,
        max_queue: int | None = None,
        idle_tick_s: float = IDLE_TICK_S,
    ) -> None:
        super().__init__(name)
        self.name = name
        self._factory = factory
        self._scripts = scripts
        self._retries = retries
        self._max_batch = max_batch
        self._max_queue = max_queue  #: None: unbounded (the caller bounds what it queues)
        self._idle_tick_s = idle_tick_s
        self._queue: deque[T] = deque()
        #: Rung (a token put) to wake the thread; only while it sleeps, see _put.
        self._bell: queue.SimpleQueue[None] = queue.SimpleQueue()
        #: True while the thread is about to wait or waits for the bell.
        self._asleep = False
        #: The longest the current (or last) sleep waits without a bell.
        self._sleep_s = IDLE_TICK_S
        self.errors = 0
        #: When a stop's grace ends (monotonic); inf until :meth:`stop`.
        self._stop_by = math.inf
        #: An attempt failed while stopping: no other is made.
        self._stop_failed = False

    def _put(self, item: T) -> bool:
        """Queue ``item``; False (not queued) if ``max_queue`` items already wait."""
        if self._max_queue is not None and len(self._queue) >= self._max_queue:
            return False
        self._queue.append(item)
        self._wake()
        return True

    def _wake(self) -> None:
        """Ring the bell if the thread sleeps (any thread).

        A thread that is awake drains the queue before it sleeps again: ringing it would
        only cost it a second wake-up for this batch.
        """
        if self._asleep:
            self._asleep = False
            self._bell.put(None)

    @property
    def queued(self) -> int:
        """Items waiting to be sent."""
        return len(self._queue)

    def stop(self, timeout_s: float) -> bool:
        """Send what is queued (one attempt, within ``timeout_s``), stop, join; False if
        the join timed out."""
        self._stop_by = time.monotonic() + timeout_s
        self._stop.set()
        self._bell.put(None)
        return super().stop(timeout_s)

    def _tick(self) -> float:
        """How long the next sleep may last without a bell (the idle tick)."""
        return self._idle_tick_s

    def _sleep(self) -> None:
        """Wait for the bell, at most :meth:`_tick`, unless items already wait."""
        self._asleep = True
        # The tick and the queue are read after _asleep is set: what a caller did before
        # is seen here, what it does after rings the bell.
        self._sleep_s = self._tick()
        if not self._queue and not self._stop.is_set():
            try:
                self._bell.get(timeout=self._sleep_s)
            except queue.Empty:
                pass
        self._asleep = False

    def _run(self) -> None:
        client = self._factory()
        link = open_link(client)
        try:
            while not self._stop.is_set():
                self._sleep()
                try:
                    self._idle(link, client)
                    self._drain(link, client)
                except Exception:  # a bug: counted and logged, never a silent dead thread
                    self.guard()
            self._drain(link, client)  # ordered shutdown: what close() queued still goes out
        finally:
            self._closing(link)
            link.close()
            client.close()

    def _closing(self, link: Link) -> None:
        """Called on this thread as it ends, before its link and client close."""

    def _drain(self, link: Link, client: redis.Redis) -> None:
        while self._queue:
            batch: list[T] = []
            while self._queue and len(batch) < self._max_batch:
                batch.append(self._queue.popleft())
            self._send_batch(link, client, batch)

    def _send_batch(self, link: Link, client: redis.Redis, batch: list[T]) -> None:
        """The subclass's hook: send ``batch`` over ``link`` in one round trip (see
        :meth:`_attempts`; ``client`` reloads the scripts) and settle each item."""
        raise NotImplementedError

    def _idle(self, link: Link, client: redis.Redis) -> None:
        """Called on every wake-up before draining (a probe of a failing server)."""

    def may_attempt(self) -> bool:
        """Whether a round trip may start: always, except while stopping, where only
        within the stop's grace and only until one attempt failed."""
        if not self._stop.is_set():
            return True
        return not self._stop_failed and time.monotonic() < self._stop_by

    def _attempts(self, n: int) -> Iterator[Attempt]:
        """Up to ``retries`` tries at a round trip of ``n`` calls, each run as
        ``with attempt: ...``; it ends after the first that raised no BrokerLookupError,
        or once :meth:`may_attempt` says no more (stopping). A failed one is counted and
        logged, and the next waits a backoff (on this thread only: never a caller's)."""
        delay = 0.01
        for number in range(1, self._retries + 1):
            if not self.may_attempt():
                return
            attempt = Attempt()
            yield attempt
            if attempt.error is None:
                return
            self.errors += 1
            if self._stop.is_set():
                self._stop_failed = True
            logger.warning(
                "%s: %d operation(s) failed (attempt %d/%d): %s",
                self.name,
                n,
                number,
                self._retries,
                attempt.error,
            )
            if number < self._retries:
                self._stop.wait(delay)
                delay *= 4


class Attempt:
    """One try of :meth:`Batcher._attempts`: a BrokerLookupError raised inside
    ``with attempt:`` is kept in :attr:`error`, not raised; anything else is raised."""

    __slots__ = ("error",)

    def __init__(self) -> None:
        self.error: BrokerLookupError | None = None

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if isinstance(exc, BrokerLookupError):
            self.error = exc
            return True
        return False
