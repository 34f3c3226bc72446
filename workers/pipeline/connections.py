"""The connections of one rank: what the server makes itself, and how they time out."""

from __future__ import annotations

from typing import NamedTuple

from broker_lookup.config import LookupConfig
from broker_lookup.transport.connection import ConnectionFactory, make_factory

__all__ = ["RankFactories", "rank_factories"]


class RankFactories(NamedTuple):
    """A rank's connection factories, and those of them the server made (and closes)."""

    general: ConnectionFactory  #: the reporter's, the sweeper's, shutdown's
    read: ConnectionFactory  #: the read loop's (it blocks in XREADGROUP)
    beat: ConnectionFactory  #: the beat's (lease, heartbeat, refreshes)
    owned: list[ConnectionFactory]


def rank_factories(
    config: LookupConfig, name: str, given: ConnectionFactory | None
) -> RankFactories:
    """``given`` for every use (owned: none), or factories made here, which the server
    closes at shutdown.

    Made here, every socket times out after ``config.loop_timeout_s`` (the beat's after
    ``config.beat_timeout_s``), so no read of a stalled Redis pauses the rank's loop for
    the general socket timeout, nor its beat for a lease; the read loop's and the beat's
    factories have pools of their own, so each can turn redis-py's retries off alone.
    """
    if given is not None:
        return RankFactories(given, given, given, [])
    general = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    read = make_factory(config, name, socket_timeout_s=config.loop_timeout_s)
    beat = make_factory(config, name + "-beat", socket_timeout_s=config.beat_timeout_s)
    return RankFactories(general, read, beat, [general, read, beat])
