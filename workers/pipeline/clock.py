"""The Redis server's clock as seen from a rank, for judging a request's relative budget.

A request is worthless ``budget_ms`` after the server stamped its stream entry (the
millisecond part of the entry id). Comparing that stamp with this host's wall clock
would make every lookup expire under a few seconds of clock skew between hosts, so
the rank asks the server for its time with ``TIME`` (once a second, in the heartbeat
round trip) and carries it forward with the local monotonic clock in between.
"""

from __future__ import annotations

import time

from redis.exceptions import ResponseError

from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.messages import LookupRequest
from broker_lookup.transport.link import Link

__all__ = ["ServerClock", "entry_stamp_ms"]

#: How often the offset to the server's clock is re-measured.
SAMPLE_EVERY_S = 1.0


def entry_stamp_ms(entry_id: bytes | str) -> int | None:
    """The server's epoch ms in a stream entry id (``<ms>-<seq>``), or None if it has none."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    head = raw.partition("-")[0]
    return int(head) if head.isdigit() else None


class ServerClock:
    """The server's epoch ms, estimated from the last ``TIME`` sample and the monotonic clock."""

    def __init__(self) -> None:
        self._sample: tuple[float, float] | None = None  # (server ms, local monotonic s)
        self._next = 0.0

    def due(self, now: float) -> bool:
        """Whether a new sample is due at monotonic ``now``."""
        return now >= self._next

    def sample(self, link: Link) -> None:
        """Ask the server for its time; the midpoint of the round trip is when it answered."""
        before = time.monotonic()
        with translate_redis_errors("reading the server's clock"):
            [reply] = link.call([("TIME",)])
            if isinstance(reply, ResponseError):
                raise reply
        after = time.monotonic()
        seconds, micros = int(reply[0]), int(reply[1])
        self._sample = (seconds * 1000 + micros / 1000, (before + after) / 2)
        self._next = after + SAMPLE_EVERY_S

    def now_ms(self) -> float | None:
        """The server's epoch ms now, or None before the first sample."""
        sample = self._sample
        if sample is None:
            return None
        server_ms, at = sample
        return server_ms + (time.monotonic() - at) * 1000

    def remaining_ms(self, req: LookupRequest, entry_id: bytes | str) -> float:
        """How long ``req`` stays worth answering, in ms (<= 0: already worthless).

        ``budget_ms`` counts from the entry's stamp on the server's clock. An older
        client sends no budget: its ``deadline_ms`` (its own wall clock) is all there is.
        """
        now = self.now_ms()
        stamp = entry_stamp_ms(entry_id)
        if req.budget_ms > 0:
            if now is None or stamp is None:
                return float(req.budget_ms)
            return stamp + req.budget_ms - now
        return req.deadline_ms - (time.time() * 1000 if now is None else now)
