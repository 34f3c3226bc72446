"""Stub of the optional C extension (``_scan.c``); see ``workers.pipeline.reader``."""

from collections.abc import Callable
from typing import Any

from broker_lookup.protocol.messages import LookupRequest, Request

def scan(
    reply: Any,
    decode: Callable[[bytes], object],
    lookup_type: type[LookupRequest],
    now_ms: float | None,
    max_chunks: int,
    max_id_length: int,
    world_size: int,
    /,
) -> tuple[list[tuple[Request, float]], list[bytes]] | None:
    """The lookups of a raw XREADGROUP reply (RESP2's list or RESP3's map), each with the
    ms it stays worth answering, and the ids to ack; None unless the Python path would
    serve every entry (it then reads the batch). ``world_size`` < 0: no bound on the
    expected ranks. Each message is a ``lookup_type``: typed as the batch's ``Request``."""
