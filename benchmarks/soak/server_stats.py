"""What the fleet soak reads from the server itself: memory and CPU over time, and its keys.

:class:`ServerStats` samples ``INFO memory`` (``used_memory``), ``INFO cpu``
(``used_cpu_sys`` + ``used_cpu_user``) and ``DBSIZE`` every ``every_s`` seconds from the
soak's loop, on a direct connection (no fault proxy). :func:`scan_keys` lists every key
of the soak's engines with its type and PTTL, for
:func:`~benchmarks.soak.fleet_checks.audit_keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from benchmarks.soak.fleet_checks import KeyRow
from broker_lookup.protocol.keys import KeySpace

__all__ = ["ServerStats", "scan_keys"]


class ServerStats:
    """The server's memory, key count and CPU, sampled from the soak's loop.

    Args:
        monitor: A direct connection to the server.
        origin: The soak's start (``time.monotonic()``); samples are timed from it.
        every_s: How often :meth:`tick` samples.
    """

    def __init__(self, monitor: redis.Redis, origin: float, every_s: float = 2.0) -> None:
        self._monitor = monitor
        self._origin = origin
        self._every_s = every_s
        self._next = origin
        self.series: list[dict[str, Any]] = []

    def tick(self, now: float) -> None:
        """Take a sample if one is due."""
        if now >= self._next:
            self._next = now + self._every_s
            self.sample(now)

    def sample(self, now: float) -> dict[str, Any]:
        """Sample now and keep it in :attr:`series`."""
        memory = self._monitor.info("memory")
        row = {
            "t_s": round(now - self._origin, 1),
            "used_memory": int(memory["used_memory"]),
            "keys": int(self._monitor.dbsize()),
            "cpu_s": self.cpu_s(),
        }
        self.series.append(row)
        return row

    def cpu_s(self) -> float:
        """CPU seconds the server has used since it started (system + user)."""
        cpu = self._monitor.info("cpu")
        return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


def scan_keys(monitor: redis.Redis, engines: Sequence[str], everything: bool) -> list[KeyRow]:
    """Every key of ``engines`` with its type and PTTL; with ``everything`` (a server of
    the soak's own) also every other key, as of engine "". A key that expired between
    the scan and the read of its PTTL (-2) is left out."""
    names: dict[str, str] = {}
    for engine in engines:
        names.update(dict.fromkeys(_scan(monitor, KeySpace(engine).pattern), engine))
    if everything:
        names.update({k: "" for k in _scan(monitor, "*") if k not in names})
    pipe = monitor.pipeline(transaction=False)
    for name in names:
        pipe.type(name)
        pipe.pttl(name)
    replies = pipe.execute()
    rows = []
    for i, (name, engine) in enumerate(names.items()):
        kind, pttl = replies[2 * i], int(replies[2 * i + 1])
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if pttl != -2:
            rows.append(KeyRow(name, engine, kind, pttl))
    return rows


def _scan(monitor: redis.Redis, pattern: str) -> list[str]:
    keys = monitor.scan_iter(match=pattern, count=500)
    return [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
