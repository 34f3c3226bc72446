"""Which rank was slow, and ranks that disagree: per-rank figures from completion events.

With ``rank_insights`` on, ``submit.lua`` stamps the server's clock on the lookup hash
and ``report.lua`` times each rank's report against it (both stamps from the Redis
server's ``TIME``: no clock is compared across hosts), then puts every rank's hits and
latency, and the rank that completed the lookup, on its completion entry (see
:mod:`broker_lookup.protocol.messages`). The listener feeds each such event of its own
lookups to :meth:`RankInsights.record`; ``stats()`` and the metrics read
:meth:`RankInsights.snapshot`.

Per expected rank: a histogram of submit-to-report latency, how often it reported last,
how many lookups it reported more hits than the minimum and the tokens that excess
amounts to (prefetched in vain: the lookup answers the minimum); over all lookups, a
histogram of max - min hits. A lookup whose spread exceeds ``rank_spread_warn_share`` of
its prompt logs a WARNING naming the id and each rank's hits, at most one every 10 s.

Lookups that reach their deadline unanswered are counted per rank that had not
reported by then (:meth:`RankInsights.record_late`, from the deadline script's answer
in the sender thread): the stragglers that turned a lookup into a timeout or a partial
answer, which no completion event shows.

Timing every lookup costs a saturated engine a fifth of its lookups per second (the
stamps, the longer completion entry and the listener's decoding; docs/performance.md),
so the sender times at most ``rank_insights_max_per_s`` lookups a second
(:class:`Sampler`). Each timed lookup stands for the untimed ones submitted since the one
before it: the histograms and counters add its weight, so they estimate every completed
lookup, and at a rate under the cap every lookup is timed and the figures are exact. The
spread WARNING names timed lookups only.

Memory is bounded: a fixed set of counters per expected rank, nothing per lookup.
"""

from __future__ import annotations

import logging

from broker_lookup.histogram import Histogram
from broker_lookup.protocol.messages import DoneEvent
from broker_lookup.protocol.stats import InsightsStats, RankInsightRow
from broker_lookup.ratelimit import RateLimitedLog

__all__ = ["SPREAD_BUCKETS", "RankInsights", "Sampler"]

logger = logging.getLogger(__name__)

#: Upper bounds in tokens of the max - min hits histogram; 0 is "every rank agreed".
SPREAD_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Sampler:
    """Which submits are timed: at most ``max_per_s`` a second (0: every one).

    Used under the sender's write lock only (its thread's and the caller's submits).
    :meth:`take` answers each submit's weight: 0 for an untimed one, else 1 plus the
    untimed submits since the last timed one.
    """

    __slots__ = ("_gap", "_next", "_skipped")

    def __init__(self, max_per_s: float) -> None:
        self._gap = 1.0 / max_per_s if max_per_s > 0 else 0.0
        self._next = 0.0
        self._skipped = 0

    def take(self, now: float) -> int:
        """The weight of a submit made at ``now`` (monotonic seconds); 0: do not time it."""
        if now < self._next:
            self._skipped += 1
            return 0
        self._next = now + self._gap
        weight = self._skipped + 1
        self._skipped = 0
        return weight


class RankInsights:
    """Per-rank latency, last-to-report and disagreement counters of one client.

    Args:
        expected: the client's expected ranks; events naming other ranks are not counted
            for them (memory stays per expected rank).
        warn_share: log when (max - min) / prompt tokens exceeds this.
        warn_every_s: at most one such WARNING per this many seconds.
        max_per_s: the :attr:`sampler`'s cap on timed lookups a second (0: every lookup).

    :meth:`record` is called by the listener thread only, :meth:`record_late` by the
    sender's only and the :attr:`sampler` under the sender's write lock, each writing its
    own counters (no lock); readers copy via :meth:`snapshot`.
    """

    def __init__(
        self,
        expected: tuple[int, ...],
        warn_share: float,
        warn_every_s: float = 10.0,
        max_per_s: float = 0.0,
    ) -> None:
        self.expected = tuple(expected)
        self.warn_share = warn_share
        self.latency: dict[int, Histogram] = {r: Histogram() for r in self.expected}
        self.last: dict[int, int] = dict.fromkeys(self.expected, 0)
        self.excess_lookups: dict[int, int] = dict.fromkeys(self.expected, 0)
        self.excess_tokens: dict[int, int] = dict.fromkeys(self.expected, 0)
        self.spread = Histogram(SPREAD_BUCKETS)
        #: Lookups that reached their deadline before this rank reported.
        self.late: dict[int, int] = dict.fromkeys(self.expected, 0)
        #: Completion events that carried insights (timed lookups).
        self.recorded = 0
        #: The lookups those stand for: the sum of their weights.
        self.represented = 0
        #: Decides which submits are timed (under the sender's write lock).
        self.sampler = Sampler(max_per_s)
        self.warnings = 0
        self._warn = RateLimitedLog(logger, warn_every_s)

    def record(self, ev: DoneEvent, tokens: int, weight: int = 1) -> None:
        """Count one completion event of this client's lookup of ``tokens`` prompt tokens,
        as ``weight`` lookups (the :attr:`sampler`'s weight of its submit).

        An event without insights (``rank_insights`` off, an older script) is ignored.
        """
        if ev.last is None or not ev.hits:
            return
        weight = max(weight, 1)
        self.recorded += 1
        self.represented += weight
        if ev.last in self.last:
            self.last[ev.last] += weight
        for rank, micros in zip(ev.ranks, ev.latency_us, strict=False):
            hist = self.latency.get(rank)
            if hist is not None and micros is not None:
                hist.observe(micros / 1e6, weight)
        low, high = min(ev.hits), max(ev.hits)
        spread = high - low
        self.spread.observe(spread, weight)
        if not spread:
            return
        for rank, hits in zip(ev.ranks, ev.hits, strict=False):
            if hits > low and rank in self.excess_lookups:
                self.excess_lookups[rank] += weight
                self.excess_tokens[rank] += (hits - low) * weight
        if tokens > 0 and spread / tokens > self.warn_share:
            self.warnings += 1
            counts = ", ".join(f"rank {r}={h}" for r, h in zip(ev.ranks, ev.hits, strict=False))
            self._warn(
                logging.WARNING,
                "ranks disagree on lookup %.200r gen %d: hits %s; spread %d of %d prompt "
                "tokens is over rank_spread_warn_share %.2f (the lookup answers the "
                "minimum; the ranks above it prefetched the difference in vain)",
                ev.lookup_id,
                ev.gen,
                counts,
                spread,
                tokens,
                self.warn_share,
            )

    def record_late(self, ranks: list[int]) -> None:
        """A lookup reached its deadline before ``ranks`` reported (sender thread)."""
        for rank in ranks:
            if rank in self.late:
                self.late[rank] += 1

    def snapshot(self) -> InsightsStats:
        """Copies for ``stats()`` and the metrics: per rank and spread."""
        return InsightsStats(
            recorded=self.recorded,
            represented=self.represented,
            ranks={
                r: RankInsightRow(
                    report_counts=tuple(self.latency[r].counts),
                    report_sum=self.latency[r].total,
                    last=self.last[r],
                    excess_lookups=self.excess_lookups[r],
                    excess_tokens=self.excess_tokens[r],
                    late=self.late[r],
                )
                for r in self.expected
            },
            spread_counts=tuple(self.spread.counts),
            spread_sum=self.spread.total,
            spread_warnings=self.warnings,
        )
