"""The fleet soak's judgements: memory bounded, every key with a TTL, checks by feature.

Pure functions of what the soak measured, so they are tested without a server:

* :func:`judge_memory`: Redis ``used_memory`` sampled through the run must not grow
  late beyond a bound of its early plateau (a fleet that churns engines must not leave
  their keys behind).
* :func:`audit_keys`: at the end, no key without a TTL, and (with an engine TTL) no key
  of a gone engine that lives past the engine TTL after its last process died.
* :func:`judge`: which checks hold this build to account. A check of a feature the
  build does not have (one owner per rank, an engine TTL) is reported, not enforced:
  :class:`Features` tells which are there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace

__all__ = [
    "Features",
    "KeyRow",
    "MemoryBound",
    "audit_keys",
    "judge",
    "judge_memory",
    "passed",
]


@dataclass(frozen=True)
class Features:
    """What this build has that the fleet soak's full checks need."""

    ownership: bool  #: one owner per (engine, rank) and per scheduler
    engine_ttl: bool  #: every key of an engine expires after its last process

    @classmethod
    def detect(cls) -> Features:
        """From the code itself: a ``KeySpace.owner`` key and an ``engine_ttl_ms`` setting."""
        return cls(
            ownership=callable(getattr(KeySpace, "owner", None)),
            engine_ttl="engine_ttl_ms" in LookupConfig.__struct_fields__,
        )


@dataclass(frozen=True)
class MemoryBound:
    """The late samples' median may reach ``factor`` x the early plateau + ``slack_bytes``.

    A coarse net (the key audit is the precise judge of what a gone engine leaves): it
    catches what keys do not show, and is loose enough for the lookups' own keys, whose
    number follows the rate of lookups, which a loaded box varies.
    """

    factor: float = 1.2
    slack_bytes: int = 1 << 20
    min_samples: int = 8


def judge_memory(samples: Sequence[int], bound: MemoryBound = MemoryBound()) -> dict[str, Any]:
    """Whether the last quarter of ``samples`` stays within ``bound`` of the early plateau.

    The plateau is the median of the second quarter (the first is the fleet starting
    up); the late level is the median of the last quarter (its peak is reported too).
    Fewer than ``bound.min_samples`` samples: not judged (``ok`` True, with the reason).
    """
    n = len(samples)
    if n < bound.min_samples:
        return {"judged": False, "ok": True, "reason": f"{n} samples, {bound.min_samples} needed"}
    plateau = _median(samples[n // 4 : n // 2])
    late = samples[3 * n // 4 :]
    limit = int(plateau * bound.factor) + bound.slack_bytes
    return {
        "judged": True,
        "ok": _median(late) <= limit,
        "early_plateau": plateau,
        "late_median": _median(late),
        "late_peak": max(late),
        "limit": limit,
    }


def _median(values: Sequence[int]) -> int:
    return sorted(values)[len(values) // 2]


@dataclass(frozen=True)
class KeyRow:
    """One key on the server at the end: its engine ("" if none of the soak's), Redis
    type and PTTL (-1: none)."""

    name: str
    engine: str
    kind: str
    pttl_ms: int


def audit_keys(
    rows: Sequence[KeyRow],
    gone_at: Mapping[str, float],
    now: float,
    engine_ttl_ms: int | None,
    slack_s: float = 3.0,
) -> dict[str, Any]:
    """The keys left at ``now``: which have no TTL, which outlive their engine's bound.

    Without an engine TTL (``engine_ttl_ms`` None), streams are trimmed, not expired,
    so a stream without a TTL is listed apart and not counted in ``no_ttl``. With one,
    a key of an engine gone at ``gone_at[engine]`` is *overdue* if it lives (now, or by
    its PTTL) past ``gone_at + engine_ttl_ms + slack_s``.
    """
    no_ttl = [r.name for r in rows if r.pttl_ms == -1 and (engine_ttl_ms or r.kind != "stream")]
    overdue = []
    gone: dict[str, dict[str, int]] = {}
    for row in rows:
        if row.engine not in gone_at:
            continue
        seen = gone.setdefault(row.engine, {"keys": 0, "max_pttl_ms": -2})
        seen["keys"] += 1
        seen["max_pttl_ms"] = max(seen["max_pttl_ms"], row.pttl_ms)
        if engine_ttl_ms is not None and row.pttl_ms >= 0:
            lives_until = now + row.pttl_ms / 1000
            if lives_until > gone_at[row.engine] + engine_ttl_ms / 1000 + slack_s:
                overdue.append(row.name)
    return {
        "keys": len(rows),
        "no_ttl": no_ttl,
        "streams_without_ttl": [r.name for r in rows if r.pttl_ms == -1 and r.kind == "stream"],
        "overdue": overdue,
        "gone_engines_with_keys": len(gone),
        "gone_keys": sum(g["keys"] for g in gone.values()),
        "gone_max_pttl_ms": max((g["max_pttl_ms"] for g in gone.values()), default=None),
        "by_gone_engine": dict(sorted(gone.items())),
    }


def judge(
    counts: Mapping[str, int],
    audit: Mapping[str, Any],
    memory: Mapping[str, Any],
    features: Features,
    duplicates_ran: bool,
) -> dict[str, dict[str, Any]]:
    """Every check: its value (0 passes), whether it is enforced, and why not if not."""
    if duplicates_ran:
        dup_why = ""
    else:
        dup_why = "duplicates off" if features.ownership else "no owner per rank in this build"
    ttl_why = "" if features.engine_ttl else "no engine TTL in this build: gone engines stay"

    def check(value: int, why: str = "") -> dict[str, Any]:
        return {"value": value, "enforced": not why, **({"why": why} if why else {})}

    return {
        "wrong": check(counts["wrong"]),
        "hangs": check(counts["hangs"]),
        "lost_hits": check(counts["lost_hits"]),
        "unexpected_exits": check(counts["unexpected_exits"]),
        "keys_without_ttl": check(len(audit["no_ttl"])),
        "keys_overdue": check(len(audit["overdue"]), ttl_why),
        "memory_growth": check(0 if memory["ok"] else 1, ttl_why),
        "duplicate_answers": check(counts["duplicate_answers"], dup_why),
    }


def passed(checks: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether every enforced check is 0."""
    return all(c["value"] == 0 for c in checks.values() if c["enforced"])
