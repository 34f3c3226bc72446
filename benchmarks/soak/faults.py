"""The chaos soak's record of faults, and the judge of whether a lookup saw one.

A lookup answered 0 although every expected rank held its prefix is a *lost hit*
unless some fault could explain it. :class:`FaultLog` keeps one :class:`Fault` per
fault the soak injected (a rank kill, a server restart, a network fault), each with
the interval it was in effect, and judges a lookup's life against them: a fault
explains every lookup alive from its start until ``quiet_s`` after it ended. The
soak sets ``quiet_s`` to ``lookup_timeout_ms`` + the heartbeat TTL + 1 s: a lookup
sent just before the fault ended may still time out, a rank silenced by it may still
be taken for dead until its heartbeat is read again, and a second covers the
reconnects.

Times are ``time.monotonic()`` seconds; reports show them relative to the soak's start.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["Fault", "FaultLog"]

_EXAMPLES = 20  #: diagnosed lookups kept per verdict, so the summary stays readable


@dataclass
class Fault:
    """One injected fault and when it was in effect.

    ``end`` is None while it lasts (a killed rank not back yet). A lost reply that
    never happened (its command was not sent in time) has ``took_effect`` False: it
    still explains lookups (it was armed), but is not counted as a fault that occurred.
    """

    kind: str
    target: str  #: "client", "rank<r>", "server", or "all"
    start: float
    end: float | None = None
    took_effect: bool = True
    detail: str = ""

    def explains(self, start: float, end: float, quiet_s: float) -> bool:
        """Whether a lookup alive from ``start`` to ``end`` overlaps this fault's effect."""
        over = math.inf if self.end is None else self.end + quiet_s
        return self.start <= end and start <= over

    def describe(self, origin: float) -> dict[str, Any]:
        """This fault for a report, its times in seconds since ``origin``."""
        return {
            "kind": self.kind,
            "target": self.target,
            "start_s": round(self.start - origin, 3),
            "end_s": None if self.end is None else round(self.end - origin, 3),
            "took_effect": self.took_effect,
            "detail": self.detail,
        }


class FaultLog:
    """Every fault of one soak; judges lookups against them and diagnoses the bad ones.

    Args:
        quiet_s: How long a fault's effect outlasts its end (see the module docstring).
        origin: The soak's start, for relative times in reports.
    """

    def __init__(self, quiet_s: float, origin: float) -> None:
        self.quiet_s = quiet_s
        self.origin = origin
        self.faults: list[Fault] = []
        #: Diagnosed lookups by verdict ("lost_hits", "wrong", "hangs"): a few each.
        self.examples: dict[str, list[dict[str, Any]]] = {}

    def begin(self, kind: str, target: str, now: float, detail: str = "") -> Fault:
        """Record that a fault starts now; end it with :meth:`end`."""
        fault = Fault(kind, target, now, detail=detail)
        self.faults.append(fault)
        return fault

    def end(self, fault: Fault, at: float) -> None:
        """Its effect ended at ``at`` (may be later than now: a connection hung until a timeout)."""
        fault.end = at

    def instant(self, kind: str, target: str, now: float, detail: str = "") -> Fault:
        """A fault that is over as soon as it happened (a reset); the quiet time follows."""
        fault = self.begin(kind, target, now, detail)
        fault.end = now
        return fault

    def explaining(self, start: float, end: float) -> list[Fault]:
        """The faults whose effect overlaps a lookup alive from ``start`` to ``end``."""
        return [f for f in self.faults if f.explains(start, end, self.quiet_s)]

    def quiet(self, start: float, end: float) -> bool:
        """Whether no fault was in effect at any time from ``start`` to ``end``."""
        return not any(f.explains(start, end, self.quiet_s) for f in self.faults)

    def lag(self, start: float, end: float) -> tuple[float, Fault] | None:
        """How long after the last explaining fault ended a lookup alive from ``start`` to
        ``end`` started, and that fault; None if one was in effect during its life.

        The largest lag of a 0 answered for a hit shows how much of ``quiet_s`` the
        system needed to recover (a lag near ``quiet_s`` hints at a hidden lost hit).
        """
        explaining = self.explaining(start, end)
        if not explaining or any(f.end is None or f.end >= start for f in explaining):
            return None
        last = max(explaining, key=lambda f: f.end or 0.0)
        return start - (last.end or 0.0), last

    def counts(self) -> dict[str, int]:
        """How many faults of each kind occurred (lost replies: only those that happened)."""
        return dict(sorted(Counter(f.kind for f in self.faults if f.took_effect).items()))

    def unfired(self) -> int:
        """Lost replies armed but never triggered (their command was not sent in time)."""
        return sum(1 for f in self.faults if not f.took_effect)

    def diagnose(self, verdict: str, lookup: dict[str, Any], start: float, end: float) -> None:
        """Keep ``lookup`` (its id, answer, ...) for the report, with the faults around it."""
        kept = self.examples.setdefault(verdict, [])
        if len(kept) >= _EXAMPLES:
            return
        # The fault whose effect ended last before the lookup, and the next one to start.
        before = sorted(
            (f for f in self.faults if f.start <= end),
            key=lambda f: math.inf if f.end is None else f.end,
        )
        after = [f for f in self.faults if f.start > end]
        kept.append(
            {
                **lookup,
                "start_s": round(start - self.origin, 3),
                "end_s": round(end - self.origin, 3),
                "faults_in_effect": [f.describe(self.origin) for f in self.explaining(start, end)],
                "last_fault_before": before[-1].describe(self.origin) if before else None,
                "next_fault_after": after[0].describe(self.origin) if after else None,
            }
        )
