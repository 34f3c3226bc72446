"""Our hashes against LMCache's own ``ChunkedTokenDatabase``, in the same process.

Needs a tested LMCache (0.5.6, or 0.5.7rc2 where the database moved to
``lmcache.inprocess.v1``): see the ``lmc`` fixture. Without one the module skips locally
and fails under ``CI``, which must run it.
"""

from __future__ import annotations

import importlib
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from broker_lookup.protocol.hashing import NATIVE_HASHING, ChunkedTokenHasher

pytestmark = pytest.mark.lmcache

LENGTHS = [0, 1, 15, 16, 17, 255, 256, 257, 600, 1000, 4099]


@pytest.fixture(scope="module")
def lmcache(lmc: SimpleNamespace) -> SimpleNamespace:
    """LMCache's config class and token database (its module is in the layout's package)."""
    database = importlib.import_module(lmc.layout.module("v1.token_database"))
    return SimpleNamespace(Config=lmc.Config, db=database)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_000) for _ in range(n)]


def lmcache_hashes(database: Any, tokens: Any, **kwargs: Any) -> list[tuple[int, int, int]]:
    return [tuple(t) for t in database.process_tokens(tokens=tokens, make_key=False, **kwargs)]


@pytest.mark.parametrize("chunk_size", [16, 256])
@pytest.mark.parametrize("save_unfull", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_same_hashes_as_lmcache(
    lmcache: SimpleNamespace, chunk_size: int, save_unfull: bool, as_tensor: bool
) -> None:
    config = lmcache.Config.from_defaults(chunk_size=chunk_size, save_unfull_chunk=save_unfull)
    theirs = lmcache.db.ChunkedTokenDatabase(config)
    ours = ChunkedTokenHasher(config)  # LMCache's config satisfies HashingConfig
    for n in LENGTHS:
        tokens = prompt(n, seed=n * 31 + chunk_size)
        given = torch.tensor(tokens, dtype=torch.int64) if as_tensor else tokens
        expected = lmcache_hashes(theirs, given)
        assert list(ours.process_tokens(given)) == expected, f"{n} tokens"
        hashes, offsets = ours.hashes_and_offsets(given)
        # What LMCache's lookup clients send: the hashes and per-chunk token counts.
        assert hashes == [h for *_, h in expected]
        assert offsets == [end - start for start, end, _ in expected]


@pytest.mark.parametrize("n", [8192, 8192 + 77])
@pytest.mark.parametrize("save_unfull", [False, True])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_same_hashes_as_lmcache_at_8k_on_both_paths(
    lmcache: SimpleNamespace, n: int, save_unfull: bool, as_tensor: bool
) -> None:
    # A long prompt through the C extension (where built) and through the Python path.
    config = lmcache.Config.from_defaults(chunk_size=256, save_unfull_chunk=save_unfull)
    tokens = prompt(n, seed=n)
    given = torch.tensor(tokens, dtype=torch.int64) if as_tensor else tokens
    expected = lmcache_hashes(lmcache.db.ChunkedTokenDatabase(config), given)
    assert len(expected) == n // 256 + (1 if save_unfull and n % 256 else 0)
    ours = ChunkedTokenHasher(config)
    assert ours.native == NATIVE_HASHING
    assert list(ours.process_tokens(given)) == expected
    ours.native = False
    assert list(ours.process_tokens(given)) == expected


def test_no_config_matches_lmcache_without_config(lmcache: SimpleNamespace) -> None:
    theirs = lmcache.db.ChunkedTokenDatabase()
    ours = ChunkedTokenHasher()
    for n in LENGTHS:
        tokens = prompt(n, seed=n)
        assert list(ours.process_tokens(tokens)) == lmcache_hashes(theirs, tokens)


@pytest.mark.parametrize("save_unfull", [False, True])
def test_mask_matches_lmcache(lmcache: SimpleNamespace, save_unfull: bool) -> None:
    config = lmcache.Config.from_defaults(chunk_size=16, save_unfull_chunk=save_unfull)
    theirs = lmcache.db.ChunkedTokenDatabase(config)
    tokens = prompt(70, seed=7)
    mask = torch.tensor([False] * 32 + [True] * 38)
    expected = lmcache_hashes(theirs, tokens, mask=mask)
    assert list(ChunkedTokenHasher(config).process_tokens(tokens, mask=mask)) == expected
    bad_mask = torch.tensor([False] * 5 + [True] * 65)
    with pytest.raises(ValueError):
        lmcache_hashes(theirs, tokens, mask=bad_mask)
    with pytest.raises(ValueError):
        ChunkedTokenHasher(config).process_tokens(tokens, mask=bad_mask)


def test_same_none_hash_and_algorithm_resolution(lmcache: SimpleNamespace) -> None:
    # Whatever this environment offers (vLLM or not), both must resolve alike: without
    # vLLM a digest name falls back to builtin hash in both.
    config = lmcache.Config.from_defaults(chunk_size=16, pre_caching_hash_algorithm="sha256_cbor")
    theirs = lmcache.db.ChunkedTokenDatabase(config)
    ours = ChunkedTokenHasher(config)
    assert ours.none_hash == lmcache.db.NONE_HASH
    tokens = prompt(100, seed=3)
    assert list(ours.process_tokens(tokens)) == lmcache_hashes(theirs, tokens)
