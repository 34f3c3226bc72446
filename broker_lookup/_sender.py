"""The client's sender thread: turns queued submits and cancels into pipelined scripts.

``lookup()`` and ``cancel_lookup()`` only append to a deque and set an event; this
thread drains everything queued per wake-up into one pipeline, so a burst of N
lookups costs one round trip, not N.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from broker_lookup._batcher import Batcher
from broker_lookup._state import Entry, LookupTable
from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerUnavailable
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


Item = tuple[str, Entry | None, LookupRequest | Abort]


class Sender(Batcher[Item]):
    """Owns the write connection; the only thread that submits and cancels."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        table: LookupTable,
        factory: Callable[[], redis.Redis],
        scripts: ScriptSet,
    ) -> None:
        super().__init__("client sender", factory, scripts, config.redis_retries, _MAX_BATCH)
        self._config = config
        self._keys = keys
        self._table = table
        self._expected = ""
        self.batches = 0
        self.lost_cancels = 0

    def start(self, expected: str = "") -> None:
        """Start the thread; ``expected`` is the comma-separated rank list of every lookup."""
        self._expected = expected
        super().start()

    def submit(self, lookup_id: str, entry: Entry, request: LookupRequest) -> None:
        """Queue a lookup (hot path: an append and an event set)."""
        self._put((lookup_id, entry, request))

    def cancel(self, lookup_id: str, gen: int) -> None:
        """Queue a cancel of one generation."""
        self._put((lookup_id, None, Abort(lookup_id=lookup_id, gen=gen)))

    def _call_for(self, item: Item) -> Call | None:
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

    def _send_batch(self, client: redis.Redis, batch: list[Item]) -> None:
        pairs = [(item, call) for item in batch if (call := self._call_for(item)) is not None]
        if not pairs:
            return
        results: list[Any] | None = self._run_with_retries(client, [c for _, c in pairs])
        if results is None:
            results = [BrokerUnavailable("Redis unavailable after retries")] * len(pairs)
        self.batches += 1
        for (item, _), res in zip(pairs, results, strict=True):
            if isinstance(res, Exception):
                self._failed(item, res)

    def _failed(self, item: Item, exc: Exception) -> None:
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
