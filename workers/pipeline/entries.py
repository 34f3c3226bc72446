"""Whether a decoded request entry can be served: the wire's rules and the rank's limits."""

from __future__ import annotations

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.messages import (
    Abort,
    Keep,
    Request,
    request_configs_problem,
    validate_request,
    wire_id_problem,
)

__all__ = ["entry_problem"]


def entry_problem(msg: Request, config: LookupConfig, world_size: int | None) -> str | None:
    """Why ``msg`` can't be served (None if it can), by the producer's limits too.

    Any non-empty UTF-8 ``str`` is a legal lookup id (keys hold a digest of ids they
    should not hold verbatim), so ids with spaces or non-ASCII characters are served.
    """
    if isinstance(msg, Abort):
        return wire_id_problem(msg.lookup_id, config.max_lookup_id_length)
    if isinstance(msg, Keep):
        if msg.tokens <= 0:
            return f"keep tokens={msg.tokens} must be > 0 (a partial answer of 0 is an abort)"
        return wire_id_problem(msg.lookup_id, config.max_lookup_id_length)
    reason = validate_request(
        msg, max_chunks=config.max_chunks_per_request, max_id_length=config.max_lookup_id_length
    )
    if reason is not None:
        return reason
    if world_size is not None and max(msg.expected) >= world_size:
        return f"expected ranks {msg.expected[:8]} go beyond world_size={world_size}"
    configs = request_configs_problem(msg.request_configs, config.max_request_configs_bytes)
    return None if configs is None else configs.reason
