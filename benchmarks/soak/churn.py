"""The fleet soak's churn: when which engine stops, and how (SIGTERM or SIGKILL).

An engine that stops is replaced at once by a new one with a fresh engine id in the
same slot, as vLLM's default engine id (a fresh uuid per start) does. The plan is made
up front from the seed, so a run can be repeated; the fleet loop carries out each stop
when it is due and its slot's engine serves (an engine still starting is stopped as
soon as it serves).

Slot 0 is never churned: it holds the steady engine that the duplicated scheduler and
the duplicated rank process try to take over (:mod:`benchmarks.soak.fleet`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["SIGNALS", "ChurnEvent", "plan_churn"]

#: How an engine stops: "term" is an ordered shutdown (its lookups drained, the client
#: closed, SIGTERM to its ranks); "kill" is a crash (SIGKILL to its ranks, its client's
#: link cut while lookups are in flight).
SIGNALS = ("term", "kill")


@dataclass(frozen=True)
class ChurnEvent:
    """At ``at_s`` seconds into the soak, stop slot ``slot``'s engine by ``signal``."""

    at_s: float
    slot: int
    signal: str


def plan_churn(
    rng: random.Random,
    slots: int,
    until_s: float,
    every_s: tuple[float, float],
    min_life_s: float,
) -> list[ChurnEvent]:
    """One stop every ``every_s`` seconds (random in the range) before ``until_s``.

    Each stop picks, among slots 1 to ``slots - 1``, one whose last stop is at least
    ``min_life_s`` ago (so an engine serves a while before it goes), the longest-lived
    first on ties; signals alternate from a random first, so any two stops show both.
    Fewer than two slots: nothing churns.
    """
    if slots < 2:
        return []
    last = dict.fromkeys(range(1, slots), 0.0)
    signal = rng.randrange(len(SIGNALS))
    events: list[ChurnEvent] = []
    at = rng.uniform(*every_s)
    while at < until_s:
        ready = [s for s, t in last.items() if at - t >= min_life_s]
        if ready:
            oldest = min(last[s] for s in ready)
            slot = rng.choice([s for s in ready if last[s] == oldest])
            events.append(ChurnEvent(round(at, 3), slot, SIGNALS[signal]))
            last[slot] = at
            signal = (signal + 1) % len(SIGNALS)
        at += rng.uniform(*every_s)
    return events
