"""``python -m workers``: run worker ranks; see :mod:`workers.runtime.runner`."""

from __future__ import annotations

import signal
import sys
import threading

from broker_lookup.threads import set_from_signal

# Catch SIGTERM/SIGINT before the heavy imports below (torch takes seconds): a rank
# told to stop while still starting must exit 0 in order, not die by the signal.
_stop = threading.Event()


def _early(signum: int, _frame: object) -> None:
    set_from_signal(_stop)


signal.signal(signal.SIGTERM, _early)
signal.signal(signal.SIGINT, _early)

from workers.runtime.runner import main  # noqa: E402  (after the handlers, on purpose)

if __name__ == "__main__":
    sys.exit(main(stop=_stop))
