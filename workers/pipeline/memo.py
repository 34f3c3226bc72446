"""A bounded, expiring set: what a rank remembers about lookups it no longer tracks."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import TypeVar

__all__ = ["Memo"]

K = TypeVar("K", bound=Hashable)


class Memo(OrderedDict[K, float]):
    """Keys with an expiry time, oldest first; adding beyond ``capacity`` forgets the oldest.

    Every key gets the same time to live from its caller, so insertion order is expiry
    order and :meth:`expire` stops at the first live key (no scan). An ordered dict
    itself, so that ``key in memo`` (the lifecycle asks twice per lookup) costs no
    Python call.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self._capacity = capacity

    def add(self, key: K, expires: float) -> None:
        """Remember ``key`` until ``expires`` (monotonic seconds)."""
        self[key] = expires
        self.move_to_end(key)
        while len(self) > self._capacity:
            self.popitem(last=False)

    def discard(self, key: K) -> bool:
        """Forget ``key``; True if it was remembered."""
        return self.pop(key, None) is not None

    def expire(self, now: float) -> None:
        """Forget every key whose time has come."""
        while self:
            key, expires = next(iter(self.items()))
            if expires > now:
                break
            del self[key]

    def next_expiry(self) -> float:
        """When the oldest key expires (monotonic seconds); inf when empty."""
        return next(iter(self.values()), math.inf)
