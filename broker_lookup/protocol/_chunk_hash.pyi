"""Stub of the optional C extension (``_chunk_hash.c``); see ``hashing.py``."""

def chain(
    tokens: object, chunk_size: int, end: int, first_lane: int, empty_lane: int, /
) -> list[int]:
    """``hash((chain, tuple(chunk), ()))`` per chunk of ``tokens[:end]``, chained from the
    value whose hash is ``first_lane``; ``empty_lane`` is ``hash(())``. TypeError for an
    input it does not take (Python then hashes it)."""
