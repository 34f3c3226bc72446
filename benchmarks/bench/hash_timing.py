"""Hashing figures of ``python -m benchmarks.bench``: our hasher and LMCache's, timed alike.

Both sides hash the same prompts (seeded ids below 128 000, as a list and as an int64
tensor) and are timed in process CPU time, not wall time: on a loaded box a wall clock
counts the time the process waited for a core, which is noise, and the two sides,
timed minutes apart, would not see the same load. Calls alternate ours / LMCache's and
the fastest of each counts (load only ever adds time), so the speed-up compares like with
like. The garbage collector is off during each call, as in ``timeit``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from benchmarks.bench.measure import Prompts
from broker_lookup.protocol.hashing import ChunkedTokenHasher

__all__ = ["ROUNDS", "hashing", "paired_hashing"]

#: Timed calls per side, size and input kind.
ROUNDS = 15
_KINDS = ("list", "tensor")
Hasher = Callable[[Any], object]


def _ours() -> Hasher:
    return ChunkedTokenHasher().hashes_and_offsets


def _lmcache(lm: SimpleNamespace) -> Hasher:
    from benchmarks.bench.lmcache_side import token_database

    database = token_database(lm)

    def run(tokens: Any) -> None:
        for _chunk in database.process_tokens(tokens, make_key=False):
            pass

    return run


def _inputs(n: int) -> dict[str, Any]:
    import torch  # only the tensor input needs it

    base = Prompts(n).get(0)
    return {"list": base, "tensor": torch.tensor(base, dtype=torch.int64)}


def _cpu_ns(hasher: Hasher, tokens: Any) -> int:
    """CPU ns of one call, with the collector off as ``timeit`` has it: a collection of the
    bench's own heap (every latency sample so far) would land on whichever side it hit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.process_time_ns()
        hasher(tokens)
        return time.process_time_ns() - t0
    finally:
        if enabled:
            gc.enable()


def _time_sides(hashers: list[Hasher], sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """ns/token of each hasher per size and kind: the fastest of :data:`ROUNDS` alternating
    calls."""
    out: list[dict[str, Any]] = [{} for _ in hashers]
    for n in sizes:
        for kind, tokens in _inputs(n).items():
            for hasher in hashers:  # warm-up: imports, allocator pools
                hasher(tokens)
            samples: list[list[int]] = [[] for _ in hashers]
            for _ in range(ROUNDS):
                for mine, hasher in zip(samples, hashers, strict=True):
                    mine.append(_cpu_ns(hasher, tokens))
            for side, ns in zip(out, samples, strict=True):
                side.setdefault(str(n), {})[f"{kind}_ns_per_token"] = min(ns) / n
    return out


def hashing(sizes: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """ns per token of our hasher, list and int64 tensor input, per prompt size."""
    return _time_sides([_ours()], sizes)[0]


def paired_hashing(
    lm: SimpleNamespace, sizes: tuple[int, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Ours and LMCache's ``ChunkedTokenDatabase.process_tokens``, alternating: (ours, theirs)."""
    ours, theirs = _time_sides([_ours(), _lmcache(lm)], sizes)
    return ours, theirs
