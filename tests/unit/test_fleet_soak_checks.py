"""The fleet soak's pure logic: the churn plan, the memory bound, the key audit, the checks."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.soak.churn import SIGNALS, plan_churn
from benchmarks.soak.fleet_checks import (
    Features,
    KeyRow,
    MemoryBound,
    audit_keys,
    judge,
    judge_memory,
    passed,
)


@pytest.mark.parametrize("seed", range(5))
def test_churn_stops_every_slot_but_the_steady_one_by_both_signals(seed: int) -> None:
    plan = plan_churn(random.Random(seed), 8, 100.0, (3.0, 5.0), min_life_s=12.0)
    assert 20 <= len(plan) <= 33, plan  # one every 3-5 s over 100 s
    times = [e.at_s for e in plan]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100.0
    assert {e.slot for e in plan} == set(range(1, 8))  # slot 0 is never churned
    assert {e.signal for e in plan} == set(SIGNALS)
    # Signals alternate, so a short run sees both.
    assert all(a.signal != b.signal for a, b in itertools.pairwise(plan))
    last: dict[int, float] = {}
    for event in plan:  # every engine serves min_life_s before it is stopped
        assert event.at_s - last.get(event.slot, 0.0) >= 12.0, (event, last)
        last[event.slot] = event.at_s


def test_churn_waits_when_no_slot_has_lived_long_enough() -> None:
    # Two churnable slots, a stop due every second, each engine must live 10 s: the
    # stops come as slots become ready, never more often.
    plan = plan_churn(random.Random(0), 3, 30.0, (1.0, 1.0), min_life_s=10.0)
    assert [e.at_s for e in plan] == [10.0, 11.0, 20.0, 21.0], plan
    assert plan[0].slot == plan[2].slot != plan[1].slot == plan[3].slot
    assert plan_churn(random.Random(0), 1, 30.0, (1.0, 1.0), min_life_s=1.0) == []


def test_memory_plateau_then_steady_is_bounded() -> None:
    start_up = [1_000_000, 3_000_000, 5_000_000]
    steady = [8_000_000 + (i % 3) * 500_000 for i in range(17)]
    verdict = judge_memory(start_up + steady, MemoryBound(factor=1.5, slack_bytes=0))
    assert verdict["judged"] and verdict["ok"], verdict


def test_memory_that_keeps_growing_is_not_bounded() -> None:
    # What a fleet leaking every gone engine's streams looks like: a line up.
    growing = [2_000_000 + i * 1_000_000 for i in range(20)]
    verdict = judge_memory(growing, MemoryBound(factor=1.5, slack_bytes=2 << 20))
    assert verdict["judged"] and not verdict["ok"], verdict
    assert verdict["late_peak"] == growing[-1] and verdict["late_median"] > verdict["limit"]


def test_memory_judges_the_late_level_not_one_spike() -> None:
    steady = [5_000_000] * 19 + [9_000_000]  # one sample caught a burst of lookups
    verdict = judge_memory(steady, MemoryBound(factor=1.2, slack_bytes=0))
    assert verdict["ok"] and verdict["late_peak"] == 9_000_000, verdict


def test_memory_with_too_few_samples_is_not_judged() -> None:
    verdict = judge_memory([1, 2, 3], MemoryBound(min_samples=8))
    assert verdict == {"judged": False, "ok": True, "reason": "3 samples, 8 needed"}


def _rows() -> list[KeyRow]:
    return [
        KeyRow("bl:{a}:requests", "a", "stream", -1),
        KeyRow("bl:{a}:lookup:1", "a", "hash", 4_000),
        KeyRow("bl:{b}:fp", "b", "hash", 50_000),
        KeyRow("bl:{c}:hb:0", "c", "string", -1),
        KeyRow("stray", "", "string", -1),
    ]


def test_key_audit_without_an_engine_ttl_excepts_streams() -> None:
    audit = audit_keys(_rows(), {"a": 90.0, "b": 95.0}, now=100.0, engine_ttl_ms=None)
    assert audit["no_ttl"] == ["bl:{c}:hb:0", "stray"]
    assert audit["streams_without_ttl"] == ["bl:{a}:requests"]
    assert audit["overdue"] == []  # nothing to be overdue against
    assert audit["gone_engines_with_keys"] == 2 and audit["gone_keys"] == 3
    assert audit["gone_max_pttl_ms"] == 50_000
    assert audit["by_gone_engine"]["a"] == {"keys": 2, "max_pttl_ms": 4_000}


def test_key_audit_with_an_engine_ttl_counts_streams_and_overdue_keys() -> None:
    # Engine TTL 10 s + 3 s slack. a went at 90: its hash lives to 104 > 103, overdue.
    # b went at 95: its fingerprint lives to 150 > 108, overdue.
    audit = audit_keys(_rows(), {"a": 90.0, "b": 95.0}, now=100.0, engine_ttl_ms=10_000)
    assert audit["no_ttl"] == ["bl:{a}:requests", "bl:{c}:hb:0", "stray"]
    assert audit["overdue"] == ["bl:{a}:lookup:1", "bl:{b}:fp"]
    # Gone recently enough, both are within the bound.
    fresh = audit_keys(_rows(), {"a": 99.0, "b": 99.0}, now=100.0, engine_ttl_ms=60_000)
    assert fresh["overdue"] == []


_CLEAN = {"wrong": 0, "hangs": 0, "lost_hits": 0, "unexpected_exits": 0, "duplicate_answers": 0}
_AUDIT = {"no_ttl": [], "overdue": ["bl:{a}:fp"]}
_GROWING = {"ok": False}


def test_checks_of_missing_features_are_reported_not_enforced() -> None:
    today = Features(ownership=False, engine_ttl=False)
    checks = judge({**_CLEAN, "duplicate_answers": 3}, _AUDIT, _GROWING, today, False)
    assert checks["keys_overdue"] == {
        "value": 1,
        "enforced": False,
        "why": "no engine TTL in this build: gone engines stay",
    }
    assert not checks["memory_growth"]["enforced"] and checks["memory_growth"]["value"] == 1
    assert checks["duplicate_answers"]["why"] == "no owner per rank in this build"
    assert passed(checks)
    assert not passed(judge({**_CLEAN, "wrong": 1}, _AUDIT, _GROWING, today, False))


def test_checks_of_present_features_are_enforced() -> None:
    full = Features(ownership=True, engine_ttl=True)
    checks = judge(_CLEAN, _AUDIT, _GROWING, full, True)
    assert all(c["enforced"] for c in checks.values())
    assert not passed(checks)  # the overdue key and the growing memory
    clean = judge(_CLEAN, {"no_ttl": [], "overdue": []}, {"ok": True}, full, True)
    assert passed(clean)
    # Told not to run them, duplicates are not judged even where ownership exists.
    assert judge(_CLEAN, _AUDIT, _GROWING, full, False)["duplicate_answers"]["why"] == (
        "duplicates off"
    )


def test_features_are_read_from_the_code() -> None:
    from broker_lookup.config import LookupConfig
    from broker_lookup.protocol.keys import KeySpace

    features = Features.detect()
    assert features.ownership == hasattr(KeySpace, "owner")
    assert features.engine_ttl == ("engine_ttl_ms" in LookupConfig.__struct_fields__)
