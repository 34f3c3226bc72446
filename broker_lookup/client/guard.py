"""The guard of the scheduler's contract path: answer, count by kind, log once.

vLLM calls ``lookup``, ``lookup_cache``, ``clear_lookup_status``, ``cancel_lookup``
and ``close`` inside ``Scheduler.schedule()``, with ids taken from a client's
``X-Request-Id`` header, where an exception kills the engine. Every
client and wrapper here runs what could raise through one :class:`Guard`: what fails
is answered (0: recompute, or -1: unknown), counted by kind in ``counts`` (``stats()``
``rejected``) and logged the first time a kind occurs, then at most once per
:data:`LOG_EVERY_S` for that kind (:class:`~broker_lookup.ratelimit.RateLimitedLog`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from broker_lookup.ratelimit import RateLimitedLog

__all__ = ["LOG_EVERY_S", "Guard"]

logger = logging.getLogger(__name__)

#: The least time between two log lines of one kind of refused call.
LOG_EVERY_S = 10.0

_P = ParamSpec("_P")
_T = TypeVar("_T")


class Guard:
    """Counts and logs what a contract call could not serve, and keeps it from raising.

    >>> guard = Guard()
    >>> guard.call("bad_cancel", "r1", None, {}.pop, ["unhashable"])
    >>> guard.counts
    {'bad_cancel': 1}
    """

    def __init__(self) -> None:
        #: Calls answered without being served, by kind (read by ``stats()`` and metrics).
        self.counts: dict[str, int] = {}
        self._logs: dict[str, RateLimitedLog] = {}

    def call(
        self,
        kind: str,
        lookup_id: object,
        answer: _T,
        fn: Callable[_P, _T],
        /,
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _T:
        """``fn(*args, **kwargs)``, or ``answer`` if it raised (counted as ``kind``)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a bug, an engine or an inner client: never the scheduler's
            self.rejected(kind, lookup_id, repr(exc)[:200])
            logger.debug("%s for lookup %.200r", kind, lookup_id, exc_info=True)
            return answer

    def rejected(self, kind: str, lookup_id: object, detail: str) -> None:
        """Count one call answered without being served; log it unless a line of its
        kind went out less than :data:`LOG_EVERY_S` ago."""
        count = self.counts.get(kind, 0) + 1
        self.counts[kind] = count
        log = self._logs.get(kind)
        if log is None:
            log = self._logs[kind] = RateLimitedLog(logger, LOG_EVERY_S)
        log(
            logging.WARNING,
            "lookup %.200r answered without being served (%s: %s); %d such call(s) so far",
            lookup_id,
            kind,
            detail,
            count,
        )
