"""The sender's call building: ``_call`` reads an item and changes nothing; ``_due`` alone
says what still goes out and marks a submit sent (and samples it for rank insights)."""

from __future__ import annotations

import time
from typing import Any

from broker_lookup.client.breaker import Breaker
from broker_lookup.client.insights import RankInsights
from broker_lookup.client.sender import Deadline, Sender, Submit
from broker_lookup.client.table import Entry, LookupTable
from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, LookupRequest
from broker_lookup.transport.script_runner import ScriptSet


def _sender(insights: RankInsights | None = None) -> Sender:
    def no_connection() -> Any:  # the thread is never started here
        raise AssertionError("no connection expected")

    table = LookupTable(lambda lookup_id, gen: None, 100, 1.0)
    breaker = Breaker(1.0, ("sender",))
    keys = KeySpace("e")
    return Sender(
        LookupConfig(), keys, table, no_connection, ScriptSet(), breaker, insights, expected="0"
    )


def _submit() -> Submit:
    now = time.monotonic()
    request = LookupRequest(
        lookup_id="s", gen=1, hashes=[1], offsets=[4], expected=[0], deadline_ms=2, tokens=4
    )
    return Submit(Entry(1, now, now + 1, 4, (0,)), request)


def test_building_a_submit_call_changes_nothing() -> None:
    sender = _sender(RankInsights((0,), 0.5, max_per_s=1000.0))
    item = _submit()
    first, second = sender._call(item), sender._call(item)
    assert (first.script, first.keys) == (second.script, second.keys)
    assert not item.entry.sent and item.entry.weight == 0


def test_due_marks_a_submit_sent_and_samples_it_once() -> None:
    sender = _sender(RankInsights((0,), 0.5, max_per_s=1000.0))
    item = _submit()
    assert sender._due(item)
    assert item.entry.sent and item.entry.weight > 0
    weight = item.entry.weight
    assert sender._due(item) and item.entry.weight == weight  # a re-send keeps its weight
    assert sender._calls([item, Abort(lookup_id="x", gen=1)])[0][0] is item


def test_a_finished_lookup_or_an_answered_deadline_is_not_due() -> None:
    sender = _sender()
    item = _submit()
    item.entry.result = 0  # finished before it was sent (timeout, cancel)
    assert not sender._due(item) and item.entry.sent  # sent is set before result is read
    assert not sender._due(Deadline("s", item.entry, answer=True))
    assert sender._due(Deadline("s", item.entry, answer=False))  # a cancel still goes
    assert sender._calls([item]) == []
