"""The Batcher's retry policy (``for attempt in self._attempts(n): with attempt: ...``):
how many tries, what is counted, and what ends it."""

from __future__ import annotations

import fakeredis
import pytest

from broker_lookup.errors import BrokerUnavailable
from broker_lookup.transport.batcher import Batcher
from broker_lookup.transport.script_runner import ScriptSet


def _batcher(retries: int) -> Batcher[int]:
    return Batcher("test batcher", fakeredis.FakeRedis, ScriptSet(), retries, max_batch=8)


def _run(batcher: Batcher[int], failures: int) -> tuple[str | None, int]:
    """The result once ``failures`` tries raised BrokerUnavailable, and the tries made."""
    tries = 0
    result = None
    for attempt in batcher._attempts(1):
        with attempt:
            tries += 1
            if tries <= failures:
                raise BrokerUnavailable(f"try {tries} failed")
            result = "ok"
    return result, tries


def test_the_first_success_ends_the_tries() -> None:
    batcher = _batcher(retries=3)
    assert _run(batcher, failures=0) == ("ok", 1)
    assert _run(batcher, failures=2) == ("ok", 3)
    assert batcher.errors == 2  # each failed try counted


def test_every_try_failing_gives_no_result() -> None:
    batcher = _batcher(retries=3)
    assert _run(batcher, failures=5) == (None, 3)
    assert batcher.errors == 3


def test_a_bug_inside_a_try_is_raised_not_retried() -> None:
    batcher = _batcher(retries=3)
    tries = 0
    with pytest.raises(KeyError):
        for attempt in batcher._attempts(1):
            with attempt:
                tries += 1
                raise KeyError("a bug")
    assert tries == 1 and batcher.errors == 0


def test_stopping_allows_one_failed_try_and_none_past_the_grace() -> None:
    batcher = _batcher(retries=3)
    batcher.stop(5.0)  # never started: only sets the stop and its grace
    assert _run(batcher, failures=5) == (None, 1)  # one failed while stopping: no more
    assert _run(batcher, failures=0) == (None, 0)
    late = _batcher(retries=3)
    late.stop(0.0)  # the grace is over at once
    assert _run(late, failures=0) == (None, 0)
