"""broker-lookup: Redis-brokered KV-cache lookup coordination for vLLM + LMCache.

The scheduler's client writes lookups to a Redis stream; every worker rank reads
them through its own consumer group, prefetches, and reports its hit count into a
hash keyed by lookup id; the client takes the minimum over ranks, or 0 at the
timeout. This package is everything the scheduler and both sides share; the
worker side lives in ``workers``.
"""

from broker_lookup.client import RedisAsyncLookupClient, RedisLookupClient
from broker_lookup.client.bypass import BypassLookupClient
from broker_lookup.client.factory import LookupClientFactory
from broker_lookup.client.wrappers import (
    ChunkStatisticsLookupClient,
    HitLimitLookupClient,
)
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.engine import (
    LookupEngine,
    PartialEngine,
    ProbeEngine,
    ProgressSink,
    ResponseSink,
    SyncLookupEngine,
)
from broker_lookup.errors import (
    BrokerLookupError,
    BrokerResponseError,
    BrokerUnavailable,
    ConfigError,
    InvalidRequest,
    MalformedMessage,
    UnknownScheme,
)
from broker_lookup.interface import LookupClientInterface
from broker_lookup.ops.fleet_query import EngineAnswer, FleetAnswer, FleetClient
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace

__version__ = "0.1.0"

__all__ = [
    "BrokerLookupError",
    "BrokerResponseError",
    "BrokerUnavailable",
    "BypassLookupClient",
    "ChunkStatisticsLookupClient",
    "ChunkedTokenHasher",
    "ConfigError",
    "EngineAnswer",
    "FleetAnswer",
    "FleetClient",
    "HitLimitLookupClient",
    "InvalidRequest",
    "KeySpace",
    "LookupClientFactory",
    "LookupClientInterface",
    "LookupConfig",
    "LookupEngine",
    "LookupMetadata",
    "MalformedMessage",
    "PartialEngine",
    "ProbeEngine",
    "ProgressSink",
    "RedisAsyncLookupClient",
    "RedisLookupClient",
    "ResponseSink",
    "SyncLookupEngine",
    "UnknownScheme",
    "__version__",
]
