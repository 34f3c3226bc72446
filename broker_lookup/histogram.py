"""Histograms both sides keep in memory and ``metrics`` exports: latency in seconds over
one bucket scheme (:data:`LATENCY_BUCKETS`), other quantities over bounds of their own."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

__all__ = ["LATENCY_BUCKETS", "Histogram"]

#: Upper bounds in seconds, Prometheus-style; one more bucket counts what lies above the last.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Per-bucket counts over ``bounds`` (default :data:`LATENCY_BUCKETS`) and their sum;
    O(log buckets) a sample.

    Not locked: its owner serialises :meth:`observe` (one thread, or under its own lock);
    readers copy ``counts`` (a list read under the GIL).
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    @classmethod
    def of(
        cls, counts: Sequence[int], total: float, bounds: Sequence[float] = LATENCY_BUCKETS
    ) -> Histogram:
        """A histogram holding exported ``counts`` (per bucket, overflow last) and ``total``.

        Missing trailing buckets count 0 and extra ones are ignored, so a scrape of a
        process with another bucket count still renders.
        """
        hist = cls(bounds)
        for i, count in enumerate(counts[: len(hist.counts)]):
            hist.counts[i] = int(count)
        hist.total = float(total)
        return hist

    def observe(self, seconds: float, weight: int = 1) -> None:
        """Count ``weight`` samples (one, unless sampled) of ``seconds`` (or of whatever
        ``bounds`` measure)."""
        self.counts[bisect.bisect_left(self.bounds, seconds)] += weight
        self.total += seconds * weight

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, samples at or below it) per bucket, Prometheus-style; the last is inf."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, count in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out
