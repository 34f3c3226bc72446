"""Worker ranks for ``python -m benchmarks.bench``: a stub engine behind ``RedisAsyncLookupServer``.

``python -m benchmarks.bench.our_ranks --redis-url URL --engine E1:4 --engine E2:1:mute``
serves every rank of every engine given, one process per rank forked from one host
(see ``benchmarks.bench.rank_host``). Each rank prints ``@bench ready <engine> <rank>
<pid>`` once its consumer group exists, and stops cleanly on SIGTERM.

The engine is :class:`~broker_lookup.stub_engine.StubEngine`: it answers at once, on
the server's consumer thread, as the fake engines of LMCache's own tests do, with a hit of
``--hit-fraction`` of the prompt's chunks, or never for a ``mute`` engine (its lookups stay
in flight: the bench's memory and pending probes). The server is built through
``LookupClientFactory.create_lookup_server`` (the registered entry point), since
``broker_lookup`` never imports ``workers``.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from benchmarks.bench.rank_host import RankSpec, host_parser, ready, run_host
from broker_lookup.client.factory import LookupClientFactory
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.processes import ExitCode
from broker_lookup.stub_engine import StubEngine

__all__ = ["main"]

logger = logging.getLogger(__name__)

_READY_TIMEOUT_S = 30.0


def _serve(config: LookupConfig, fraction: float, spec: RankSpec, stop: threading.Event) -> int:
    metadata = LookupMetadata(
        engine_id=spec.engine_id, world_size=spec.world_size, worker_id=spec.rank
    )
    # record=False: the bench's memory probe must see the server's maps, not the stub's lists.
    engine = StubEngine("mute" if spec.mute else "instant", fraction=fraction, record=False)
    server = LookupClientFactory.create_lookup_server(engine, metadata, config)
    if server is None:
        logger.error("%s: the config gives this rank no lookup server", spec)
        return ExitCode.USAGE
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not server.ready and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.01)
        if not server.ready:
            logger.error("%s: consumer group not ready in %.0fs", spec, _READY_TIMEOUT_S)
            return ExitCode.FAILED
        ready(spec)
        while not stop.wait(0.5):
            pass
        return ExitCode.OK
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    """Serve the ranks until SIGTERM; 0 if every rank stopped cleanly."""
    p = host_parser("python -m benchmarks.bench.our_ranks", __doc__)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--config-json", default="{}", help="further LookupConfig fields (JSON)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    fields = {**json.loads(args.config_json), "redis_url": args.redis_url}
    config = LookupConfig.from_mapping(fields, source="--config-json")
    return run_host(args.engine, lambda spec, stop: _serve(config, args.hit_fraction, spec, stop))


if __name__ == "__main__":
    sys.exit(main())
