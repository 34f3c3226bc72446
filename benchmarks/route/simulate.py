"""One arm of ``python -m benchmarks.route``: a fleet, a policy, the trace, the outcome.

Requests are routed in trace order, ``in_flight`` ahead of the engines' own lookups (the
requests a router has sent that no engine has admitted yet: between a route and its
lookup, the engines serve that many others, which store and evict). Time for the index's
lag is the trace's: request ``i`` arrives at ``i / rate``. Restarts hit the same engines
at the same requests in every arm (``restarts``: request index -> engine).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from benchmarks.bench.measure import summarize_ns
from benchmarks.route.fleet import Fleet
from benchmarks.route.policies import FleetQuery, Policy
from benchmarks.route.trace import Request

__all__ = ["Outcome", "run_arm"]


@dataclass
class Outcome:
    """What one arm's requests found."""

    found: list[int] = field(default_factory=list)
    expected: list[int] = field(default_factory=list)
    false_hits: int = 0  #: routed expecting N tokens, the engine's lookup found fewer
    false_hits_restart: int = 0  #: ... of which the engine restarted in between
    false_hits_short: int = 0  #: ... of the others, its reservation pinned less than found

    def summary(self, requests: list[Request]) -> dict[str, Any]:
        """The arm's figures."""
        n = max(1, len(self.found))
        total = sum(sum(r.offsets) for r in requests)
        return {
            "requests": len(self.found),
            "tokens_reused_per_request": statistics.fmean(self.found) if self.found else 0.0,
            "reused_share": sum(self.found) / max(1, total),
            "expected_per_request": statistics.fmean(self.expected) if self.expected else 0.0,
            "routed_expecting": sum(1 for e in self.expected if e),
            "false_hits": self.false_hits,
            "false_hit_rate": self.false_hits / n,
            "false_hits_restart": self.false_hits_restart,
            "false_hit_rate_no_restart": (self.false_hits - self.false_hits_restart) / n,
            "false_hits_reserved_short": self.false_hits_short,
            # Neither a restart nor a reservation that fell short: with reservation, a
            # defect (the prefix was pinned, yet the lookup found less).
            "false_hits_unexplained": (
                self.false_hits - self.false_hits_restart - self.false_hits_short
            ),
        }


def run_arm(
    fleet: Fleet,
    policy: Policy,
    trace: list[Request],
    restarts: dict[int, int],
    in_flight: int,
    rate: float,
) -> dict[str, Any]:
    """Route every request of ``trace`` by ``policy`` on ``fleet``; the arm's figures."""
    out = Outcome()
    waiting: deque[tuple[Request, int, int, int]] = deque()

    def admit(now: float) -> None:
        request, engine, expected, generation = waiting.popleft()
        found = fleet.lookup(engine, request, f"route-{request.index}")
        out.found.append(found)
        out.expected.append(expected)
        if found < expected:
            out.false_hits += 1
            if fleet.generation[engine] != generation:
                out.false_hits_restart += 1  # its cache and reservations went with it
            elif isinstance(policy, FleetQuery) and request.index in policy.short:
                out.false_hits_short += 1
        policy.emitted(now, fleet.serve(engine, request))

    now = 0.0
    for request in trace:
        now = request.index / rate
        if request.index in restarts:
            policy.emitted(now, fleet.restart(restarts[request.index]))
        engine, expected = policy.route(request, now)
        waiting.append((request, engine, expected, fleet.generation[engine]))
        if len(waiting) > in_flight:
            admit(now)
    while waiting:
        admit(now)
    result = out.summary(trace)
    result.update(fleet.stats())
    if isinstance(policy, FleetQuery):
        result["query"] = summarize_ns(policy.latency_ns)
        result["reserved_short"] = policy.reserved_short
        result["queries_failed"] = policy.failed
    return result
