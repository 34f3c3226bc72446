"""Tiered chunk storage behind :class:`workers.reference.engine.ReferenceEngine`.

Two inclusive LRU tiers keyed by :data:`ChunkKey` (memory tensors, optional disk files):
a chunk loaded from disk keeps its file, so demoting it again costs no write. Pins are
counted per chunk and recorded per owner (a lookup id); pinned chunks are never evicted.
A file is a 16-byte header (magic, rows, cols, CRC-32) + raw float16 bytes: no pickle.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["ChunkKey", "ChunkLoadError", "ChunkStore", "Tier", "chunk_payload", "make_tags"]

logger = logging.getLogger(__name__)

Tags = tuple[tuple[str, str], ...]
#: ``(chunk_hash, tags)``: the rank-local identity of a chunk, as LMCache's ``CacheEngineKey``.
ChunkKey = tuple[int, Tags]
Tier = Literal["memory", "disk"]

#: Request-config keys with this prefix become key tags (tenant isolation, as in LMCache).
TAG_PREFIX = "lmcache.tag."
#: Every payload is float16, so a file needs no dtype field.
PAYLOAD_DTYPE = torch.float16
_HEADER = struct.Struct("<4sIII")  # magic, rows, cols, crc32(body)
_MAGIC = b"BLKV"
_SUFFIX = ".kv"
_HASH_MASK = 0xFFFF_FFFF_FFFF_FFFF


class ChunkLoadError(Exception):
    """A disk chunk could not be read or failed verification (missing, truncated, corrupt)."""


def make_tags(request_configs: Mapping[str, Any] | None) -> Tags:
    """Return the key tags of ``request_configs``: ``lmcache.tag.*`` entries, in dict order."""
    if not request_configs:
        return ()
    n = len(TAG_PREFIX)
    return tuple((k[n:], str(v)) for k, v in request_configs.items() if k.startswith(TAG_PREFIX))


def chunk_payload(chunk_hash: int, num_tokens: int, kv_width: int) -> torch.Tensor:
    """Return the deterministic stand-in KV data of a chunk: ``(num_tokens, kv_width)`` float16."""
    gen = torch.Generator().manual_seed(chunk_hash & _HASH_MASK)
    return torch.rand((num_tokens, kv_width), generator=gen).to(PAYLOAD_DTYPE)


def encode_chunk(tensor: torch.Tensor) -> bytes:
    """Serialise a 2-D chunk tensor as header + raw float16 bytes."""
    flat = tensor.detach().to(device="cpu", dtype=PAYLOAD_DTYPE).contiguous()
    rows, cols = flat.shape
    # torch tensors have no buffer protocol and numpy is not a dependency: copy the
    # bytes straight out of the contiguous storage, which `flat` keeps alive here.
    body = ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())
    return _HEADER.pack(_MAGIC, rows, cols, zlib.crc32(body)) + body


def decode_chunk(data: bytes, rows: int, cols: int) -> torch.Tensor:
    """Parse :func:`encode_chunk` output, checking magic, expected shape, length and CRC."""
    if len(data) < _HEADER.size:
        raise ChunkLoadError(f"truncated header ({len(data)} bytes)")
    magic, got_rows, got_cols, crc = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if magic != _MAGIC:
        raise ChunkLoadError(f"bad magic {magic!r}")
    if (got_rows, got_cols) != (rows, cols):
        raise ChunkLoadError(f"shape ({got_rows}, {got_cols}) != expected ({rows}, {cols})")
    if len(body) != rows * cols * PAYLOAD_DTYPE.itemsize:
        raise ChunkLoadError(f"body is {len(body)} bytes, expected {rows * cols * 2}")
    if zlib.crc32(body) != crc:
        raise ChunkLoadError("CRC mismatch")
    return torch.frombuffer(bytearray(body), dtype=PAYLOAD_DTYPE).reshape(rows, cols)


class ChunkStore:
    """Thread-safe two-tier LRU chunk store with per-owner pins.

    One lock guards all state; file I/O happens outside it (decide under the
    lock, do the I/O, then re-check under the lock).

    Example::

        store = ChunkStore(memory_capacity=2, disk_dir=None, disk_capacity=1)
        store.put((42, ()), chunk_payload(42, 256, 8), "memory")
        store.pin_if_in_memory((42, ()), owner="req-1")  # True
        store.release("req-1")                           # 1 pin released
    """

    def __init__(
        self, memory_capacity: int, disk_dir: str | Path | None, disk_capacity: int
    ) -> None:
        self._lock = threading.Lock()
        self._memory_capacity = memory_capacity
        self._disk_capacity = disk_capacity
        self._disk_dir = None if disk_dir is None else Path(disk_dir)
        self._memory: OrderedDict[ChunkKey, torch.Tensor] = OrderedDict()
        self._disk: OrderedDict[ChunkKey, Path] = OrderedDict()
        self._pins: dict[ChunkKey, int] = {}
        # owner -> (monotonic time of its first pin, keys pinned, one entry per pin);
        # insertion order is age order, so expiry stops at the first young owner.
        self._owners: OrderedDict[str, tuple[float, list[ChunkKey]]] = OrderedDict()
        self._seq = itertools.count()
        self._counters = dict.fromkeys(("demotions", "memory_evictions", "disk_evictions"), 0)
        self.has_disk = self._disk_dir is not None
        if self._disk_dir is not None:
            self._prepare_dir(self._disk_dir)

    def put(self, key: ChunkKey, tensor: torch.Tensor, tier: Tier) -> bool:
        """Store a chunk in ``tier``; False if there was no room (all pinned) or an I/O error."""
        if tier == "disk":
            return self._write_disk(key, tensor)
        return self.put_memory(key, tensor, owner=None)

    def put_memory(self, key: ChunkKey, tensor: torch.Tensor, owner: str | None) -> bool:
        """Insert (or touch) a memory chunk, pinning it for ``owner``; False if all is pinned."""
        victims: list[tuple[ChunkKey, torch.Tensor]] = []
        with self._lock:
            if key not in self._memory:
                room = self._make_room_locked()
                if room is None:
                    return False
                victims = room
                self._memory[key] = tensor
            self._memory.move_to_end(key)
            if owner is not None:
                self._pin_locked(key, owner)
        for victim_key, victim in victims:
            self._write_disk(victim_key, victim)
        return True

    def pin_if_in_memory(self, key: ChunkKey, owner: str | None) -> bool:
        """If ``key`` is in memory: touch it, pin it for ``owner`` (if given), return True."""
        with self._lock:
            if key not in self._memory:
                return False
            self._memory.move_to_end(key)
            if owner is not None:
                self._pin_locked(key, owner)
            return True

    def peek(self, key: ChunkKey) -> torch.Tensor | None:
        """Return the memory tensor of ``key`` without touching the LRU order."""
        with self._lock:
            return self._memory.get(key)

    def on_disk(self, key: ChunkKey) -> bool:
        """Whether the disk tier indexes ``key``."""
        with self._lock:
            return key in self._disk

    def read_disk(self, key: ChunkKey, rows: int, cols: int) -> torch.Tensor | None:
        """Read and verify a disk chunk; None if it is no longer on disk.

        Raises :class:`ChunkLoadError` (and forgets the file) if it cannot be read or verified.
        """
        with self._lock:
            path = self._disk.get(key)
            if path is None:
                return None
            self._disk.move_to_end(key)
        try:
            return decode_chunk(path.read_bytes(), rows, cols)
        except (OSError, ChunkLoadError) as exc:
            with self._lock:
                if self._disk.get(key) == path:
                    del self._disk[key]
            path.unlink(missing_ok=True)
            raise ChunkLoadError(f"{path.name}: {exc}") from exc

    def release(self, owner: str) -> int:
        """Release every pin ``owner`` holds; return how many. Safe for unknown owners."""
        with self._lock:
            entry = self._owners.pop(owner, None)
            if entry is None:
                return 0
            self._unpin_locked(entry[1])
            return len(entry[1])

    def keep_prefix(self, owner: str, tokens: int) -> int:
        """Keep ``owner``'s pins on its first chunks holding at most ``tokens`` tokens (in
        the order it pinned them: prompt order); release the rest. Return how many."""
        with self._lock:
            entry = self._owners.get(owner)
            if entry is None:
                return 0
            keys = entry[1]
            kept = 0
            total = 0
            for key in keys:
                total += self._memory[key].shape[0]  # pinned: never evicted
                if total > tokens:
                    break
                kept += 1
            released = keys[kept:]
            del keys[kept:]
            self._unpin_locked(released)
            return len(released)

    def release_all(self) -> int:
        """Release every pin of every owner; return how many owners held pins."""
        with self._lock:
            owners = len(self._owners)
            self._owners.clear()
            self._pins.clear()
            return owners

    def expire_owners(self, max_age_s: float, skip: Collection[str]) -> list[str]:
        """Release the pins of owners whose first pin is older than ``max_age_s`` (not ``skip``)."""
        cutoff = time.monotonic() - max_age_s
        with self._lock:
            expired = []
            for owner, (since, _) in self._owners.items():
                if since >= cutoff:
                    break
                if owner not in skip:
                    expired.append(owner)
        for owner in expired:
            self.release(owner)
        return expired

    def snapshot(self) -> dict[str, int]:
        """Counts for stats: tier sizes, pinned chunks and owners, eviction counters."""
        with self._lock:
            return {
                "memory_chunks": len(self._memory),
                "disk_chunks": len(self._disk),
                "pinned_chunks": len(self._pins),
                "pinned_lookups": len(self._owners),
                **self._counters,
            }

    def _unpin_locked(self, keys: list[ChunkKey]) -> None:
        """Drop one pin per item of ``keys`` (a key pinned twice appears twice)."""
        for key in keys:
            left = self._pins.get(key, 0) - 1
            if left > 0:
                self._pins[key] = left
            else:
                self._pins.pop(key, None)

    def _pin_locked(self, key: ChunkKey, owner: str) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1
        entry = self._owners.get(owner)
        if entry is None:
            self._owners[owner] = (time.monotonic(), [key])
        else:
            entry[1].append(key)

    def _make_room_locked(self) -> list[tuple[ChunkKey, torch.Tensor]] | None:
        """Evict the LRU unpinned chunk if memory is full; None if every chunk is pinned.

        Returns the evicted chunks that still need a disk write (the caller writes
        them after releasing the lock).
        """
        if len(self._memory) < self._memory_capacity:
            return []
        victim = next((k for k in self._memory if k not in self._pins), None)
        if victim is None:
            return None
        tensor = self._memory.pop(victim)
        if self._disk_dir is None:
            self._counters["memory_evictions"] += 1
            return []
        self._counters["demotions"] += 1
        if victim in self._disk:  # inclusive tiers: the file is still there
            self._disk.move_to_end(victim)
            return []
        return [(victim, tensor)]

    @staticmethod
    def _prepare_dir(disk_dir: Path) -> None:
        try:
            disk_dir.mkdir(parents=True, exist_ok=True)
            # The index lives in memory, so chunk files of an earlier process are
            # unreachable: delete them to keep the directory bounded across restarts.
            for stale in [*disk_dir.glob(f"*{_SUFFIX}"), *disk_dir.glob(f"*{_SUFFIX}.tmp")]:
                stale.unlink(missing_ok=True)
        except OSError as exc:
            raise ValueError(
                f"disk_dir {str(disk_dir)!r} is not a usable directory: {exc}"
            ) from exc

    def _write_disk(self, key: ChunkKey, tensor: torch.Tensor) -> bool:
        if self._disk_dir is None:
            return False
        # A fresh name per write, so a concurrent eviction of an older file for the
        # same key can never delete this one.
        path = self._disk_dir / f"{key[0] & _HASH_MASK:016x}-{next(self._seq)}{_SUFFIX}"
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(encode_chunk(tensor))
            os.replace(tmp, path)  # readers never see a half-written file
        except OSError:
            logger.exception("could not write chunk %x to %s", key[0], path)
            tmp.unlink(missing_ok=True)
            return False
        doomed: list[Path] = []
        with self._lock:
            old = self._disk.pop(key, None)
            if old is not None:
                doomed.append(old)
            self._disk[key] = path
            while len(self._disk) > self._disk_capacity:
                doomed.append(self._disk.popitem(last=False)[1])
                self._counters["disk_evictions"] += 1
        for stale in doomed:
            stale.unlink(missing_ok=True)
        return True
