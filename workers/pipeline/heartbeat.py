"""The rank's heartbeat key: how clients know it is alive, and what it is doing.

``bl:{E}:hb:<r>`` is a JSON string with a PX TTL, rewritten every
``heartbeat_interval_ms`` by the read loop itself, so a rank whose loop is stuck or
dead stops beating and its lookups fail fast, not after the full timeout. ``claim.lua`` writes it
with the renewal of the rank's lease, and only for the lease's holder, so a second
process started for the rank never passes for it. It is deleted with the lease's
release at shutdown, so clients see the rank gone at once instead of after the TTL.

Each beat also refreshes the TTL of the engine's streams and fingerprint hash
(``engine_ttl_ms``, see :mod:`broker_lookup.protocol.lifetime`): while a rank lives they
never expire, however idle the engine; once its last process is gone they do. The
lease's holder writes its metrics snapshot with that refresh, every
``metrics_interval_ms`` (see :mod:`broker_lookup.protocol.snapshot`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker_lookup.config import LookupConfig
from broker_lookup.errors import translate_redis_errors
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.lifetime import refresh_commands
from broker_lookup.transport.link import Link

__all__ = ["Heartbeat"]


class Heartbeat:
    """Makes one rank's heartbeat when due; owns no thread or connection."""

    def __init__(
        self,
        config: LookupConfig,
        keys: KeySpace,
        rank: int,
        configured_engine_id: str | None = None,
    ) -> None:
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
        """Whether a heartbeat is due at monotonic ``now`` (:meth:`body` schedules the next)."""
        return now >= self._next

    def body(self, info: dict[str, Any]) -> tuple[str, int]:
        """The heartbeat ``claim.lua`` writes: who this rank is, plus ``info`` (its map
        sizes, counters), and its TTL in ms. Schedules the next one."""
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
        return json.dumps(body), self._ttl_ms

    def written(self) -> None:
        """The heartbeat of the last :meth:`body` was written."""
        self.last_beat = time.time()

    def refresh(self, link: Link, extra: Sequence[Command] = ()) -> None:
        """Refresh the engine's lasting keys (streams, fingerprint): once per beat, by any
        live process of the engine, holder of the lease or not; ``extra`` (the metrics
        snapshot) goes in the same round trip."""
        with translate_redis_errors("refreshing the engine's keys"):
            for reply in link.call([*self._refresh, *extra]):
                if isinstance(reply, ResponseError):
                    raise reply
