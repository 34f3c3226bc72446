"""The chaos soak's rig: the rank processes, a fault proxy per process, heartbeat reads.

:class:`Ranks` runs ``python -m workers`` per rank, each on its own proxy's URL, with
the soak's prompts preloaded (:class:`~broker_lookup.tools.local_ranks.LocalRanks` starts,
kills, restarts and stops them). :class:`Proxies` puts one
:class:`~faultproxy.proxy.FaultProxy` in front of the server for each process
(``"client"``, ``"rank0"``, ...), so a network fault hits one process, as a broken
node or a flaky link does; each proxy's thread stops with a bounded join. The embedded
server restarts on the same port, so the proxies' upstream stays right. :class:`Beats`
reads the ranks' heartbeats straight from the server, to tell when a restarted rank
serves again.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from benchmarks.soak.traffic import CHUNK, CHUNKS, Prompt
from broker_lookup.config import env_name
from broker_lookup.processes import child_env
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.local_ranks import LocalRanks, write_preload
from faultproxy.proxy import FaultProxy

__all__ = ["Beats", "Proxies", "Ranks", "rss_kb"]

_LOAD_DELAY_MS = 5  #: per disk chunk, so cancels and kills land mid-prefetch
_PROBE_EVERY_S = 0.1  #: heartbeat reads while a killed rank or a restarted server comes back


def rss_kb(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in KiB (None if it is gone)."""
    try:
        found = re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except (OSError, TypeError):
        return None
    return int(found.group(1)) if found else None


class Ranks(LocalRanks):
    """The soak's rank processes, started at once: each prompt's share preloaded on each rank.

    Rank ``r`` connects to ``urls[r]`` (its own fault proxy); ``timeout_ms`` is the
    lookup timeout, as the client's; ``settings`` are further config fields of every rank
    (the fleet soak's stream caps and engine TTL).
    """

    def __init__(
        self,
        urls: list[str],
        engine_id: str,
        prompts: list[Prompt],
        workdir: Path,
        timeout_ms: int,
        settings: Mapping[str, object] | None = None,
    ) -> None:
        items = [
            {"tokens": p.tokens, "ranks": [r], "fraction": p.stored[r] / CHUNKS, "tier": p.tier}
            for p in prompts
            for r in range(len(urls))
        ]
        preload = write_preload(workdir / "preload.json", items)
        envs = [child_env(os.environ, _settings(url, timeout_ms, settings)) for url in urls]
        args = ["--preload", str(preload), "--load-delay-ms", str(_LOAD_DELAY_MS)]
        super().__init__(engine_id, envs, workdir, [*args, "--log-level", "WARNING"])
        self.start_all()

    def pid(self, rank: int) -> int:
        """The pid of rank ``rank``'s current process."""
        return self.procs[rank].pid


def _settings(url: str, timeout_ms: int, settings: Mapping[str, object] | None) -> dict[str, str]:
    """The environment of a rank on ``url``."""
    values: dict[str, object] = {
        "redis_url": url,
        "chunk_size": CHUNK,
        "lookup_timeout_ms": timeout_ms,
    }
    values.update(settings or {})
    return {env_name(k): str(v) for k, v in values.items()}


class Proxies:
    """One fault proxy per process (``"client"``, ``"rank0"``, ...), all to one server."""

    def __init__(self, url: str, names: Sequence[str]) -> None:
        self.by_name = {name: FaultProxy.for_url(url) for name in names}

    def start(self) -> Proxies:
        for proxy in self.by_name.values():
            proxy.start()
        return self

    def url(self, name: str) -> str:
        """The URL process ``name`` connects to."""
        return self.by_name[name].url

    def stats(self) -> dict[str, dict[str, int]]:
        return {name: proxy.stats for name, proxy in self.by_name.items()}

    def clear(self) -> None:
        """End every fault on every proxy (so a stop after an error is not held up)."""
        for proxy in self.by_name.values():
            proxy.clear()

    def stop(self) -> None:
        """Stop every proxy (each joins its thread within about 2 s)."""
        for proxy in self.by_name.values():
            proxy.stop()


class Beats:
    """Reads which process beats for each rank: the pid in its heartbeat (direct, no proxy)."""

    def __init__(self, monitor: redis.Redis, keys: KeySpace, ranks: int) -> None:
        self._monitor = monitor
        self._keys = [keys.heartbeat(r) for r in range(ranks)]
        self._pids: list[int | None] = [None] * ranks
        self._read_at = -1.0

    def pids(self, now: float) -> list[int | None]:
        """Each rank's heartbeat pid (None: no heartbeat), read at most every 0.1 s."""
        if now - self._read_at >= _PROBE_EVERY_S:
            self._read_at = now
            try:
                raws = self._monitor.mget(self._keys)
            except redis.RedisError:  # the server is restarting: no news, try later
                return self._pids
            self._pids = [json.loads(raw)["pid"] if raw else None for raw in raws]
        return self._pids
