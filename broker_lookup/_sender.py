"""The client's sender thread: turns queued submits and cancels into pipelined scripts.

``lookup()`` and ``cancel_lookup()`` only append to a deque and set an event; this
thread drains everything queued per wake-up into one pipeline, so a burst of N
lookups costs one round trip, not N.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import redis

from broker_lookup._guard import LoopGuard
from broker_lookup._state import Entry, LookupTable
from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, BrokerUnavailable
from broker_lookup.keys import KeySpace
from broker_lookup.messages import Abort, LookupRequest, request_fields
from broker_lookup.scripts import CANCEL, SUBMIT, Call, ScriptSet

__all__ = ["Sender"]

logger = logging.getLogger(__name__)

_MAX_BATCH = 512


def _flat(fields: dict[str, bytes | str | int]) -> list[bytes | str | int]:
    out: list[bytes | str | int] = []
    for k, v in fields.items():
        out.append(k)
        out.append(v)
    return out


class Sender:
    """Owns the write connection; the only thread that submits and cancels."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        table: LookupTable,
        factory: Callable[[], redis.Redis],
        scripts: ScriptSet,
    ) -> None:
        self._config = config
        self._keys = keys
        self._table = table
        self._factory = factory
        self._scripts = scripts
        self._queue: deque[tuple[str, Entry | None, LookupRequest | Abort]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.guard = LoopGuard("client sender", self._stop)
        self._expected = ""
        self.errors = 0
        self.batches = 0
        self.lost_cancels = 0
        self._thread = threading.Thread(target=self._run, name="broker-lookup-sender", daemon=True)

    def start(self, expected: str) -> None:
        """Start the thread; ``expected`` is the comma-separated rank list of every lookup."""
        self._expected = expected
        self._thread.start()

    def submit(self, lookup_id: str, entry: Entry, request: LookupRequest) -> None:
        """Queue a lookup (hot path: an append and an event set)."""
        self._queue.append((lookup_id, entry, request))
        self._wake.set()

    def cancel(self, lookup_id: str, gen: int) -> None:
        """Queue a cancel of one generation."""
        self._queue.append((lookup_id, None, Abort(lookup_id=lookup_id, gen=gen)))
        self._wake.set()

    @property
    def queued(self) -> int:
        """Operations waiting to be sent."""
        return len(self._queue)

    def stop(self, timeout_s: float) -> bool:
        """Send what is queued (best effort), stop, join; False if the join timed out."""
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
            self._drain(client)  # ordered shutdown: cancels queued by close() go out
        finally:
            client.close()

    def _drain(self, client: redis.Redis) -> None:
        while self._queue:
            batch: list[tuple[str, Entry | None, LookupRequest | Abort]] = []
            while self._queue and len(batch) < _MAX_BATCH:
                batch.append(self._queue.popleft())
            self._send(client, batch)

    def _call_for(self, item: tuple[str, Entry | None, LookupRequest | Abort]) -> Call | None:
        lookup_id, entry, msg = item
        key = self._keys.lookup(lookup_id)
        cfg = self._config
        if isinstance(msg, Abort):
            return Call(
                CANCEL,
                (key, self._keys.requests),
                [msg.gen, cfg.stream_maxlen, *_flat(request_fields(msg))],
            )
        if entry is None or entry.result is not None:
            return None  # finished before it was sent (timeout, cancel, superseded)
        now_ms = int(time.time() * 1000)
        return Call(
            SUBMIT,
            (key, self._keys.requests),
            [
                msg.gen,
                self._expected,
                now_ms,
                msg.deadline_ms,
                msg.tokens,
                cfg.key_ttl_ms,
                cfg.stream_maxlen,
                *_flat(request_fields(msg)),
            ],
        )

    def _send(
        self, client: redis.Redis, batch: list[tuple[str, Entry | None, LookupRequest | Abort]]
    ) -> None:
        pairs = [(item, call) for item in batch if (call := self._call_for(item)) is not None]
        if not pairs:
            return
        results = self._run_with_retries(client, [c for _, c in pairs])
        self.batches += 1
        for (item, _), res in zip(pairs, results, strict=True):
            if isinstance(res, Exception):
                self._failed(item, res)

    def _run_with_retries(self, client: redis.Redis, calls: list[Call]) -> list[object]:
        delay = 0.01
        for attempt in range(1, self._config.redis_retries + 1):
            try:
                return self._scripts.run(client, calls)
            except BrokerLookupError as exc:
                self.errors += 1
                logger.warning(
                    "sending %d lookup operation(s) failed (attempt %d/%d): %s",
                    len(calls),
                    attempt,
                    self._config.redis_retries,
                    exc,
                )
                if attempt < self._config.redis_retries:
                    self._stop.wait(delay)
                    delay *= 4
                last: Exception = exc
        return [BrokerUnavailable(str(last))] * len(calls)

    def _failed(
        self, item: tuple[str, Entry | None, LookupRequest | Abort], exc: Exception
    ) -> None:
        lookup_id, entry, msg = item
        if entry is not None:
            # Redis is unreachable or refused: answer 0 now instead of at the timeout.
            self._table.expire(lookup_id, entry, "error")
        else:
            self.lost_cancels += 1
            if self.lost_cancels % 100 != 1:
                return
            logger.warning(
                "%d cancel(s) not delivered, latest %s gen %d: %s; keys expire by TTL and "
                "workers release pins after worker_pin_ttl_ms",
                self.lost_cancels,
                lookup_id,
                msg.gen,
                exc,
            )
