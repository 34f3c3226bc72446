"""The client's circuit breaker: what opens it, what does not, and that it closes itself."""

from __future__ import annotations

import threading
import time

import pytest

from broker_lookup.client.breaker import Breaker
from broker_lookup.errors import BrokerUnavailable


def _fail(breaker: Breaker, loop: str, tolerate: int = 0, stall_s: float = 0.0) -> None:
    with pytest.raises(BrokerUnavailable), breaker.track(loop, tolerate=tolerate):
        time.sleep(stall_s)
        raise BrokerUnavailable("connection reset")


def test_a_failed_round_trip_opens_it_and_a_good_one_closes_it() -> None:
    breaker = Breaker(1.0, ("sender", "listener"))
    assert not breaker.is_open()
    _fail(breaker, "sender")
    assert breaker.is_open() and breaker.failing("sender") and breaker.openings == 1
    with breaker.track("listener"):
        pass
    assert breaker.is_open()  # the sender has not answered yet
    with breaker.track("sender"):
        pass
    assert not breaker.is_open() and not breaker.failing("sender")


def test_one_reset_redone_at_once_is_no_outage() -> None:
    breaker = Breaker(1.0, ("listener",))
    _fail(breaker, "listener", tolerate=1)
    assert not breaker.is_open()
    with breaker.track("listener", tolerate=1):
        pass
    _fail(breaker, "listener", tolerate=1)
    assert not breaker.is_open()  # the success in between reset the count
    _fail(breaker, "listener", tolerate=1)
    assert breaker.is_open()  # two in a row: Redis is down


def test_a_failure_after_a_stall_opens_it_even_when_tolerated() -> None:
    breaker = Breaker(0.05, ("listener",))
    _fail(breaker, "listener", tolerate=1, stall_s=0.1)
    assert breaker.is_open()


def test_a_round_trip_outstanding_too_long_opens_it_while_it_lasts() -> None:
    breaker = Breaker(0.05, ("sender",))
    entered, leave = threading.Event(), threading.Event()

    def stuck() -> None:
        with breaker.track("sender"):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=stuck)
    thread.start()
    entered.wait(10)
    assert not breaker.is_open(time.monotonic())  # just started: no stall yet
    assert breaker.is_open(time.monotonic() + 0.1)  # outstanding past the threshold
    leave.set()
    thread.join(10)
    assert not breaker.is_open(time.monotonic() + 0.1)


def test_a_blocking_read_may_take_its_block_time() -> None:
    breaker = Breaker(0.05, ("listener",))
    entered, leave = threading.Event(), threading.Event()

    def reading() -> None:
        with breaker.track("listener", expected_s=1.0):
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=reading)
    thread.start()
    entered.wait(10)
    assert not breaker.is_open(time.monotonic() + 0.5)  # within BLOCK: not a stall
    assert breaker.is_open(time.monotonic() + 1.2)
    leave.set()
    thread.join(10)


def test_a_stall_is_counted_even_when_no_loop_was_idle_to_see_it() -> None:
    # Every loop stuck in its round trip (a held server): nobody polls while it lasts,
    # and the round trip then ends well. The opening must still be counted, and closed.
    breaker = Breaker(0.05, ("sender", "listener"))
    with breaker.track("sender"):
        time.sleep(0.1)
    assert breaker.openings == 1
    assert not breaker.is_open()
    with breaker.track("sender"):
        pass
    assert breaker.openings == 1  # a quick round trip opens nothing
