"""LMCache-compatible chunk hashing: what the scheduler sends instead of tokens.

:class:`ChunkedTokenHasher` is bit-identical to LMCache 0.5.6
``ChunkedTokenDatabase.process_tokens(tokens, make_key=False)``: chunks of ``chunk_size``
tokens (the short tail only with ``save_unfull_chunk``) chained as
``h = hash_fn((h, tuple(chunk), ()))`` from ``NONE_HASH``. Workers build keys from these
ints, so every process must agree on :meth:`ChunkedTokenHasher.fingerprint`. Unlike
LMCache, resolving ``NONE_HASH`` mutates no global (LMCache defect D12).

For the builtin hash the chain is computed by the optional C extension
:mod:`broker_lookup.protocol._chunk_hash` (``_chunk_hash.c``, built by ``setup.py``),
3x (list) and 15x (int64 tensor) faster than the Python path from 8k tokens on: it
reproduces CPython's tuple and int hashes without building a tuple or an int per token.
The Python path stays and runs where the extension is not built, for any other
algorithm, for an input the extension does not take, and when
``BROKER_LOOKUP_PURE_HASHING=1`` is set (read at import). At import the extension is
checked against the Python path on a few probes; if any differs it is not used (a
warning says so). :data:`NATIVE_HASHING` tells which is active.
"""

from __future__ import annotations

import array
import functools
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Protocol, TypeAlias, Union, cast

from broker_lookup.errors import ConfigError, InvalidRequest

if TYPE_CHECKING:
    import torch

__all__ = [
    "NATIVE_HASHING",
    "PURE_HASHING_ENV",
    "ChunkedTokenHasher",
    "HashingConfig",
    "normalize_hash",
]

logger = logging.getLogger(__name__)

#: A sequence of ints (a list; vLLM passes a ``ConstantList``) or a 1-D integer tensor.
TokenInput: TypeAlias = Union[Sequence[int], "torch.Tensor"]
HashFn: TypeAlias = Callable[[object], object]
#: ``_chunk_hash.chain(tokens, chunk_size, end, hash(NONE_HASH), hash(()))``.
NativeChain: TypeAlias = Callable[[object, int, int, int, int], list[int]]

#: LMCache's behaviour when it is given no config.
_NO_CONFIG = SimpleNamespace(
    chunk_size=256, save_unfull_chunk=True, pre_caching_hash_algorithm="builtin"
)
#: Names LMCache treats as one algorithm (vLLM PR#23673 renamed the 64-bit variant).
_ALIASES = dict.fromkeys(("sha256_cbor", "sha256_cbor_64bit"), ("sha256_cbor", "sha256_cbor_64bit"))
#: Prompts of at least this many chunks take the zip path in ``_chain``: below, its fixed
#: cost (an iterator slot per token of a chunk) outweighs what it saves per token.
_ZIP_MIN_CHUNKS = 16
#: Where vLLM keeps its hash functions, newest first, searched in LMCache's order.
_VLLM_HASH_MODULES = ("vllm.utils.hashing", "vllm.utils")
#: Set to ``1`` to hash in Python even where the C extension is built (read at import).
PURE_HASHING_ENV = "BROKER_LOOKUP_PURE_HASHING"
#: LMCache's extra_keys (none) and their hash, the third lane of every chunk's 3-tuple.
_EMPTY: tuple[()] = ()
_EMPTY_LANE = hash(_EMPTY)


class HashingConfig(Protocol):
    """The settings hashing depends on; ``LookupConfig`` and LMCache's config have them."""

    @property
    def chunk_size(self) -> int: ...
    @property
    def save_unfull_chunk(self) -> bool: ...
    @property
    def pre_caching_hash_algorithm(self) -> str: ...


def normalize_hash(raw: object) -> int:
    """Fold a hash result into LMCache's int form; an int passes unchanged.

    A digest (``bytes``, e.g. from vLLM ``sha256_cbor``) becomes its first 8 bytes read
    big-endian, an unsigned 64-bit int.
    """
    if isinstance(raw, bytes):
        return int.from_bytes(raw[:8], "big")
    if isinstance(raw, int):
        return raw
    raise TypeError(f"hash function returned {type(raw).__name__}, expected int or bytes")


def _import_optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except (ImportError, AttributeError):  # what LMCache takes for "no vLLM (or too old)"
        return None


def _resolve_hash_fn(algorithm: str) -> tuple[str, HashFn]:
    """Find ``algorithm`` where LMCache 0.5.6 looks; returns (resolved name, function)."""
    if algorithm == "builtin":  # not a vLLM name: LMCache ends up with Python's hash
        return "builtin", hash
    names = _ALIASES.get(algorithm, (algorithm,))
    modules = [m for m in map(_import_optional, _VLLM_HASH_MODULES) if m is not None]
    for module in modules:
        for name in names if hasattr(module, "get_hash_fn_by_name") else ():
            try:
                return name, module.get_hash_fn_by_name(name)
            except ValueError:
                continue
    for module in modules:  # older vLLM: the functions themselves
        for name in names:
            if callable(fn := getattr(module, name, None)):
                return name, fn
    msg = "pre_caching_hash_algorithm=%r unavailable (no vLLM): builtin hash, as LMCache uses"
    logger.warning(msg, algorithm)
    return "builtin", hash


@functools.lru_cache(maxsize=16)
def _resolve_none_hash(hash_fn: HashFn) -> int:
    """The NONE_HASH LMCache would use with ``hash_fn``; computed, no global touched.

    LMCache runs vLLM's ``init_none_hash`` when it exists: ``hash_fn(PYTHONHASHSEED)``, or
    random bytes with no seed (the cache keeps that one value per process).
    """
    kv_cache_utils = _import_optional("vllm.v1.core.kv_cache_utils")
    if kv_cache_utils is None or not hasattr(kv_cache_utils, "init_none_hash"):
        return 0
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        logger.warning(
            "vLLM is installed and PYTHONHASHSEED is unset: NONE_HASH is random in every "
            "process, so scheduler and worker chunk hashes will NEVER match (0%% hits). "
            "Set the same PYTHONHASHSEED (e.g. 0) for the scheduler and every worker."
        )
        return int.from_bytes(os.urandom(8), "big")
    return normalize_hash(hash_fn(seed))


def _tensor_as_sequence(tokens: torch.Tensor, bool_dtype: object) -> Sequence[int]:
    if tokens.dim() != 1:
        raise InvalidRequest(f"token tensor must be 1-D, got shape {tuple(tokens.shape)}")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == bool_dtype:
        raise InvalidRequest(f"token tensor must have an integer dtype, got {tokens.dtype}")
    tokens = tokens.cpu()  # a no-op on CPU
    try:
        # A memoryview makes ints on demand, freed chunk by chunk: faster than tolist().
        return tokens.numpy().data
    except (RuntimeError, TypeError, ValueError):  # no numpy, or a dtype it cannot hold
        return cast("list[int]", tokens.tolist())


def _as_sequence(tokens: object) -> Sequence[int]:
    """Validate ``tokens``; return a sequence of ints that can be sliced and iterated."""
    kind = type(tokens)
    if kind is not list and kind is not tuple:
        torch = sys.modules.get("torch")  # no tensor can exist unless torch is imported
        if torch is not None and isinstance(tokens, torch.Tensor):
            return _tensor_as_sequence(tokens, torch.bool)
        if not isinstance(tokens, Sequence) or isinstance(tokens, (str, bytes, bytearray)):
            raise InvalidRequest(
                f"tokens must be ints in a list or a 1-D tensor, not {kind.__name__}"
            )
    seq: Sequence[object] = tokens  # type: ignore[assignment]  # narrowed above
    # The ends catch the usual mistakes (nested lists, strings, floats) at no per-token cost.
    if seq and not all(type(x) is int or isinstance(x, Integral) for x in (seq[0], seq[-1])):
        got = f"{type(seq[0]).__name__} ... {type(seq[-1]).__name__}"
        raise InvalidRequest(f"tokens must be ints, got {got}")
    return seq  # type: ignore[return-value]  # elements checked above


def _count_false(mask: object, n_tokens: int) -> int:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(mask, torch.Tensor):
        mask = mask.tolist()
    if not isinstance(mask, (list, tuple)) or len(mask) != n_tokens:
        raise InvalidRequest(f"mask must be {n_tokens} bools (list, tuple or 1-D tensor)")
    return mask.count(False)  # also counts 0, like LMCache's sum of the mask


def _python_chain(
    seq: Sequence[int], size: int, save_unfull: bool, none_hash: int, fn: HashFn
) -> list[int]:
    """The chain in Python: any hash function, any input (the extension's reference)."""
    total = len(seq)
    chain = none_hash
    end = total if save_unfull else total - total % size
    out: list[int] = []
    append = out.append  # bound once: this loop runs per chunk of every prompt
    empty = _EMPTY  # LMCache's extra_keys: none
    if fn is not hash:
        for start in range(0, end, size):
            chain = normalize_hash(fn((chain, tuple(seq[start : start + size]), empty)))
            append(chain)
        return out
    if total < _ZIP_MIN_CHUNKS * size:
        for start in range(0, end, size):  # builtin hash: an int, nothing to normalize
            chain = hash((chain, tuple(seq[start : start + size]), empty))
            append(chain)
        return out
    # zip over one shared iterator builds each full chunk's tuple in C; dropping our
    # reference lets zip recycle that tuple instead of allocating one per chunk.
    for chunk in zip(*[iter(seq)] * size, strict=False):
        chain = hash((chain, chunk, empty))
        append(chain)
        del chunk
    if end % size:
        append(hash((chain, tuple(seq[end - end % size :]), empty)))
    return out


def _native_probes() -> Iterator[tuple[object, list[int], int, bool, int]]:
    """(what the extension gets, the same ints as a list, chunk size, tail kept, NONE_HASH):
    no chunk, one, a tail, the zip path, negative and huge ints, int64 ends of range."""
    near = [2**63 - 1, -(2**63), 2**61 - 1, 2**61, -(2**61) + 1, -1, -2, 0, 1, 2**62]
    lists = [
        ([], 4, True, 0),
        ([7], 4, True, 0),
        ([7], 4, False, 0),
        (list(range(10)), 4, True, 2**64 - 1),
        (list(range(-60, 60)), 3, True, -5),  # 40 chunks: the zip path
        ([-1, -2, 2**63, -(2**63), 2**70, 2**61 - 1, 2**61], 3, True, 2**63),
    ]
    for tokens, size, save_unfull, none_hash in lists:
        yield tokens, tokens, size, save_unfull, none_hash
    int64s = near * 7  # 70 values: 23 chunks of 3, the zip path, and a tail
    yield array.array("q", int64s), int64s, 3, True, 12345
    yield memoryview(array.array("q", int64s)), int64s, 256, True, 0  # one short chunk
    yield array.array("B", range(256)), list(range(256)), 16, False, 2**64 - 1


def _load_native() -> NativeChain | None:
    """The extension's ``chain`` if it is built, allowed and agrees with the Python path."""
    if os.environ.get(PURE_HASHING_ENV) == "1":
        return None
    try:
        from broker_lookup.protocol import _chunk_hash
    except ImportError:  # not built (no compiler when installed): the Python path
        return None
    for given, tokens, size, save_unfull, none_hash in _native_probes():
        total = len(tokens)
        end = total if save_unfull else total - total % size
        expected = _python_chain(tokens, size, save_unfull, none_hash, hash)
        try:
            agrees = _chunk_hash.chain(given, size, end, hash(none_hash), _EMPTY_LANE) == expected
        except Exception:  # an extension that cannot hash a probe is not used either
            agrees = False
        if not agrees:
            logger.warning(
                "C chunk hashing disagrees with Python (%d tokens, chunk_size=%d): hashing in "
                "Python (several times slower). Rebuild the package: pip install -e .",
                total,
                size,
            )
            return None
    return _chunk_hash.chain


_native_chain = _load_native()
#: True when the C extension hashes builtin-hash chunks (built, checked, not disabled).
NATIVE_HASHING: bool = _native_chain is not None


class ChunkedTokenHasher:
    """Hashes token chunks exactly as LMCache 0.5.6 ``ChunkedTokenDatabase`` does.

    Args:
        config: has ``chunk_size``, ``save_unfull_chunk``, ``pre_caching_hash_algorithm``;
            ``None`` is LMCache's no-config behaviour (256, tail kept, builtin).

    Raises:
        ConfigError: a setting has the wrong type or ``chunk_size`` is not positive.
    """

    def __init__(self, config: HashingConfig | None = None) -> None:
        c = _NO_CONFIG if config is None else config
        size = c.chunk_size
        unfull = c.save_unfull_chunk
        algorithm = c.pre_caching_hash_algorithm
        if type(size) is not int or size <= 0:
            raise ConfigError(f"chunk_size={size!r} is invalid: use a positive int")
        if not isinstance(unfull, bool):
            raise ConfigError(f"save_unfull_chunk={unfull!r} is invalid: use a bool")
        if not isinstance(algorithm, str):
            raise ConfigError(f"pre_caching_hash_algorithm={algorithm!r} is invalid: use a str")
        self.chunk_size: int = size
        self.save_unfull_chunk: bool = unfull
        self.algorithm, self._hash_fn = _resolve_hash_fn(algorithm)
        self.none_hash: int = _resolve_none_hash(self._hash_fn)
        #: Whether the C extension hashes for this hasher: only for Python's own hash.
        self.native: bool = NATIVE_HASHING and self._hash_fn is hash
        self._fingerprint: dict[str, str | int | bool] | None = None

    def num_chunks(self, n_tokens: int) -> int:
        """Return how many chunk hashes a prompt of ``n_tokens`` tokens produces."""
        if n_tokens < 0:
            raise InvalidRequest(f"n_tokens={n_tokens} is negative")
        full, rest = divmod(n_tokens, self.chunk_size)
        return full + (1 if rest and self.save_unfull_chunk else 0)

    def hashes_and_offsets(self, tokens: TokenInput) -> tuple[list[int], list[int]]:
        """Hash a prompt for a lookup request (the scheduler's fast path).

        Returns:
            The chained hash of each chunk and each chunk's token count (``end - start``,
            not cumulative), as LMCache's lookup clients send them.

        Raises:
            InvalidRequest: ``tokens`` is neither a sequence of ints nor a 1-D int tensor.
        """
        seq = _as_sequence(tokens)
        hashes = self._chain(seq)
        offsets = [self.chunk_size] * len(hashes)
        if hashes and self.save_unfull_chunk and len(seq) % self.chunk_size:
            offsets[-1] = len(seq) % self.chunk_size
        return hashes, offsets

    def process_tokens(
        self, tokens: TokenInput, mask: object = None, make_key: bool = False
    ) -> Iterator[tuple[int, int, int]]:
        """Return ``(start, end, hash)`` per chunk, as LMCache's ``make_key=False`` path.

        Args:
            tokens: the prompt's token ids.
            mask: optional bools, one per token, False for a handled prefix whose length
                must be a multiple of ``chunk_size``: chained but not returned.
            make_key: must be False: cache-engine keys are the worker engine's business.

        Raises:
            InvalidRequest: bad ``tokens`` or ``mask`` (a ``ValueError``, like LMCache's).
            NotImplementedError: ``make_key`` is True.
        """
        if make_key:  # a key embeds model, rank and dtype: only the worker's engine knows them
            raise NotImplementedError("make_key=True: the worker's engine builds the keys")
        seq = _as_sequence(tokens)
        size = self.chunk_size
        total = len(seq)
        skip = 0 if mask is None else _count_false(mask, total)
        if skip % size:
            raise InvalidRequest(f"mask has {skip} False: not a multiple of chunk_size={size}")
        starts = range(0, size * self.num_chunks(total), size)
        chunks = zip(starts, self._chain(seq), strict=True)
        return ((start, min(start + size, total), h) for start, h in chunks if start >= skip)

    def _chain(self, seq: Sequence[int]) -> list[int]:
        size = self.chunk_size
        save_unfull = self.save_unfull_chunk
        if self.native and _native_chain is not None:
            total = len(seq)
            end = total if save_unfull else total - total % size
            try:
                return _native_chain(seq, size, end, hash(self.none_hash), _EMPTY_LANE)
            except TypeError:  # an input the extension does not take: Python hashes it
                pass
        return _python_chain(seq, size, save_unfull, self.none_hash, self._hash_fn)

    def fingerprint(self) -> dict[str, str | int | bool]:
        """Describe what the hashes depend on: equal fingerprints hash identically.

        ``probe``, the last hash of ``range(2 * chunk_size + 3)``, catches what the names
        cannot (another interpreter, another vLLM hash function).
        """
        if self._fingerprint is None:
            self._fingerprint = {
                "algorithm": self.algorithm,
                "chunk_size": self.chunk_size,
                "save_unfull_chunk": self.save_unfull_chunk,
                "none_hash": self.none_hash,
                "python": f"{sys.version_info.major}.{sys.version_info.minor}",
                "probe": self._chain(range(2 * self.chunk_size + 3))[-1],
            }
        return dict(self._fingerprint)
