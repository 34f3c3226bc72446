"""The C chunk hasher (``_chunk_hash.c``) against the Python path and the plain recipe.

Every property checks three ways to the same ints: the extension's ``chain``, the Python
path (``_python_chain``) and the literal definition ``hash((chain, tuple(chunk), ()))``;
and that :class:`ChunkedTokenHasher` (which picks the extension) gives them. Without the
extension built these skip, except under ``CI``, which must build it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from broker_lookup import protocol
from broker_lookup.protocol import hashing
from broker_lookup.protocol.hashing import ChunkedTokenHasher, _load_native, _python_chain

REPO_ROOT = Path(__file__).resolve().parents[2]
EMPTY_LANE = hash(())
#: Where the int hash reduces (2**61 - 1) and where int64 ends: the values the C code
#: must get right beyond "small ids hash to themselves".
EDGES = [
    0,
    1,
    -1,
    -2,
    2**61 - 2,
    2**61 - 1,
    2**61,
    -(2**61) + 1,
    -(2**61),
    -(2**61) - 1,
    2**62,
    2**63 - 1,
    -(2**63),
    2**63,
    2**64 - 1,
    2**64,
    2**70,
    -(2**70),
]
INT64_DTYPES = [np.int64, np.int32, np.uint8, np.int8, np.int16, np.uint16, np.uint32, np.uint64]


def _extension() -> ModuleType | None:
    try:
        from broker_lookup.protocol import _chunk_hash
    except ImportError:
        return None
    return _chunk_hash


@pytest.fixture(scope="module")
def native() -> ModuleType:
    module = _extension()
    if module is None:
        pytest.skip("the C extension _chunk_hash is not built (pip install -e . builds it)")
    return module


def cfg(size: int, save_unfull: bool) -> SimpleNamespace:
    return SimpleNamespace(
        chunk_size=size, save_unfull_chunk=save_unfull, pre_caching_hash_algorithm="builtin"
    )


def literal(tokens: Sequence[int], size: int, save_unfull: bool, none_hash: int) -> list[int]:
    """The definition, as plainly as it can be written."""
    total = len(tokens)
    end = total if save_unfull else total - total % size
    chain = none_hash
    out = []
    for start in range(0, end, size):
        chain = hash((chain, tuple(tokens[start : min(start + size, end)]), ()))
        out.append(chain)
    return out


def assert_all_agree(
    native: ModuleType,
    given_tokens: Any,
    as_ints: list[int],
    size: int,
    save_unfull: bool,
    none_hash: int,
) -> None:
    """Extension, Python path, definition and hasher agree on ``given_tokens``."""
    total = len(as_ints)
    end = total if save_unfull else total - total % size
    expected = literal(as_ints, size, save_unfull, none_hash)
    assert _python_chain(as_ints, size, save_unfull, none_hash, hash) == expected
    # What the hasher hands the extension: a tensor as its numpy view's memoryview.
    native_input = (
        given_tokens.numpy().data if isinstance(given_tokens, torch.Tensor) else given_tokens
    )
    assert native.chain(native_input, size, end, hash(none_hash), EMPTY_LANE) == expected
    hasher = ChunkedTokenHasher(cfg(size, save_unfull))
    hasher.none_hash = none_hash
    assert hasher.hashes_and_offsets(given_tokens)[0] == expected


# --- the extension is there, and used -------------------------------------------------


def test_extension_is_built_under_ci() -> None:
    if _extension() is None:
        if os.environ.get("CI"):
            pytest.fail("CI must build the C extension _chunk_hash (pip install -e .)")
        pytest.skip("the C extension _chunk_hash is not built")
    if os.environ.get(hashing.PURE_HASHING_ENV) != "1":
        assert hashing.NATIVE_HASHING, "built, but failed its self-check at import"


def test_builtin_hashers_use_it_and_others_do_not(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashing, "NATIVE_HASHING", True)
    assert ChunkedTokenHasher().native
    vllm_hashing = ModuleType("vllm.utils.hashing")
    vllm_hashing.__dict__["get_hash_fn_by_name"] = lambda name: lambda value: b"\x01" * 32
    monkeypatch.setitem(sys.modules, "vllm", ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.utils.hashing", vllm_hashing)
    digest = ChunkedTokenHasher(
        SimpleNamespace(
            chunk_size=4, save_unfull_chunk=True, pre_caching_hash_algorithm="sha256_cbor"
        )
    )
    assert not digest.native
    assert digest.hashes_and_offsets([1, 2, 3, 4, 5])[0] == [int.from_bytes(b"\x01" * 8, "big")] * 2


# --- properties -------------------------------------------------------------------------

ints = st.one_of(
    st.integers(min_value=0, max_value=200_000),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(EDGES),
)
sizes = st.integers(min_value=1, max_value=300)
none_hashes = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from(EDGES),
)


@pytest.mark.property
@settings(deadline=None)
@given(
    tokens=st.lists(ints, max_size=800),
    size=sizes,
    save_unfull=st.booleans(),
    none_hash=none_hashes,
    as_tuple=st.booleans(),
)
def test_lists_of_any_ints(
    native: ModuleType,
    tokens: list[int],
    size: int,
    save_unfull: bool,
    none_hash: int,
    as_tuple: bool,
) -> None:
    assert_all_agree(
        native, tuple(tokens) if as_tuple else tokens, tokens, size, save_unfull, none_hash
    )


@pytest.mark.property
@settings(deadline=None)
@given(
    tokens=st.lists(ints, min_size=200, max_size=1500),
    size=st.integers(min_value=1, max_value=12),
    save_unfull=st.booleans(),
    none_hash=none_hashes,
)
def test_many_small_chunks(
    native: ModuleType, tokens: list[int], size: int, save_unfull: bool, none_hash: int
) -> None:
    # Many chunks: the interleaved groups of chunks, their remainder and the tail.
    assert_all_agree(native, tokens, tokens, size, save_unfull, none_hash)


@st.composite
def int_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(INT64_DTYPES)))
    info = np.iinfo(dtype)
    in_range = [e for e in EDGES if info.min <= e <= info.max]
    elements = st.one_of(st.integers(int(info.min), int(info.max)), st.sampled_from(in_range))
    return draw(hnp.arrays(dtype, st.integers(min_value=0, max_value=1000), elements=elements))


@pytest.mark.property
@settings(deadline=None)
@given(
    array=int_arrays(),
    size=sizes,
    save_unfull=st.booleans(),
    none_hash=none_hashes,
    as_memoryview=st.booleans(),
)
def test_numpy_integer_buffers_full_range(
    native: ModuleType,
    array: np.ndarray[Any, Any],
    size: int,
    save_unfull: bool,
    none_hash: int,
    as_memoryview: bool,
) -> None:
    given_tokens = array.data if as_memoryview else array
    total = len(array)
    end = total if save_unfull else total - total % size
    expected = literal(array.tolist(), size, save_unfull, none_hash)
    assert _python_chain(array.tolist(), size, save_unfull, none_hash, hash) == expected
    assert native.chain(given_tokens, size, end, hash(none_hash), EMPTY_LANE) == expected


@pytest.mark.property
@settings(deadline=None)
@given(
    values=st.lists(st.integers(-(2**63), 2**63 - 1) | st.sampled_from(EDGES[:13]), max_size=900),
    dtype=st.sampled_from([torch.int64, torch.int32]),
    size=sizes,
    save_unfull=st.booleans(),
    none_hash=none_hashes,
    strided=st.booleans(),
)
def test_torch_tensors_full_range(
    native: ModuleType,
    values: list[int],
    dtype: torch.dtype,
    size: int,
    save_unfull: bool,
    none_hash: int,
    strided: bool,
) -> None:
    if dtype == torch.int32:
        values = [(v + 2**31) % 2**32 - 2**31 for v in values]
    tensor = torch.tensor(values, dtype=dtype)
    if strided:  # a non-contiguous view: the extension follows the buffer's stride
        tensor = tensor.repeat_interleave(2)[::2]
    assert tensor.tolist() == values
    assert_all_agree(native, tensor, values, size, save_unfull, none_hash)


# --- edges and errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "empty",
    [[], (), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64).data, range(0)],
    ids=["list", "tuple", "ndarray", "memoryview", "range"],
)
def test_empty_input(native: ModuleType, empty: Any) -> None:
    assert native.chain(empty, 256, 0, hash(0), EMPTY_LANE) == []


@pytest.mark.parametrize("end", [0, 1, 5, 9])
@pytest.mark.parametrize("size", [1, 4, 9, 10, 1000, 2**40])
def test_end_and_chunk_size_beyond_the_tokens(native: ModuleType, end: int, size: int) -> None:
    tokens = [3, -1, 2**63 - 1, 0, 5, 6, 7, 8, 9]
    expected = literal(tokens[:end], size, True, 0)
    assert native.chain(tokens, size, end, hash(0), EMPTY_LANE) == expected
    array = np.array(tokens, dtype=np.int64)
    assert native.chain(array.data, size, end, hash(0), EMPTY_LANE) == expected


def test_other_sequences_and_strides(native: ModuleType) -> None:
    tokens = list(range(-50, 150))
    expected = literal(tokens, 7, True, 0)
    reversed_view = np.array(tokens[::-1], dtype=np.int64)[::-1]
    assert reversed_view.strides == (-8,)
    for given_tokens in (range(-50, 150), reversed_view, reversed_view.data):
        assert native.chain(given_tokens, 7, len(tokens), hash(0), EMPTY_LANE) == expected


@pytest.mark.parametrize(
    "bad",
    [
        None,
        42,
        {1, 2},
        np.zeros(4).data,
        np.zeros((2, 2), dtype=np.int64).data,
        np.array([True, False]).data,
        np.zeros(4, dtype=">i8"),
    ],
    ids=["none", "int", "set", "float64", "2-d", "bool", "big-endian"],
)
def test_what_it_does_not_take_is_a_type_error(native: ModuleType, bad: Any) -> None:
    with pytest.raises(TypeError):
        native.chain(bad, 2, 0, hash(0), EMPTY_LANE)


def test_bad_arguments_are_value_errors(native: ModuleType) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        native.chain([1, 2], 0, 2, 0, 0)
    with pytest.raises(ValueError, match="end"):
        native.chain([1, 2], 2, -1, 0, 0)
    with pytest.raises(ValueError, match="end"):
        native.chain([1, 2], 2, 3, 0, 0)
    with pytest.raises(ValueError, match="end"):
        native.chain(np.zeros(2, dtype=np.int64), 2, 3, 0, 0)


def test_items_hash_as_python_hashes_them(native: ModuleType) -> None:
    class Token(int):
        def __hash__(self) -> int:
            return 12345

    tokens: list[Any] = [True, Token(5), np.int64(-7), 2**80, -1]
    assert native.chain(tokens, 2, 5, hash(0), EMPTY_LANE) == literal(tokens, 2, True, 0)
    with pytest.raises(TypeError, match="unhashable"):
        native.chain([1, [2], 3], 2, 3, hash(0), EMPTY_LANE)


def test_a_list_shrinking_while_hashed_raises(native: ModuleType) -> None:
    tokens: list[Any] = []

    class Shrinker:
        def __hash__(self) -> int:
            tokens.clear()
            return 1

    tokens.extend([1, Shrinker(), 3, 4, 5])
    with pytest.raises(RuntimeError, match="changed size"):
        native.chain(tokens, 2, 5, hash(0), EMPTY_LANE)


def test_threads_hash_big_buffers_at_once(native: ModuleType) -> None:
    # Buffers this size are hashed with the GIL released.
    arrays = [np.arange(i, i + 40_000, dtype=np.int64) * 104_729 for i in range(4)]
    expected = [literal(a.tolist(), 256, True, 0) for a in arrays]
    got: list[list[int]] = [[] for _ in arrays]

    def run(i: int) -> None:
        for _ in range(5):
            got[i] = native.chain(arrays[i].data, 256, 40_000, hash(0), EMPTY_LANE)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(arrays))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected


# --- the self-check and the switch ------------------------------------------------------


def test_self_check_rejects_a_wrong_extension(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(hashing.PURE_HASHING_ENV, raising=False)
    assert _load_native() is native.chain

    def off_by_one(tokens: object, size: int, end: int, first: int, empty: int) -> list[int]:
        return [h + 1 for h in native.chain(tokens, size, end, first, empty)]

    monkeypatch.setattr(native, "chain", off_by_one)
    with caplog.at_level(logging.WARNING, logger="broker_lookup.protocol.hashing"):
        assert _load_native() is None
    assert "disagrees with Python" in caplog.text


def test_self_check_rejects_an_extension_that_raises(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> list[int]:
        raise TypeError("no")

    monkeypatch.delenv(hashing.PURE_HASHING_ENV, raising=False)
    monkeypatch.setattr(native, "chain", broken)
    assert _load_native() is None


def test_missing_extension_means_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hashing.PURE_HASHING_ENV, raising=False)
    # Neither the package's attribute nor an importable module: as if never built.
    monkeypatch.delattr(protocol, "_chunk_hash", raising=False)
    monkeypatch.setitem(sys.modules, "broker_lookup.protocol._chunk_hash", None)
    assert _load_native() is None


def test_env_var_forces_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hashing.PURE_HASHING_ENV, "1")
    assert _load_native() is None


@pytest.mark.parametrize("pure", ["1", None])
def test_env_var_in_a_fresh_process(pure: str | None) -> None:
    code = (
        "import torch\n"
        "from broker_lookup.protocol import hashing as h\n"
        "x = h.ChunkedTokenHasher()\n"
        "t = [(i * 7919) % 151_000 for i in range(5000)]\n"
        "print(h.NATIVE_HASHING, x.native, x.hashes_and_offsets(t)[0][-1],"
        " x.hashes_and_offsets(torch.tensor(t))[0][-1])"
    )
    env = {k: v for k, v in os.environ.items() if k != hashing.PURE_HASHING_ENV}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if pure is not None:
        env[hashing.PURE_HASHING_ENV] = pure
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    native_on, uses, last_list, last_tensor = done.stdout.split()
    tokens = [(i * 7919) % 151_000 for i in range(5000)]
    expected = str(literal(tokens, 256, True, 0)[-1])
    assert (last_list, last_tensor) == (expected, expected)
    active = pure is None and _extension() is not None
    assert (native_on, uses) == (str(active), str(active))
