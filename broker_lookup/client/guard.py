"""The guard of the scheduler's contract path: answer, count by kind, log once.

vLLM calls ``lookup``, ``lookup_cache``, ``clear_lookup_status``, ``cancel_lookup``
and ``close`` inside ``Scheduler.schedule()``, with ids taken from a client's
``X-Request-Id`` header, where an exception kills the engine. Every
client and wrapper here runs what could raise through one :class:`Guard`: what fails
is answered (0: recompute, or -1: unknown), counted by kind in ``counts`` (``stats()``
``rejected``) and logged the first time a kind occurs, then at every power of ten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["Guard", "worth_logging"]

logger = logging.getLogger(__name__)

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
        """Count one call answered without being served; log the first and every 10**n-th."""
        count = self.counts.get(kind, 0) + 1
        self.counts[kind] = count
        if worth_logging(count):
            shown = repr(lookup_id)[:200]
            logger.warning(
                "lookup %s answered without being served (%s: %s); %d such call(s) so far",
                shown,
                kind,
                detail,
                count,
            )


def worth_logging(count: int) -> bool:
    """1, 10, 100, ...: a flood of one kind costs a handful of log lines."""
    while count % 10 == 0:
        count //= 10
    return count == 1
