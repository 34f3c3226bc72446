"""The client's lookup table against a reference model (hypothesis stateful testing).

The model is plain dicts. After every step: ``lookup_cache``'s answer per id matches
the model, every cancel the table asked for is one the model expects (only for a
generation that reached Redis, once), a cancel after a clear still releases the cleared
generation, and every map stays within ``max_pending``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker_lookup.client.table import Entry, LookupTable

IDS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
CAP = 4


@dataclass
class Model:
    gen: int
    result: int | None = None
    sent: bool = False


class TableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cancels: list[tuple[str, int]] = []
        self.table = LookupTable(lambda i, g: self.cancels.append((i, g)), CAP, retention_s=1000.0)
        self.gens = itertools.count(1)
        self.model: dict[str, Model] = {}
        self.entries: dict[str, Entry] = {}
        self.cleared: dict[str, int] = {}
        self.expected_cancels: list[tuple[str, int]] = []

    def _finish_model(self, lookup_id: str) -> None:
        m = self.model[lookup_id]
        if m.result is None:
            m.result = 0
            if m.sent:
                self.expected_cancels.append((lookup_id, m.gen))

    @rule(lookup_id=IDS)
    def add(self, lookup_id: str) -> None:
        gen = next(self.gens)
        entry = Entry(gen, 0.0, 1e12, 40, (0,), event=None)
        old = self.model.get(lookup_id)
        accepted = self.table.add(lookup_id, entry)
        full = old is None and len(self.model) >= CAP
        assert accepted is not full
        if not accepted:
            return
        if old is not None:
            self._finish_model(lookup_id)
        self.model[lookup_id] = Model(gen)
        self.entries[lookup_id] = entry

    @rule(lookup_id=IDS)
    def send(self, lookup_id: str) -> None:
        """The sender takes the submit: sent, then checks result (Entry.sent's order)."""
        entry = self.entries.get(lookup_id)
        if entry is None or entry.sent:
            return
        entry.sent = True
        self.model[lookup_id].sent = True
        if entry.result is None:
            self.table.confirmed(lookup_id, entry, 0.0)

    @rule(lookup_id=IDS, hits=st.integers(0, 40))
    def complete(self, lookup_id: str, hits: int) -> None:
        m = self.model.get(lookup_id)
        if m is None:
            return
        done = self.table.finish(lookup_id, m.gen, hits, "hit")
        assert done is (m.result is None)
        if m.result is None:
            m.result = hits

    @rule(lookup_id=IDS)
    def expire(self, lookup_id: str) -> None:
        entry = self.entries.get(lookup_id)
        if entry is None:
            return
        self.table.expire(lookup_id, entry)
        self._finish_model(lookup_id)

    @rule(lookup_id=IDS)
    def clear(self, lookup_id: str) -> None:
        self.table.pop(lookup_id, None)
        m = self.model.pop(lookup_id, None)
        self.entries.pop(lookup_id, None)
        if m is None:
            return
        if m.result is None:
            if m.sent:
                self.expected_cancels.append((lookup_id, m.gen))
        elif m.sent:
            self.cleared[lookup_id] = m.gen

    @rule(lookup_id=IDS)
    def cancel(self, lookup_id: str) -> None:
        self.table.pop(lookup_id, "cancelled")
        m = self.model.pop(lookup_id, None)
        self.entries.pop(lookup_id, None)
        if m is None:
            gen = self.cleared.pop(lookup_id, None)
            if gen is not None:
                self.expected_cancels.append((lookup_id, gen))
        elif m.sent:
            self.expected_cancels.append((lookup_id, m.gen))

    @rule()
    def reconcile(self) -> None:
        due = self.table.due_for_reconcile(now=1.0, limit=100)
        for lookup_id, entry in due:
            m = self.model[lookup_id]
            assert entry.gen == m.gen and m.result is None and m.sent

    @invariant()
    def answers_match(self) -> None:
        for lookup_id in ("a", "b", "c", "d", "e", "f"):
            entry = self.table.entries.get(lookup_id)
            m = self.model.get(lookup_id)
            if m is None:
                assert entry is None
            else:
                assert entry is not None and entry.gen == m.gen and entry.result == m.result

    @invariant()
    def cancels_only_what_reached_redis(self) -> None:
        assert self.cancels == self.expected_cancels

    @invariant()
    def bounded(self) -> None:
        t = self.table
        assert len(t.entries) <= CAP and len(t.inflight) <= CAP
        assert len(t._cleared) <= CAP and len(t._finished) <= CAP


TableMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
test_table_against_model = pytest.mark.property(TableMachine.TestCase)


class _CountingLock:
    def __init__(self) -> None:
        self.acquired = 0

    def __enter__(self) -> None:
        self.acquired += 1

    def __exit__(self, *exc: object) -> None:
        return None


def test_sweeps_do_no_work_for_what_is_not_due() -> None:
    table = LookupTable(lambda i, g: None, 100_000, retention_s=10.0)
    for i in range(20_000):
        entry = Entry(i, 0.0, 1e12, 40, (0, 1), event=None)
        table.add(f"r{i}", entry)
        entry.sent = True
        table.confirmed(f"r{i}", entry, now=100.0)
    lock = _CountingLock()
    table._lock = lock  # type: ignore[assignment]
    # A dead rank's scan copies the in-flight map without the lock lookup() takes.
    assert len(table.waiting_on(frozenset({1}))) == 20_000
    assert lock.acquired == 0
    # Nothing is due yet: the reconcile queue stops at its first item.
    assert table.due_for_reconcile(now=100.1, limit=500) == []
    due = table.due_for_reconcile(now=101.0, limit=500)
    assert [k for k, _ in due] == [f"r{i}" for i in range(500)]
    assert table.evict_finished(now=5.0) == 0  # nothing finished: nothing examined


def test_uncleared_results_are_evicted_after_the_retention_only() -> None:
    table = LookupTable(lambda i, g: None, 100, retention_s=10.0)
    for i in range(3):
        entry = Entry(i, 0.0, 1e12, 40, (0,), event=None)
        table.add(f"r{i}", entry)
        table.finish(f"r{i}", i, 8, "hit")
    finished_at = table._finished["r0"][0]
    assert table.evict_finished(finished_at + 5.0) == 0
    assert table.evict_finished(finished_at + 60.0) == 3
    assert table.entries == {} and not table._finished
