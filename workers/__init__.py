"""Worker side of broker-lookup: the lookup server, the reference engine, the rank runner."""

from workers.reference_engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

__all__ = ["RedisAsyncLookupServer", "ReferenceEngine"]
