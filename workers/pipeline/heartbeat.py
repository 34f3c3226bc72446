"""The rank's heartbeat key: how clients know it is alive, and what it is doing.

``bl:{E}:hb:<r>`` is a JSON string with a PX TTL, rewritten every
``heartbeat_interval_ms`` by the read loop itself, so a rank whose loop is stuck or
dead stops beating and its lookups fail fast (DESIGN rule 7). It is deleted at
shutdown, so clients see the rank gone at once instead of after the TTL.

The same write refreshes the TTL of the engine's streams and fingerprint hash
(``engine_ttl_ms``, see :mod:`broker_lookup.protocol.lifetime`): while a rank lives they
never expire, however idle the engine; once its last process is gone they do.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import BrokerLookupError, translate_redis_errors
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.lifetime import refresh_commands
from broker_lookup.transport.lean import Link

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)


class Heartbeat:
    """Writes one rank's heartbeat when due; owns no thread or connection."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        configured_engine_id: str | None = None,
    ) -> None:
        self._key = keys.heartbeat(rank)
        self._rank = rank
        self._refresh = refresh_commands(keys, config.engine_ttl_ms)
        #: The engine id the operator configured, where the key namespace was derived
        #: from it (a vLLM instance): shown in the heartbeat, for inspect and metrics.
        self._configured = configured_engine_id
        self._interval_s = config.heartbeat_interval_ms / 1000
        self._ttl_ms = config.heartbeat_ttl_ms
        self._started_ms = int(time.time() * 1000)
        self._next = 0.0
        #: Wall-clock seconds of the last heartbeat written (0.0: none yet).
        self.last_beat = 0.0

    def due(self, now: float) -> bool:
        """Whether a heartbeat is due at monotonic ``now`` (:meth:`beat` schedules the next)."""
        return now >= self._next

    def beat(self, link: Link, info: dict[str, Any]) -> None:
        """Write the heartbeat: who this rank is, plus ``info`` (its map sizes, counters);
        refresh the engine's lasting keys in the same round trip."""
        self._next = time.monotonic() + self._interval_s
        body: dict[str, Any] = {
            "rank": self._rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_ms": self._started_ms,
            "ts_ms": int(time.time() * 1000),
            **info,
        }
        if self._configured is not None:
            body["configured_engine_id"] = self._configured
        beat = ("SET", self._key, json.dumps(body), "PX", self._ttl_ms)
        with translate_redis_errors("writing the heartbeat"):
            for reply in link.call([beat, *self._refresh]):
                if isinstance(reply, ResponseError):
                    raise reply
        self.last_beat = time.time()

    def clear(self, link: Link) -> None:
        """Delete the heartbeat (shutdown); a failure is logged, not raised."""
        try:
            with translate_redis_errors("deleting the heartbeat"):
                link.settle_read()
                link.call([("DEL", self._key)])
        except BrokerLookupError as exc:
            logger.warning("rank %d: heartbeat not deleted at shutdown: %s", self._rank, exc)
