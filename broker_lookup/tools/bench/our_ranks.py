"""Worker ranks for ``broker-lookup bench``: an instant engine behind ``RedisAsyncLookupServer``.

``python -m broker_lookup.tools.bench.our_ranks --redis-url URL --engine E1:4 --engine E2:1:mute``
serves every rank of every engine given, one process per rank forked from one host
(see ``broker_lookup.tools.bench.rank_host``). Each rank prints ``@bench ready <engine> <rank>
<pid>`` once its consumer group exists, and stops cleanly on SIGTERM.

The engine answers at once, on the server's consumer thread, as the fake engines of
LMCache's own tests do: a hit of ``--hit-fraction`` of the prompt's chunks, or never for
a ``mute`` engine (its lookups stay in flight: the bench's memory and pending probes).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.tools.bench.rank_host import RankSpec, host_parser, ready, run_host
from workers.server import RedisAsyncLookupServer

__all__ = ["InstantEngine", "main"]

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 30.0


class InstantEngine:
    """Reports ``fraction`` of the asked chunks (as tokens) the moment a lookup starts."""

    def __init__(self, fraction: float = 1.0, mute: bool = False) -> None:
        self.fraction = fraction
        self.mute = mute
        self.server: Any = None

    def post_init(self, async_lookup_server: Any = None) -> None:
        """LMCache's wiring: the server hands itself over."""
        self.server = async_lookup_server

    def async_lookup_and_prefetch(
        self,
        lookup_id: str,
        hashes: list[int],
        offsets: list[int],
        pin: bool = True,
        request_configs: dict[str, Any] | None = None,
    ) -> None:
        """Report the hit prefix now (unless muted)."""
        if self.mute:
            return
        chunks = int(len(offsets) * self.fraction)
        self.server.send_response_to_scheduler(lookup_id, sum(offsets[:chunks]))

    def cleanup_memory_objs(self, lookup_id: str) -> None:
        """Nothing is pinned."""


def _serve(config: LookupConfig, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    metadata = LookupMetadata(
        engine_id=spec.engine_id, world_size=spec.world_size, worker_id=spec.rank
    )
    server = RedisAsyncLookupServer(InstantEngine(fraction, spec.mute), metadata, config)
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not server.ready and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.01)
        if not server.ready:
            logger.error("%s: consumer group not ready in %.0fs", spec, _READY_TIMEOUT_S)
            return 1
        ready(spec)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    """Serve the ranks until SIGTERM; 0 if every rank stopped cleanly."""
    p = host_parser("python -m broker_lookup.tools.bench.our_ranks", __doc__)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--config-json", default="{}", help="further LookupConfig fields (JSON)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fields = {**json.loads(args.config_json), "redis_url": args.redis_url}
    config = LookupConfig.from_mapping(fields, source="--config-json")
    return run_host(args.engine, lambda spec, stop: _serve(config, args.hit_fraction, spec, stop))


if __name__ == "__main__":
    sys.exit(main())
