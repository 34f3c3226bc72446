"""The connections of one rank: what the server makes itself, and how they time out."""

from __future__ import annotations

from broker_lookup.config import LookupConfig
from broker_lookup.transport.connection import ConnectionFactory, make_factory

__all__ = ["rank_factories"]


def rank_factories(
    config: LookupConfig, name: str, given: ConnectionFactory | None
) -> tuple[ConnectionFactory, ConnectionFactory, list[ConnectionFactory]]:
    """(general, blocking-read, owned) factories: ``given`` for both (owned: none), or two
    made here, which the server closes at shutdown.

    Made here, every socket times out after ``config.loop_timeout_s``, so no read
    of a stalled Redis pauses the rank's loop for the general socket timeout; the read
    loop's factory has a pool of its own, so it can turn redis-py's retries off alone.
    """
    if given is not None:
        return given, given, []
    general = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    read = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    return general, read, [general, read]
