"""The chaos soak's traffic: prompts with known right answers, lookups, and their verdicts.

Every prompt's right answer is the min over ranks of the prefix each holds, so each
answer is judged: ``right``; ``zero`` (0 instead of a hit: allowed while a fault is in
effect); ``wrong`` (neither); ``hangs`` (still unanswered ``lookup_timeout_ms`` + 2 s
after it started); and, among the zeros, ``lost_hits``: 0 although the right answer is
a hit and no fault of the :class:`~benchmarks.soak.faults.FaultLog` was in effect at
any time in the lookup's life. ``quiet_hits`` counts the lookups that could have been
lost hits (a hit expected, a quiet life), so a lost-hit count of 0 says how much it
covered. Wrong answers, hangs and lost hits are kept with a diagnosis.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from benchmarks.soak.faults import FaultLog
from broker_lookup.client import RedisAsyncLookupClient

__all__ = ["CHUNK", "CHUNKS", "Prompt", "Traffic", "make_prompts"]

CHUNK, CHUNKS = 16, 8  #: tokens per chunk, chunks per prompt
_PROMPTS = 48
_HANG_GRACE_S = 2.0
_CANCEL_P = 0.002  #: per poll of an unanswered lookup
_REUSE_P = 0.2  #: a new lookup reuses the id of a finished one (a new generation)
_SAMPLES = 20_000  #: latencies kept for the p99


@dataclass(frozen=True)
class Prompt:
    """A prompt and the chunks each rank holds of it; the right answer is their min."""

    tokens: list[int]
    stored: list[int]  #: leading chunks preloaded, per rank
    tier: str

    @property
    def right(self) -> int:
        """The right answer, in tokens."""
        return min(self.stored) * CHUNK


def make_prompts(rng: random.Random, ranks: int) -> list[Prompt]:
    """Full hits, misses and partial hits, some of them on the (slow) disk tier."""
    out = []
    for i in range(_PROMPTS):
        stored = [  # kinds: 0 full hit, 1 miss (rank 0 has nothing), 2 partial hit
            CHUNKS if i % 3 == 0 else 0 if i % 3 == 1 and r == 0 else rng.randint(1, CHUNKS)
            for r in range(ranks)
        ]
        tokens = list(range(i * 100_000, i * 100_000 + CHUNKS * CHUNK))
        out.append(Prompt(tokens, stored, "disk" if i % 4 == 0 else "memory"))
    return out


@dataclass
class _Lookup:
    prompt: Prompt
    started: float
    reused: bool


@dataclass
class Traffic:
    """Lookups in flight and everything counted about them, judged against ``faults``."""

    client: RedisAsyncLookupClient
    prompts: list[Prompt]
    rng: random.Random
    faults: FaultLog
    timeout_s: float
    inflight: dict[str, _Lookup] = field(default_factory=dict)
    free_ids: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    serial: int = 0
    prefix: str = "soak"  #: of its lookup ids (two clients of one engine need two)
    observed: int = 0
    #: Per fault kind, of the 0s answered for a hit after every fault explaining them had
    #: ended, the one that started last after its fault: how long recovery took.
    slowest_recovery: dict[str, dict[str, Any]] = field(default_factory=dict)

    def issue(self, now: float) -> None:
        """One new lookup; some reuse the id of a finished one (a new generation)."""
        reused = bool(self.free_ids) and self.rng.random() < _REUSE_P
        if reused:
            lookup_id = self.free_ids.pop(self.rng.randrange(len(self.free_ids)))
            self.counts["reused_ids"] += 1
        else:
            self.serial += 1
            lookup_id = f"{self.prefix}-{self.serial}"
        prompt = self.rng.choice(self.prompts)
        self.client.lookup(prompt.tokens, lookup_id)
        self.inflight[lookup_id] = _Lookup(prompt, now, reused)
        self.counts["lookups"] += 1

    def poll(self, now: float) -> None:
        """Collect answers, judge them, cancel a few, flag hangs."""
        for lookup_id, lookup in list(self.inflight.items()):
            if self.rng.random() < _CANCEL_P:
                self.client.cancel_lookup(lookup_id)
                self._done(lookup_id, "cancels")
                continue
            got = self.client.lookup_cache(lookup_id)
            if got is None:
                if now - lookup.started > self.timeout_s + _HANG_GRACE_S:
                    self._diagnose("hangs", lookup_id, lookup, None, now)
                    self.client.cancel_lookup(lookup_id)
                    self._done(lookup_id, "hangs")
                continue
            self._observe(now - lookup.started)
            self.client.clear_lookup_status(lookup_id)
            self._done(lookup_id, self._verdict(lookup_id, lookup, got, now))

    def _verdict(self, lookup_id: str, lookup: _Lookup, got: int, now: float) -> str:
        right = lookup.prompt.right
        if got == right:
            verdict = "right"
        elif got != 0:
            verdict = "wrong"
            self._diagnose(verdict, lookup_id, lookup, got, now)
        else:
            verdict = "zero"
            if right > 0:
                self._recovery(lookup_id, lookup.started, now)
        if right > 0 and self.faults.quiet(lookup.started, now):
            self.counts["quiet_hits"] += 1
            if got == 0:
                self.counts["lost_hits"] += 1
                self._diagnose("lost_hits", lookup_id, lookup, got, now)
        return verdict

    def _recovery(self, lookup_id: str, start: float, now: float) -> None:
        """Per fault kind, keep the 0-for-a-hit that started longest after its fault ended."""
        found = self.faults.lag(start, now)
        if found is None:
            return
        lag, fault = found
        if lag <= self.slowest_recovery.get(fault.kind, {}).get("lag_s", -1.0):
            return
        origin = self.faults.origin
        self.slowest_recovery[fault.kind] = {
            "lag_s": round(lag, 3),
            "id": lookup_id,
            "start_s": round(start - origin, 3),
            "fault": fault.describe(origin),
        }

    def _diagnose(
        self, verdict: str, lookup_id: str, lookup: _Lookup, got: int | None, now: float
    ) -> None:
        stats = self.client.stats()
        facts = {
            "id": lookup_id,
            "got": got,
            "right": lookup.prompt.right,
            "stored": lookup.prompt.stored,
            "tier": lookup.prompt.tier,
            "reused_id": lookup.reused,
            "client_dead_ranks": list(stats.dead_ranks),
            "client_breaker_open": stats.breaker_open,
        }
        self.faults.diagnose(verdict, facts, lookup.started, now)

    def _observe(self, seconds: float) -> None:
        """Reservoir sample of latencies: p99 without a list as long as the soak."""
        self.observed += 1
        if len(self.latencies) < _SAMPLES:
            self.latencies.append(seconds)
        elif (slot := self.rng.randrange(self.observed)) < _SAMPLES:
            self.latencies[slot] = seconds

    def _done(self, lookup_id: str, verdict: str) -> None:
        del self.inflight[lookup_id]
        self.counts[verdict] += 1
        if len(self.free_ids) < 1000:
            self.free_ids.append(lookup_id)

    def p99_ms(self) -> float:
        """The 99th percentile of the sampled answer latencies, in ms."""
        lat = sorted(self.latencies)
        return round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else 0.0
