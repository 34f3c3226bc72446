"""The submits the scheduler's thread writes itself, and the replies they still owe.

Handing a submit to the sender's thread costs a wake-up for the hand-off and one for
the reply, each several times the write itself. So once a round trip proved the
sender's lean connection (a plain TCP or unix socket), the caller writes a submit on
it with a write that never waits (:meth:`~broker_lookup.transport.link.LeanLink.send_nowait`),
and the sender's thread reads its reply later. :class:`CallerWrites` keeps that
bookkeeping and answers with data: whether a submit was written (:meth:`~CallerWrites.try_write`),
which written submits were answered and whether the connection must go
(:meth:`~CallerWrites.replies`), and which ones must be sent again once it went
(:meth:`~CallerWrites.rewire`). What to do with them is the sender's.

It owns what the caller's way needs: the link it writes on (the sender's thread's,
handed over by :meth:`~CallerWrites.open_on` once a round trip proved it), the lock
and the replies owed. Every method but :meth:`~CallerWrites.offer` runs with
:attr:`CallerWrites.wire` held: the one lock that orders each write on the connection
(the caller's and the sender's round trips) with the replies to expect. The caller only
ever *tries* it (``offer``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, NamedTuple, TypeVar

from redis.exceptions import RedisError

from broker_lookup.client.table import Entry
from broker_lookup.protocol.commands import Command
from broker_lookup.transport.link import Link

__all__ = ["CallerWrites", "Written"]

T = TypeVar("T")


class Written(NamedTuple, Generic[T]):
    """A submit the caller wrote itself, whose reply has not been read yet."""

    item: T
    at: float  #: monotonic seconds when it was written


class CallerWrites(Generic[T]):
    """The caller's own writes on the sender's connection, in the order they went out.

    Args:
        max_owed: most replies that may be owed at once; beyond, submits take the queue.
        overdue_ms: a reply owed this long means the connection is gone
            (``socket_timeout_ms``).
    """

    def __init__(self, max_owed: int, overdue_ms: int) -> None:
        #: Orders every write on the connection with :attr:`owed`; see the module.
        self.wire = threading.Lock()
        #: The caller may write (set by the sender's thread once a round trip proved the
        #: connection; cleared at any failure and at stop).
        self.open = False
        #: A write was torn: the sender's thread must drop the connection.
        self.torn = False
        #: When the caller last wrote a submit or queued one as part of a burst.
        self.last_at = 0.0
        #: Submits written so far (``stats().direct_submits``).
        self.count = 0
        self._owed: deque[Written[T]] = deque()
        #: The entry of the caller's last submit, written or queued as part of a burst.
        #: A submit soon after it is only a burst while it is unanswered: one lookup at
        #: a time, each answered within the burst gap, is still written directly.
        self._last_entry: Entry | None = None
        self._max_owed = max_owed
        self._overdue_ms = overdue_ms
        #: The link the caller writes on, once :meth:`open_on` handed it over.
        self._link: Link | None = None

    def open_on(self, link: Link, allowed: bool) -> None:
        """After a round trip on ``link`` succeeded: the caller may write on it from now
        if ``allowed`` and the link takes writes from another thread (a plain socket)."""
        self._link = link
        self.open = allowed and link.accepts_direct

    def offer(
        self, item: T, entry: Entry, command: Callable[[T], Command | None], burst_gap_s: float
    ) -> bool | None:
        """On the caller's thread: write ``item`` now if the way is open, the lock free and
        it is no burst (:meth:`takes`); ``command`` builds its command (None: nothing to
        send). None: not written, queue it. Else :meth:`try_write`'s answer (True also
        when there was nothing to send). Never waits, never raises."""
        if not self.open or not self.wire.acquire(blocking=False):
            return None  # a busy wire: the sender's thread is in a round trip
        try:
            now = time.monotonic()
            if not self.takes(entry, now, burst_gap_s):
                return None
            wire = command(item)
            return True if wire is None else self.try_write(item, wire, now)
        except Exception:  # a bug: never into the scheduler; the queue path logs it
            return None
        finally:
            self.wire.release()

    @property
    def owed(self) -> int:
        """Written submits whose replies have not been read yet."""
        return len(self._owed)

    def takes(self, entry: Entry, now: float, burst_gap_s: float) -> bool:
        """Whether the caller writes the submit of ``entry`` itself: open, not too many
        replies owed, and not part of a burst (which the queue batches): a submit within
        ``burst_gap_s`` of the last one while that one is unanswered."""
        if not self.open or len(self._owed) >= self._max_owed:
            return False
        last = self._last_entry
        self._last_entry = entry
        if now - self.last_at < burst_gap_s and last is not None and last.result is None:
            self.last_at = now  # a burst: the rest of it is queued too
            return False
        return True

    def try_write(self, item: T, command: Command, now: float) -> bool | None:
        """Write ``item``'s ``command`` on the link without waiting.

        True: written, its reply is owed. None: nothing written (send it another way).
        False: only part of it was written; it is owed too, and the connection must be
        dropped (:attr:`torn`; the caller may not write again until the sender's thread
        reopens it).
        """
        link = self._link
        if link is None:
            return None
        done = link.send_nowait([command])
        if done is None:
            return None
        self._owed.append(Written(item, now))
        self.last_at = now
        self.count += 1
        if not done:
            self.open = False
            self.torn = True
        return done

    def replies(self, wait: bool) -> tuple[list[tuple[T, Any]], str | None]:
        """The written submits answered so far (all of them: ``wait``), each with its reply,
        and why the connection must be dropped (a torn write, a transport error, a reply
        overdue), or None. Once it must, call :meth:`rewire`."""
        if self.torn:
            self.torn = False
            return [], "a submit was only partly written"
        link = self._link
        if not self._owed or link is None:
            return [], None
        try:
            got = link.replies(len(self._owed), wait)
        except RedisError as exc:
            return [], str(exc)
        owed = self._owed
        answered = [(owed.popleft().item, reply) for reply in got]
        if owed and time.monotonic() - owed[0].at > self._overdue_ms / 1000:
            return answered, f"no reply within socket_timeout_ms={self._overdue_ms}"
        return answered, None

    def rewire(self) -> list[T]:
        """Drop the link and close the caller's way: the submits whose replies it owed, in
        the order they were written, to be sent again (each is idempotent per lookup id
        and generation)."""
        self.open = False
        if self._link is not None:
            self._link.drop()
        items = [w.item for w in self._owed]
        self._owed.clear()
        return items
