"""The one log throttle: the first line at once, then one per interval counting the rest;
the contract path's guard throttles each kind of refused call apart."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from broker_lookup.client import guard as guard_module
from broker_lookup.client.guard import Guard
from broker_lookup.ratelimit import RateLimitedLog

PRODUCT = Path(__file__).resolve().parents[2]
LOGGER = "broker_lookup.test_ratelimit"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture, name: str = LOGGER) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name]


def test_one_line_per_interval_and_the_next_counts_what_was_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    log = RateLimitedLog(logging.getLogger(LOGGER), 10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(5):
            log(logging.WARNING, "error %d", i)
        assert _lines(caplog) == ["error 0"], "the first goes out at once, the rest wait"
        clock.now += 9.9
        log(logging.WARNING, "error %d", 5)
        assert len(_lines(caplog)) == 1
        clock.now += 0.1
        log(logging.WARNING, "error %d", 6)
    assert _lines(caplog) == ["error 0", "error 6 (5 similar line(s) skipped)"]


def test_the_guard_throttles_each_kind_apart(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr("broker_lookup.ratelimit.time.monotonic", clock)
    guard = Guard()
    with caplog.at_level(logging.WARNING, logger=guard_module.__name__):
        for i in range(100):
            guard.rejected("bad_id", f"r{i}", "empty")
        guard.rejected("bad_tokens", "t0", "floats")
        clock.now += guard_module.LOG_EVERY_S
        guard.rejected("bad_id", "late", "empty")
    lines = _lines(caplog, guard_module.__name__)
    assert len(lines) == 3, lines
    assert "'r0'" in lines[0] and "1 such call(s) so far" in lines[0]
    assert "bad_tokens" in lines[1], "another kind is not held back by the first"
    assert "'late'" in lines[2] and "101 such call(s)" in lines[2] and "99 similar" in lines[2]
    assert guard.counts == {"bad_id": 101, "bad_tokens": 1}


def test_a_lookup_id_is_cut_to_200_characters_in_the_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=guard_module.__name__):
        Guard().rejected("bad_id", "x" * 1000, "too long")
    (line,) = _lines(caplog, guard_module.__name__)
    assert ("'" + "x" * 199) in line and "x" * 200 not in line


def test_no_counting_throttle_is_left_beside_it() -> None:
    """The rule "log the 1st and every 100th (or 10**n-th)" was a second throttle."""
    found = sorted(
        str(path.relative_to(PRODUCT))
        for package in ("broker_lookup", "workers")
        for path in (PRODUCT / package).rglob("*.py")
        if "worth_logging" in (text := path.read_text()) or "% 100 == 0" in text
    )
    assert found == []
