"""The rank's reporter thread: runs ``report.lua`` for finished prefetches, pipelined.

``send_response_to_scheduler`` is called on the engine's own thread (LMCache calls
it from its storage event loop), so it only queues: a slow or unreachable Redis
never stalls the engine (LMCache D14).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup._guard import LoopGuard
from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError
from broker_lookup.keys import KeySpace
from broker_lookup.scripts import REPORT, Call, ScriptSet

__all__ = ["Report", "Reporter"]

logger = logging.getLogger(__name__)

#: (lookup_id, gen, hits) -> called with the script's answer (or "error").
Report = tuple[str, int, int]
OnResult = Callable[[str, int, str], None]


class Reporter:
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
        self._config = config
        self._keys = keys
        self._rank = rank
        self._factory = factory
        self._scripts = scripts
        self._on_result = on_result
        self._queue: deque[Report] = deque()
        self._inline: list[Report] = []
        self._inline_thread: int | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.guard = LoopGuard(f"rank {rank} reporter", self._stop)
        self.errors = 0
        self._thread = threading.Thread(
            target=self._run, name=f"broker-lookup-reporter-{rank}", daemon=True
        )

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

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
        self._queue.append((lookup_id, gen, hits))
        self._wake.set()

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
                self._queue.extend(reports)
                self._wake.set()
                raise
            for (lookup_id, gen, _), res in zip(reports, results, strict=True):
                # May start a queued generation whose engine answers inline: loop again.
                self._on_result(lookup_id, gen, self._answer(res))
            ack_ids = []

    def stop(self, timeout_s: float) -> bool:
        """Flush what is queued, stop, join; False if the join timed out."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        client = self._factory()
        try:
            while not self._stop.is_set():
                self._wake.wait(0.1)
                self._wake.clear()
                try:
                    self._drain(client)
                except Exception:  # a bug: counted and logged, never a silent dead thread
                    self.guard()
            self._drain(client)
        finally:
            client.close()

    def _drain(self, client: redis.Redis) -> None:
        while self._queue:
            batch: list[Report] = []
            while self._queue and len(batch) < 256:
                batch.append(self._queue.popleft())
            answers = self._send(client, batch)
            for (lookup_id, gen, _), answer in zip(batch, answers, strict=True):
                self._on_result(lookup_id, gen, answer)

    def _call(self, report: Report) -> Call:
        lookup_id, gen, hits = report
        cfg = self._config
        return Call(
            REPORT,
            (self._keys.lookup(lookup_id), self._keys.done),
            [self._rank, gen, hits, cfg.done_maxlen, lookup_id, cfg.key_grace_ms or 1],
        )

    def _send(self, client: redis.Redis, batch: list[Report]) -> list[str]:
        calls = [self._call(r) for r in batch]
        delay = 0.01
        for attempt in range(1, self._config.redis_retries + 1):
            try:
                results = self._scripts.run(client, calls)
                return [self._answer(r) for r in results]
            except BrokerLookupError as exc:
                self.errors += 1
                logger.warning(
                    "rank %d: %d report(s) failed (attempt %d/%d): %s",
                    self._rank,
                    len(batch),
                    attempt,
                    self._config.redis_retries,
                    exc,
                )
                if attempt < self._config.redis_retries:
                    # Not under any lock and not on the engine's thread.
                    self._stop.wait(delay)
                    delay *= 4
        return ["error"] * len(batch)

    def _answer(self, result: object) -> str:
        if isinstance(result, bytes):
            return result.decode()
        if isinstance(result, str):
            return result
        self.errors += 1
        logger.error("rank %d: report script failed: %r", self._rank, result)
        return "error"
