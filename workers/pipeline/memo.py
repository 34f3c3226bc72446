"""A bounded, expiring set: what a rank remembers about lookups it no longer tracks."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Memo"]

K = TypeVar("K", bound=Hashable)


class Memo(Generic[K]):
    """Keys with an expiry time, oldest first; adding beyond ``capacity`` forgets the oldest.

    Every key gets the same time to live from its caller, so insertion order is expiry
    order and :meth:`expire` stops at the first live key (no scan).
    """

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[K, float] = OrderedDict()
        self._capacity = capacity

    def add(self, key: K, expires: float) -> None:
        """Remember ``key`` until ``expires`` (monotonic seconds)."""
        self._items[key] = expires
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def discard(self, key: K) -> bool:
        """Forget ``key``; True if it was remembered."""
        return self._items.pop(key, None) is not None

    def expire(self, now: float) -> None:
        """Forget every key whose time has come."""
        while self._items:
            key, expires = next(iter(self._items.items()))
            if expires > now:
                break
            del self._items[key]

    def next_expiry(self) -> float:
        """When the oldest key expires (monotonic seconds); inf when empty."""
        return next(iter(self._items.values()), math.inf)

    def clear(self) -> None:
        """Forget everything."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
