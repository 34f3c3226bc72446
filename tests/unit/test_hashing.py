"""ChunkedTokenHasher: LMCache 0.5.6 chunk hashing, bit for bit (reference spec section 2)."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, overload

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_lookup.errors import ConfigError, InvalidRequest
from broker_lookup.protocol.hashing import (
    ChunkedTokenHasher,
    _resolve_none_hash,
    normalize_hash,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def cfg(
    chunk_size: object = 256, save_unfull_chunk: bool = False, algorithm: str = "builtin"
) -> SimpleNamespace:
    """A config as LMCache passes it (any object with these attributes; bad values too)."""
    return SimpleNamespace(
        chunk_size=chunk_size,
        save_unfull_chunk=save_unfull_chunk,
        pre_caching_hash_algorithm=algorithm,
    )


def reference(
    tokens: Sequence[int],
    size: int,
    save_unfull: bool,
    fn: Callable[[object], int | bytes] = hash,
    none_hash: int = 0,
) -> list[tuple[int, int, int]]:
    """The recipe of spec section 2.2, written as plainly as possible."""
    total = len(tokens)
    end = total if save_unfull else total - total % size
    chain = none_hash
    out: list[tuple[int, int, int]] = []
    for start in range(0, end, size):
        chain = normalize_hash(fn((chain, tuple(tokens[start : start + size]), ())))
        out.append((start, min(start + size, total), chain))
    return out


class ConstantList(Sequence[int]):
    """Stand-in for vLLM's ``ConstantList`` (a read-only Sequence, not a list)."""

    def __init__(self, items: list[int]) -> None:
        self._x = items

    @overload
    def __getitem__(self, item: int) -> int: ...
    @overload
    def __getitem__(self, item: slice) -> Sequence[int]: ...
    def __getitem__(self, item: int | slice) -> int | Sequence[int]:
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self) -> Iterator[int]:
        return iter(self._x)


# --- spec 2.3 test vectors ------------------------------------------------------------


def test_vectors_chunk_256_without_unfull_chunk() -> None:
    got = list(ChunkedTokenHasher(cfg(256, False)).process_tokens(list(range(600))))
    assert got == [(0, 256, 3131758554629441992), (256, 512, 8783757053568497755)]


def test_vectors_chunk_256_with_unfull_chunk() -> None:
    got = list(ChunkedTokenHasher(cfg(256, True)).process_tokens(list(range(600))))
    assert got == [
        (0, 256, 3131758554629441992),
        (256, 512, 8783757053568497755),
        (512, 600, 4356085038892181893),
    ]


def test_vectors_chunk_4() -> None:
    got = list(ChunkedTokenHasher(cfg(4, True)).process_tokens(list(range(10))))
    assert got == [
        (0, 4, 1926077685454645420),
        (4, 8, -7804484139983318662),
        (8, 10, 351376449021863462),
    ]


def test_no_config_is_lmcache_default_chunk_256_keeping_the_tail() -> None:
    hasher = ChunkedTokenHasher()
    assert (hasher.chunk_size, hasher.save_unfull_chunk, hasher.algorithm) == (256, True, "builtin")
    assert hasher.none_hash == 0
    assert [h for *_, h in hasher.process_tokens(list(range(600)))][-1] == 4356085038892181893


@pytest.mark.parametrize("native", [True, False], ids=["native-if-built", "python"])
def test_vectors_on_both_paths(native: bool) -> None:
    # The C extension hashes builtin chunks where it is built; the Python path must hold too.
    hasher = ChunkedTokenHasher(cfg(256, True))
    hasher.native = native and hasher.native
    tokens = list(range(600))
    assert [h for *_, h in hasher.process_tokens(tokens)] == [
        3131758554629441992,
        8783757053568497755,
        4356085038892181893,
    ]
    assert hasher.hashes_and_offsets(torch.tensor(tokens))[0][-1] == 4356085038892181893
    assert hasher.fingerprint()["probe"] == reference(range(515), 256, True)[-1][2]


# --- the fast path equals the plain recipe --------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 16, 256])
@pytest.mark.parametrize("save_unfull", [False, True])
def test_matches_plain_recipe_at_chunk_edges(size: int, save_unfull: bool) -> None:
    hasher = ChunkedTokenHasher(cfg(size, save_unfull))
    for n in sorted({0, 1, size - 1, size, size + 1, 5 * size + 7, 20 * size + 3}):
        tokens = [(i * 7919) % 151_000 for i in range(n)]
        assert list(hasher.process_tokens(tokens)) == reference(tokens, size, save_unfull)


@pytest.mark.property
@settings(deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31), max_size=300),
    size=st.integers(min_value=1, max_value=40),
    save_unfull=st.booleans(),
)
def test_matches_plain_recipe_property(tokens: list[int], size: int, save_unfull: bool) -> None:
    hasher = ChunkedTokenHasher(cfg(size, save_unfull))
    expected = reference(tokens, size, save_unfull)
    assert list(hasher.process_tokens(tokens)) == expected
    assert hasher.hashes_and_offsets(tokens) == (
        [h for *_, h in expected],
        [end - start for start, end, _ in expected],
    )


# --- input kinds ----------------------------------------------------------------------

TOKENS = [(i * 104_729) % 128_000 for i in range(1000)]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: torch.tensor(t, dtype=torch.int64), id="int64"),
        pytest.param(lambda t: torch.tensor(t, dtype=torch.int32), id="int32"),
        pytest.param(
            lambda t: torch.tensor(t, dtype=torch.int64).repeat_interleave(2)[::2], id="strided"
        ),
        pytest.param(tuple, id="tuple"),
        pytest.param(ConstantList, id="constant-list"),
    ],
)
@pytest.mark.parametrize("save_unfull", [False, True])
def test_other_inputs_hash_like_a_list(make: Callable[[list[int]], Any], save_unfull: bool) -> None:
    hasher = ChunkedTokenHasher(cfg(16, save_unfull))
    tokens = make(list(TOKENS))
    if isinstance(tokens, torch.Tensor):
        assert tokens.tolist() == TOKENS
    assert list(hasher.process_tokens(tokens)) == list(hasher.process_tokens(TOKENS))
    assert hasher.hashes_and_offsets(tokens) == hasher.hashes_and_offsets(TOKENS)


def test_non_contiguous_tensor() -> None:
    pairs = torch.tensor(TOKENS, dtype=torch.int64)
    base = torch.stack([pairs, pairs + 1], dim=1)[:, 0]
    assert not base.is_contiguous() and base.stride() == (2,)
    hasher = ChunkedTokenHasher(cfg(16, True))
    assert hasher.hashes_and_offsets(base) == hasher.hashes_and_offsets(TOKENS)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_small_integer_dtypes(dtype: torch.dtype) -> None:
    small = [t % 100 for t in TOKENS]
    hasher = ChunkedTokenHasher(cfg(16, True))
    assert hasher.hashes_and_offsets(torch.tensor(small, dtype=dtype)) == hasher.hashes_and_offsets(
        small
    )


@pytest.mark.parametrize(
    "empty", [[], (), torch.tensor([], dtype=torch.int64)], ids=["list", "tuple", "tensor"]
)
@pytest.mark.parametrize("save_unfull", [False, True])
def test_empty_input_yields_nothing(empty: Any, save_unfull: bool) -> None:
    hasher = ChunkedTokenHasher(cfg(256, save_unfull))
    assert list(hasher.process_tokens(empty)) == []
    assert hasher.hashes_and_offsets(empty) == ([], [])


@pytest.mark.parametrize(
    "bad",
    [
        None,
        "1 2 3",
        b"\x01\x02",
        {1, 2},
        {1: 2},
        42,
        [1.0, 2.0],
        ["1", "2"],
        [[1, 2], [3, 4]],
        [1, 2, None],
        torch.tensor([[1, 2], [3, 4]]),
        torch.tensor(7),
        torch.tensor([1.0, 2.0]),
        torch.tensor([True, False]),
    ],
    ids=repr,
)
def test_bad_tokens_raise_invalid_request(bad: Any) -> None:
    hasher = ChunkedTokenHasher()
    with pytest.raises(InvalidRequest, match=r"tokens|tensor"):
        hasher.hashes_and_offsets(bad)
    with pytest.raises(InvalidRequest):
        hasher.process_tokens(bad)  # raises at the call, not at the first next()


def test_make_key_is_an_engine_concern() -> None:
    with pytest.raises(NotImplementedError, match="make_key=True"):
        ChunkedTokenHasher().process_tokens([1, 2, 3], make_key=True)


# --- mask (spec 2.2 step 4) -----------------------------------------------------------


@pytest.mark.parametrize("as_tensor", [False, True])
def test_masked_prefix_is_chained_but_not_yielded(as_tensor: bool) -> None:
    hasher = ChunkedTokenHasher(cfg(16, True))
    tokens = TOKENS[:70]
    mask = [False] * 32 + [True] * 38
    got = list(hasher.process_tokens(tokens, mask=torch.tensor(mask) if as_tensor else mask))
    assert got == list(hasher.process_tokens(tokens))[2:]
    assert got[0][:2] == (32, 48)


def test_all_false_mask_yields_nothing() -> None:
    hasher = ChunkedTokenHasher(cfg(16, False))
    assert list(hasher.process_tokens(TOKENS[:32], mask=[False] * 32)) == []


def test_mask_false_count_must_be_a_multiple_of_chunk_size() -> None:
    hasher = ChunkedTokenHasher(cfg(16, True))
    with pytest.raises(ValueError, match="not a multiple of chunk_size=16"):
        hasher.process_tokens(TOKENS[:40], mask=torch.tensor([False] * 5 + [True] * 35))


@pytest.mark.parametrize("mask", [[True] * 39, "TTTT", 7], ids=["short", "str", "int"])
def test_bad_mask_raises_invalid_request(mask: Any) -> None:
    with pytest.raises(InvalidRequest, match="mask"):
        ChunkedTokenHasher(cfg(16, True)).process_tokens(TOKENS[:40], mask=mask)


# --- offsets and chunk counts ---------------------------------------------------------


@pytest.mark.parametrize(
    ("save_unfull", "n", "offsets"),
    [
        (True, 600, [256, 256, 88]),
        (False, 600, [256, 256]),
        (True, 512, [256, 256]),
        (False, 255, []),
        (True, 255, [255]),
    ],
)
def test_offsets_are_per_chunk_token_counts(save_unfull: bool, n: int, offsets: list[int]) -> None:
    hasher = ChunkedTokenHasher(cfg(256, save_unfull))
    hashes, got = hasher.hashes_and_offsets(list(range(n)))
    assert got == offsets
    assert len(hashes) == len(offsets) == hasher.num_chunks(n)


def test_num_chunks_rejects_negative() -> None:
    with pytest.raises(InvalidRequest):
        ChunkedTokenHasher().num_chunks(-1)


# --- fingerprint ----------------------------------------------------------------------


def test_fingerprint_describes_the_hashing() -> None:
    hasher = ChunkedTokenHasher(cfg(16, True))
    fp = hasher.fingerprint()
    assert fp == {
        "algorithm": "builtin",
        "chunk_size": 16,
        "save_unfull_chunk": True,
        "none_hash": 0,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "probe": hasher.hashes_and_offsets(list(range(2 * 16 + 3)))[0][-1],
    }
    fp["chunk_size"] = 1  # a copy: callers cannot corrupt the cached one
    assert hasher.fingerprint() == ChunkedTokenHasher(cfg(16, True)).fingerprint()
    assert hasher.fingerprint()["chunk_size"] == 16


def test_fingerprint_changes_with_the_settings() -> None:
    base = ChunkedTokenHasher(cfg(256, False)).fingerprint()
    other_size = ChunkedTokenHasher(cfg(128, False)).fingerprint()
    other_tail = ChunkedTokenHasher(cfg(256, True)).fingerprint()
    assert other_size != base and other_size["probe"] != base["probe"]
    assert other_tail != base and other_tail["probe"] != base["probe"]


def test_fingerprint_is_the_same_in_another_process() -> None:
    code = (
        "from types import SimpleNamespace as N\n"
        "from broker_lookup.protocol.hashing import ChunkedTokenHasher as H\n"
        "c = N(chunk_size=64, save_unfull_chunk=True, pre_caching_hash_algorithm='builtin')\n"
        "print(sorted(H(c).fingerprint().items()))"
    )
    out = _run_python(code, pythonpath=[REPO_ROOT], hash_seed="123")
    assert out.strip() == str(sorted(ChunkedTokenHasher(cfg(64, True)).fingerprint().items()))


# --- config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (cfg(0), "chunk_size"),
        (cfg(-256), "chunk_size"),
        (cfg("256"), "chunk_size"),
        (cfg(True), "chunk_size"),
        (
            SimpleNamespace(
                chunk_size=256, save_unfull_chunk="yes", pre_caching_hash_algorithm="builtin"
            ),
            "save_unfull_chunk",
        ),
        (
            SimpleNamespace(
                chunk_size=256, save_unfull_chunk=False, pre_caching_hash_algorithm=None
            ),
            "pre_caching_hash_algorithm",
        ),
    ],
)
def test_bad_config_raises_config_error_naming_the_field(
    config: SimpleNamespace, field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        ChunkedTokenHasher(config)


# --- digest normalisation and hash-function resolution --------------------------------


def test_normalize_hash() -> None:
    digest = bytes(range(32))
    assert normalize_hash(digest) == int.from_bytes(digest[:8], "big") == 0x0001020304050607
    assert normalize_hash(b"\xff" * 32) == 2**64 - 1
    assert normalize_hash(-5) == -5
    with pytest.raises(TypeError):
        normalize_hash("abc")


def _sha256_pickle(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value)).digest()


def _fake_modules(monkeypatch: pytest.MonkeyPatch, **modules: types.ModuleType) -> None:
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _fake_vllm_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    def get_hash_fn_by_name(name: str) -> Callable[[object], bytes]:
        if name == "sha256_cbor":
            return _sha256_pickle
        raise ValueError(name)

    hashing = types.ModuleType("vllm.utils.hashing")
    hashing.__dict__.update(get_hash_fn_by_name=get_hash_fn_by_name)
    _fake_modules(monkeypatch, vllm=types.ModuleType("vllm"), **{"vllm.utils.hashing": hashing})


@pytest.mark.parametrize("name", ["sha256_cbor", "sha256_cbor_64bit"])
def test_digest_algorithm_from_vllm(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _fake_vllm_hashing(monkeypatch)
    hasher = ChunkedTokenHasher(cfg(16, True, name))
    assert hasher.algorithm == "sha256_cbor"
    assert hasher.none_hash == 0  # this fake vLLM has no init_none_hash
    got = list(hasher.process_tokens(TOKENS[:40]))
    assert got == reference(TOKENS[:40], 16, True, fn=_sha256_pickle)
    assert all(0 <= h < 2**64 for *_, h in got)
    assert hasher.fingerprint()["algorithm"] == "sha256_cbor"


def test_older_vllm_exposes_the_function_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = types.ModuleType("vllm.utils")
    utils.__dict__.update(sha256=_sha256_pickle)
    _fake_modules(monkeypatch, vllm=types.ModuleType("vllm"), **{"vllm.utils": utils})
    assert ChunkedTokenHasher(cfg(16, True, "sha256")).algorithm == "sha256"


def test_unknown_algorithm_falls_back_to_builtin_like_lmcache(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_vllm_hashing(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="broker_lookup.protocol.hashing"):
        hasher = ChunkedTokenHasher(cfg(256, False, "no_such_hash"))
    assert hasher.algorithm == "builtin"
    assert "no_such_hash" in caplog.text
    assert list(hasher.process_tokens(list(range(600))))[1][2] == 8783757053568497755


def test_digest_algorithm_without_vllm_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="broker_lookup.protocol.hashing"):
        hasher = ChunkedTokenHasher(cfg(256, True, "sha256_cbor"))
    assert hasher.fingerprint()["algorithm"] == "builtin"
    assert "sha256_cbor" in caplog.text


# --- NONE_HASH (spec 2.1, defect D12) -------------------------------------------------


def _fake_kv_cache_utils(monkeypatch: pytest.MonkeyPatch, with_init: bool = True) -> None:
    kv = types.ModuleType("vllm.v1.core.kv_cache_utils")
    if with_init:

        def init_none_hash(hash_fn: object) -> None:  # LMCache calls this; we must not (D12)
            raise AssertionError("init_none_hash mutates vLLM's global and must not be called")

        kv.__dict__.update(init_none_hash=init_none_hash)
    _fake_modules(monkeypatch, **{"vllm.v1.core.kv_cache_utils": kv})


def test_none_hash_is_zero_without_vllm() -> None:
    assert _resolve_none_hash.__wrapped__(hash) == 0


def test_none_hash_is_zero_with_vllm_older_than_init_none_hash(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_kv_cache_utils(monkeypatch, with_init=False)
    assert _resolve_none_hash.__wrapped__(hash) == 0


def test_none_hash_with_vllm_and_a_seed_is_the_hashed_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_kv_cache_utils(monkeypatch)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert _resolve_none_hash.__wrapped__(hash) == hash("0")
    assert _resolve_none_hash.__wrapped__(_sha256_pickle) == normalize_hash(_sha256_pickle("0"))


def test_none_hash_with_vllm_and_no_seed_is_random_and_loud(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_kv_cache_utils(monkeypatch)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with caplog.at_level(logging.WARNING, logger="broker_lookup.protocol.hashing"):
        first = _resolve_none_hash.__wrapped__(hash)
    assert 0 <= first < 2**64
    assert "PYTHONHASHSEED" in caplog.text and "NEVER" in caplog.text
    assert _resolve_none_hash.__wrapped__(hash) != first  # per process; 2**-64 flake odds


@pytest.fixture
def fake_vllm_dir(tmp_path: Path) -> Path:
    core = tmp_path / "vllm" / "v1" / "core"
    core.mkdir(parents=True)
    for package in (tmp_path / "vllm", tmp_path / "vllm" / "v1", core):
        (package / "__init__.py").write_text("")
    (core / "kv_cache_utils.py").write_text(
        "NONE_HASH = None\n"
        "def init_none_hash(hash_fn):\n"
        "    raise AssertionError('must not be called (D12)')\n"
    )
    return tmp_path


def _run_python(code: str, pythonpath: list[Path], hash_seed: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(
    ("seed", "none_hash", "hashes"),
    [
        ("0", 5313149338359954478, [6847123751949154252, -782556766413655621]),
        ("1", -3509053104883717537, [5969386600972549206, 1724821308644191367]),
    ],
)
def test_vectors_with_vllm_present(
    fake_vllm_dir: Path, seed: str, none_hash: int, hashes: list[int]
) -> None:
    code = (
        "from broker_lookup.protocol.hashing import ChunkedTokenHasher as H; h = H();"
        "print(h.none_hash, h.hashes_and_offsets(list(range(512)))[0])"
    )
    out = _run_python(code, pythonpath=[fake_vllm_dir, REPO_ROOT], hash_seed=seed)
    assert out.split(maxsplit=1) == [str(none_hash), f"{hashes}\n"]
