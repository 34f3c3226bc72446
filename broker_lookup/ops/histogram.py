"""Latency histograms both sides keep in memory and ``metrics`` exports: one bucket scheme."""

from __future__ import annotations

import bisect

__all__ = ["LATENCY_BUCKETS", "Histogram"]

#: Upper bounds in seconds, Prometheus-style; one more bucket counts what lies above the last.
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    """Per-bucket counts over :data:`LATENCY_BUCKETS` and their sum; O(log buckets) a sample.

    Not locked: one thread observes; readers copy ``counts`` (a list read under the GIL).
    """

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        """Count one sample of ``seconds``."""
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
