"""CallerWrites over a real lean connection: what the caller wrote comes back paired with
its replies in wire order, and a rewire leaves the connection usable by its owner."""

from __future__ import annotations

import time
import uuid

import pytest
from helpers import Backend

from broker_lookup.client.caller_writes import CallerWrites
from broker_lookup.transport.link import LeanLink, open_link

# send_nowait writes only on a plain TCP or unix socket: fakeredis has none.
real_only = pytest.mark.parametrize("backend", ["real"], indirect=True)


@real_only
def test_written_commands_come_back_paired_with_their_replies(backend: Backend) -> None:
    key = "caller-writes-" + uuid.uuid4().hex[:8]
    link = open_link(backend.factory())
    assert isinstance(link, LeanLink)
    writes: CallerWrites[str] = CallerWrites(max_owed=8, overdue_ms=60_000)
    try:
        link.call([("DEL", key)])  # connects: the caller may write from now on
        writes.open_on(link, allowed=True)
        assert writes.open
        now = time.monotonic()
        assert writes.try_write("first", ("INCR", key), now) is True
        assert writes.try_write("second", ("INCRBY", key, 10), now) is True
        assert writes.replies(wait=True) == ([("first", 1), ("second", 11)], None)
        assert writes.try_write("third", ("INCR", key), now) is True
        assert writes.rewire() == ["third"]  # its reply never read: sent again
        assert not link.accepts_direct  # dropped: nothing more is written on it
        assert link.call([("GET", key)]) == [b"12"]  # a new connection, in step
    finally:
        link.call([("DEL", key)])
        link.close()
