"""A stop signal stops a process even when it lands inside ``stop.wait()``.

Python runs a signal handler on the main thread between two bytecodes, and that can be
while the main thread holds the stop event's own lock, inside ``stop.wait()`` (where a
rank's and the supervisor's main threads spend their life). A handler that calls
``stop.set()`` there waits for that lock forever: SIGTERM hung a bench rank this way, and
would hang ``python -m workers`` until Kubernetes' SIGKILL. The handlers set it through
``set_from_signal``.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

from broker_lookup.threads import set_from_signal


def _event_lock(event: threading.Event) -> Any:
    return vars(event)["_cond"]


def test_set_from_signal_returns_while_the_event_is_locked_and_sets_it_after() -> None:
    stop = threading.Event()
    with _event_lock(stop):  # where a signal lands inside stop.wait()
        set_from_signal(stop)  # returns: it never takes the lock on this thread
        time.sleep(0.05)
        assert not stop.is_set()  # it cannot be set while the lock is held
    assert stop.wait(5)


_RAISE_INSIDE_WAIT = """
import signal, sys, threading
{install}
stop = {event}
with vars(stop)["_cond"]:  # the main thread inside stop.wait(), when the signal lands
    signal.raise_signal(signal.SIGTERM)  # the handler runs here, with the lock held
sys.exit(0 if stop.wait(5) else 1)
"""


def _stops(install: str, event: str) -> None:
    script = _RAISE_INSIDE_WAIT.format(install=install, event=event)
    done = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()


def test_the_rank_runners_handler_stops_on_a_sigterm_inside_wait() -> None:
    install = (
        "from workers.runtime import runner\n"
        "event = threading.Event()\n"
        "runner._install_signals(event)"
    )
    _stops(install, "event")


def test_the_early_handler_of_python_m_workers_stops_on_a_sigterm_inside_wait() -> None:
    # workers/__main__ installs it on import, before the heavy imports.
    _stops("import runpy\nearly = runpy.run_module('workers.__main__')", "early['_stop']")
