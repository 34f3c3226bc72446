"""The bookkeeping of the submits the caller writes itself (CallerWrites): what it answers
for each write, reply and broken connection, against a link whose outcomes are scripted."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import redis

from broker_lookup.client.caller_writes import CallerWrites
from broker_lookup.client.table import Entry
from broker_lookup.protocol.commands import Command
from broker_lookup.transport.link import Link


class ScriptedLink:
    """The calls CallerWrites makes on a link, with outcomes set by the test."""

    def __init__(self) -> None:
        self.sent: list[Command] = []
        self.write: bool | None = True  #: what send_nowait answers
        self.waiting: list[Any] = []  #: replies there to read, in wire order
        self.error: redis.RedisError | None = None  #: raised by replies() if set
        self.dropped = 0
        self.accepts_direct = True

    def send_nowait(self, commands: Sequence[Command]) -> bool | None:
        if self.write is not None:
            self.sent.extend(commands)
        return self.write

    def replies(self, n: int, wait: bool = True) -> list[Any]:
        if self.error is not None:
            raise self.error
        got, self.waiting = self.waiting[:n], self.waiting[n:]
        assert wait is False or len(got) == n, "a waiting read returns every reply"
        return got

    def drop(self) -> None:
        self.dropped += 1


def _entry() -> Entry:
    now = time.monotonic()
    return Entry(1, now, now + 1, 256, (0,))


def _open(max_owed: int = 8, overdue_ms: int = 60_000) -> tuple[CallerWrites[str], ScriptedLink]:
    writes: CallerWrites[str] = CallerWrites(max_owed, overdue_ms)
    link = ScriptedLink()
    writes.open_on(cast(Link, link), allowed=True)
    assert writes.open
    return writes, link


def test_a_written_submit_is_owed_and_its_reply_comes_back_with_it() -> None:
    writes, link = _open()
    now = time.monotonic()
    assert writes.try_write("a", ("EVALSHA", "a"), now) is True
    assert writes.try_write("b", ("EVALSHA", "b"), now) is True
    assert link.sent == [("EVALSHA", "a"), ("EVALSHA", "b")]
    assert (writes.owed, writes.count, writes.last_at) == (2, 2, now)
    link.waiting = [b"ok-a"]
    assert writes.replies(wait=False) == ([("a", b"ok-a")], None)
    assert writes.owed == 1  # b's reply is not there yet: still owed
    link.waiting = [b"ok-b"]
    assert writes.replies(wait=True) == ([("b", b"ok-b")], None)
    assert writes.owed == 0 and writes.open and link.dropped == 0


def test_nothing_written_owes_nothing() -> None:
    writes, link = _open()
    link.write = None  # a full socket buffer, or no plain connection
    assert writes.try_write("a", ("EVALSHA", "a"), time.monotonic()) is None
    assert (writes.owed, writes.count, writes.open, writes.torn) == (0, 0, True, False)
    assert writes.replies(wait=True) == ([], None)


def test_a_torn_write_closes_the_callers_way_and_asks_for_a_new_connection() -> None:
    writes, link = _open()
    now = time.monotonic()
    assert writes.try_write("a", ("EVALSHA", "a"), now) is True
    link.write = False  # only part of it went out
    assert writes.try_write("b", ("EVALSHA", "b"), now) is False
    assert writes.torn and not writes.open and writes.owed == 2
    assert not writes.takes(_entry(), now + 1, 0.0)  # closed until the sender reopens it
    link.waiting = [b"ok-a"]
    answered, why = writes.replies(wait=False)
    assert answered == [] and why == "a submit was only partly written"
    assert not writes.torn and link.waiting == [b"ok-a"]  # nothing read off a broken wire
    assert writes.rewire() == ["a", "b"]
    assert link.dropped == 1 and writes.owed == 0 and not writes.open


def test_a_transport_error_reading_replies_says_why_and_rewire_returns_every_owed_item() -> None:
    writes, link = _open()
    now = time.monotonic()
    for item in ("a", "b", "c"):
        writes.try_write(item, ("EVALSHA", item), now)
    link.error = redis.ConnectionError("Connection reset by peer")
    assert writes.replies(wait=True) == ([], "Connection reset by peer")
    assert writes.owed == 3  # still owed until the sender rewires
    assert writes.rewire() == ["a", "b", "c"]  # in the order they were written
    assert link.dropped == 1 and writes.owed == 0 and not writes.open
    assert writes.rewire() == []


def test_an_overdue_reply_is_reported_after_the_answered_ones() -> None:
    writes, link = _open(overdue_ms=1000)
    long_ago = time.monotonic() - 5
    writes.try_write("a", ("EVALSHA", "a"), long_ago)
    writes.try_write("b", ("EVALSHA", "b"), long_ago)
    link.waiting = [b"ok-a"]
    answered, why = writes.replies(wait=False)
    assert answered == [("a", b"ok-a")]
    assert why == "no reply within socket_timeout_ms=1000"
    assert writes.rewire() == ["b"]


def test_a_recent_unanswered_write_is_not_overdue() -> None:
    writes, _ = _open(overdue_ms=60_000)
    writes.try_write("a", ("EVALSHA", "a"), time.monotonic())
    assert writes.replies(wait=False) == ([], None)
    assert writes.owed == 1


def test_a_burst_takes_the_queue_one_at_a_time_does_not() -> None:
    writes, _ = _open()
    first, second, third = _entry(), _entry(), _entry()
    now = time.monotonic()
    assert writes.takes(first, now, burst_gap_s=0.5)
    writes.try_write("first", ("EVALSHA", "1"), now)
    # Within the gap while the last one is unanswered: a burst.
    assert not writes.takes(second, now + 0.1, burst_gap_s=0.5)
    assert writes.last_at == now + 0.1  # the burst goes on from here
    second.result = 4  # answered: the next is one lookup at a time again
    assert writes.takes(third, now + 0.2, burst_gap_s=0.5)


def test_no_more_than_max_owed_replies_are_owed() -> None:
    writes, link = _open(max_owed=2)
    now = time.monotonic()
    for item in ("a", "b"):
        entry = _entry()
        entry.result = 0  # answered: never a burst
        assert writes.takes(entry, now, burst_gap_s=0.0)
        writes.try_write(item, ("EVALSHA", item), now)
    assert not writes.takes(_entry(), now, burst_gap_s=0.0)
    link.waiting = [b"ok"]
    writes.replies(wait=False)
    assert writes.takes(_entry(), now, burst_gap_s=0.0)


def test_closed_takes_nothing() -> None:
    writes: CallerWrites[str] = CallerWrites(8, 1000)
    assert not writes.takes(_entry(), time.monotonic(), burst_gap_s=0.0)
