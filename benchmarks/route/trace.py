"""The request trace of ``python -m benchmarks.route``: prompts sharing prefixes, seeded.

Each request is one of ``groups`` shared prefixes (a system prompt, a document, a
conversation so far), chosen with a Zipf-like popularity, followed by a part of its own
(a question), so the same trace asks for some prefixes often and for some rarely, and
every request adds chunks no other request asks for: caches fill and evict.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.hashing import ChunkedTokenHasher

__all__ = ["Request", "make_trace"]


@dataclass(frozen=True)
class Request:
    """One request: its prompt, and the prompt's chunk hashes and token counts."""

    index: int
    tokens: list[int]
    hashes: list[int]
    offsets: list[int]


def make_trace(
    config: LookupConfig,
    requests: int,
    groups: int,
    prefix_chunks: int,
    own_chunks: int,
    seed: int,
) -> list[Request]:
    """``requests`` prompts of one shared prefix of ``prefix_chunks`` chunks (of
    ``groups``, popularity ~ 1/rank) and 1 to ``own_chunks`` chunks of their own."""
    rng = random.Random(seed)
    size = config.chunk_size
    prefixes = [
        [rng.randrange(1, 128_000) for _ in range(prefix_chunks * size)] for _ in range(groups)
    ]
    weights = [1.0 / (g + 1) for g in range(groups)]
    hasher = ChunkedTokenHasher(config)
    out = []
    for i in range(requests):
        shared = rng.choices(prefixes, weights)[0]
        own = [rng.randrange(1, 128_000) for _ in range(rng.randint(1, own_chunks) * size)]
        tokens = shared + own
        chunks = list(hasher.process_tokens(tokens))
        out.append(Request(i, tokens, [h for _, _, h in chunks], [e - s for s, e, _ in chunks]))
    return out
