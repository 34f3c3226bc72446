"""The rank's reporter thread: runs ``report.lua`` for finished prefetches, pipelined.

``send_response_to_scheduler`` is called on the engine's own thread (LMCache calls
it from its storage event loop), so it only queues: a slow or unreachable Redis
never stalls the engine (LMCache D14). The queue is bounded: a report that does not
fit is answered ``overflow`` at once, so its lookup is released instead of queued
without limit while Redis is away.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import REPORT, Call, ScriptSet
from broker_lookup.transport.batcher import Batcher

__all__ = ["Report", "Reporter"]

logger = logging.getLogger(__name__)

#: Reports that may wait for Redis at once; beyond, a report is answered ``overflow``.
MAX_QUEUED = 10_000

#: (lookup_id, gen, hits) -> called with the script's answer (or "error", "overflow").
Report = tuple[str, int, int]
OnResult = Callable[[str, int, str], None]


class Reporter(Batcher[Report]):
    """Drains queued reports into one pipeline per wake-up."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        factory: Callable[[], redis.Redis],
        scripts: ScriptSet,
        on_result: OnResult,
    ) -> None:
        super().__init__(
            f"rank {rank} reporter", factory, scripts, config.redis_retries, 256, MAX_QUEUED
        )
        self._config = config
        self._keys = keys
        self._rank = rank
        self._on_result = on_result
        self._inline: list[Report] = []
        self._inline_thread: int | None = None
        #: Reports that did not fit in the queue.
        self.overflows = 0

    def bind_thread(self) -> None:
        """Mark the calling thread (the rank's consumer) as the one that flushes inline."""
        self._inline_thread = threading.get_ident()

    def put(self, lookup_id: str, gen: int, hits: int) -> None:
        """Queue one report (called from engine threads).

        An engine that answers on the consumer thread itself (a miss, an instant hit)
        has its report sent with the consumer's XACK: no hand-off to this thread.
        """
        if threading.get_ident() == self._inline_thread:
            self._inline.append((lookup_id, gen, hits))
            return
        self._queue_or_refuse((lookup_id, gen, hits))

    def _queue_or_refuse(self, report: Report) -> None:
        if not self._put(report):
            self.overflows += 1
            self._on_result(report[0], report[1], "overflow")

    def flush(self, client: redis.Redis, ack_ids: list[bytes]) -> None:
        """On the consumer thread: XACK ``ack_ids`` and send its inline reports, one round trip.

        If Redis fails, the reports go to this reporter's own retrying queue and the
        error propagates (the entries stay pending and are replayed, then deduped).
        """
        stream, group = self._keys.requests, self._keys.group(self._rank)

        def ack(pipe: Any) -> int:
            if ack_ids:
                pipe.xack(stream, group, *ack_ids)
            return 1 if ack_ids else 0

        while ack_ids or self._inline:
            reports, self._inline = self._inline, []
            try:
                results = self._scripts.run(client, [self._call(r) for r in reports], ack)
            except BrokerLookupError:
                for report in reports:
                    self._queue_or_refuse(report)
                raise
            for (lookup_id, gen, _), res in zip(reports, results, strict=True):
                # May start a queued generation whose engine answers inline: loop again.
                self._on_result(lookup_id, gen, self._answer(res))
            ack_ids = []

    def _call(self, report: Report) -> Call:
        lookup_id, gen, hits = report
        cfg = self._config
        return Call(
            REPORT,
            (self._keys.lookup(lookup_id), self._keys.done),
            [self._rank, gen, hits, cfg.done_maxlen, lookup_id, cfg.key_grace_ms or 1],
        )

    def _send_batch(self, client: redis.Redis, batch: list[Report]) -> None:
        results = self._run_with_retries(client, [self._call(r) for r in batch])
        answers = ["error"] * len(batch) if results is None else [self._answer(r) for r in results]
        for (lookup_id, gen, _), answer in zip(batch, answers, strict=True):
            self._on_result(lookup_id, gen, answer)

    def _answer(self, result: object) -> str:
        if isinstance(result, bytes):
            return result.decode()
        if isinstance(result, str):
            return result
        self.errors += 1
        logger.error("rank %d: report script failed: %r", self._rank, result)
        return "error"
