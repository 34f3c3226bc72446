"""The scheduler's side: lookup clients over Redis, their wrappers and the factory.

``redis_client`` holds the clients, ``wrappers`` and ``bypass`` the others; ``admission``
decides what reaches Redis, ``guard`` keeps every client's contract path from raising,
``table`` is the in-memory state the hot path reads, ``sender`` and ``listener`` are the two
background loops, ``breaker`` says whether Redis is answering.
"""

from broker_lookup.client.redis_client import RedisAsyncLookupClient, RedisLookupClient

__all__ = ["RedisAsyncLookupClient", "RedisLookupClient"]
