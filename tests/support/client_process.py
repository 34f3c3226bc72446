"""A scheduler's lookup client as a process of its own, for tests that kill it.

``python client_process.py ENGINE_ID WORLD_SIZE TOKENS...`` (config from the
``BROKER_LOOKUP_*`` environment) waits for every rank, looks the prompt up once, prints
``answer <hits>`` and then idles, its listener thread beating, until it is killed.
"""

from __future__ import annotations

import sys
import threading
import time

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata


def main(argv: list[str]) -> None:
    engine_id, world_size, *tokens = argv
    meta = LookupMetadata(engine_id=engine_id, world_size=int(world_size))
    client = RedisAsyncLookupClient(LookupConfig.load(), meta)
    deadline = time.monotonic() + 60
    while client.stats().dead_ranks and time.monotonic() < deadline:
        time.sleep(0.05)
    client.lookup([int(t) for t in tokens], "from-the-client-process")
    while (hits := client.lookup_cache("from-the-client-process")) is None:
        time.sleep(0.01)
    print(f"answer {hits}", flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main(sys.argv[1:])
