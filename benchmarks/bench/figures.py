"""The per-lookup figures of ``python -m benchmarks.bench`` results: CPU per lookup on each side,
the ours / LMCache ratios, and the targets met or missed.

CPU per lookup, one lookup in flight, comes from the latency runs: each process's CPU
time over the run divided by the lookups (warm-up included). "Scheduler process" is the
whole client process, the caller's polling loop (``lookup_cache`` every ``poll_us``)
included, on both sides; "rank" is one rank process (all ranks / world size). CPU per
lookup with 1,000 in flight comes from the throughput run: caller + client threads +
ranks, + Redis on our side (LMCache has no broker).
"""

from __future__ import annotations

from typing import Any

__all__ = ["HASH_TARGET_SIZES", "RATIO_VARIANT", "evaluate_targets", "figures", "ratios"]

#: The LMCache client the ratio targets are against: backoff 0 (its PR #5018 default).
RATIO_VARIANT = "backoff0"
#: Prompt sizes the hashing target covers (8k-128k tokens).
HASH_TARGET_SIZES = range(8192, 131072 + 1)
#: World sizes of the e2e targets: p50 <= 1.5x, p99 <= 2x.
_E2E_WORLDS = ("1", "4", "8")
_E2E_P50_LIMIT = 1.5
_E2E_P99_LIMIT = 2.0
_CPU_LIMIT = 1.0  #: rank, scheduler and 1,000-in-flight CPU per lookup: <= LMCache's
_THROUGHPUT_LIMIT = 2.0
_HASH_SPEEDUP_LIMIT = 2.0
_LOOKUP_CACHE_US = 2.0
_LOOKUP_CALL_US = 60.0
_GROWTH_SLACK = 1.5  #: "nothing grows with pending count": n-pending cost <= 1.5x the 1-pending


def _one_in_flight(world: str, run: dict[str, Any]) -> dict[str, float]:
    cpu = run["cpu_per_1000"]  # seconds per 1,000 lookups = ms per lookup
    out = {
        "e2e_p50_ms": run["e2e"]["p50_ms"],
        "e2e_p99_ms": run["e2e"]["p99_ms"],
        "lookup_call_us": run["lookup_call_us"],
        "polls_per_lookup": run["polls_per_lookup"],
        "rank_cpu_us_per_rank": cpu["ranks"] * 1000 / int(world),
        "scheduler_cpu_us": cpu["client_process"] * 1000,
        "caller_thread_cpu_us": cpu["caller_thread"] * 1000,
        "client_threads_cpu_us": cpu["client_threads"] * 1000,
    }
    if "redis" in cpu:
        out["redis_cpu_us"] = cpu["redis"] * 1000
    return out


def _in_flight(tput: dict[str, Any]) -> dict[str, Any]:
    cpu = tput["cpu_per_1000"]
    parts = {
        k: cpu[k] * 1000 for k in ("caller_thread", "client_threads", "ranks", "redis") if k in cpu
    }
    return {
        "world": tput["world"],
        "window": tput["window"],
        "lookups_per_s": tput["lookups_per_s"],
        "cpu_us_per_lookup": {**parts, "total": sum(parts.values())},
    }


def _side(side: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "one_in_flight": {w: _one_in_flight(w, run) for w, run in side["latency"].items()}
    }
    if "throughput" in side:
        out["in_flight"] = _in_flight(side["throughput"])
    if "idle" in side:
        out["idle"] = side["idle"]
    return out


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """Per-lookup figures of each side (µs, ms, lookups/s), as the performance table shows them."""
    out: dict[str, Any] = {"ours": _side(results["ours"])}
    lm = results.get("lmcache")
    if lm:
        out["lmcache"] = {name: _side(run) for name, run in lm.items() if name != "hashing"}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def _world_ratios(ours: dict[str, float], theirs: dict[str, float]) -> dict[str, float | None]:
    keys = ("e2e_p50_ms", "e2e_p99_ms", "lookup_call_us", "rank_cpu_us_per_rank")
    out = {k: _ratio(ours[k], theirs[k]) for k in (*keys, "scheduler_cpu_us")}
    out["p50_ms"] = out["e2e_p50_ms"]  # the names of the issue-4 results
    out["p99_ms"] = out["e2e_p99_ms"]
    return out


def _hash_speedups(results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """LMCache's ns/token over ours: > 1 means ours is faster."""
    theirs = results["lmcache"].get("hashing", {})
    return {
        n: {
            kind: _ratio(theirs.get(n, {}).get(f"{kind}_ns_per_token"), row[f"{kind}_ns_per_token"])
            for kind in ("list", "tensor")
        }
        for n, row in results["hashing"].items()
    }


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """ours / LMCache for every shared figure, per LMCache client variant (< 1: we win, except
    throughput and hashing speed-up, where > 1 is a win). Needs ``results["figures"]``."""
    ours = results["figures"]["ours"]
    speedups = _hash_speedups(results)
    out: dict[str, Any] = {}
    for variant, lm in results["figures"]["lmcache"].items():
        per_world = {
            w: _world_ratios(run, lm["one_in_flight"][w])
            for w, run in ours["one_in_flight"].items()
            if w in lm["one_in_flight"]
        }
        mine = ours.get("in_flight", {})
        theirs = lm.get("in_flight", {})
        mine_cpu = mine.get("cpu_us_per_lookup", {})
        theirs_cpu = theirs.get("cpu_us_per_lookup", {})
        out[variant] = {
            "latency": per_world,
            "throughput": _ratio(mine.get("lookups_per_s"), theirs.get("lookups_per_s")),
            "in_flight_cpu_per_lookup": _ratio(mine_cpu.get("total"), theirs_cpu.get("total")),
            "in_flight_cpu_per_lookup_without_redis": _ratio(
                mine_cpu.get("total", 0) - mine_cpu.get("redis", 0), theirs_cpu.get("total")
            ),
            "hashing_speedup": speedups,
            "idle": {
                k: _ratio(ours.get("idle", {}).get(k), lm.get("idle", {}).get(k))
                for k in ("rank_ms_per_s", "scheduler_ms_per_s")
            },
        }
    return out


def _target(
    name: str, value: float | None, limit: float, at_most: bool = True, unit: str = "x"
) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {
        "name": name,
        "limit": limit,
        "at_most": at_most,
        "unit": unit,
        "value": value,
        "met": met,
    }


def _caller_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The caller's own costs (absolute): they hold with or without LMCache."""
    lat = results["ours"]["latency"]
    pending = results["ours"]["pending"]
    cache_us = max(
        pending["lookup_cache_pending_1_us"],
        pending["lookup_cache_pending_n_us"],
        pending["lookup_cache_unknown_us"],
    )
    call_us = max(run["lookup_call_us"] for run in lat.values())
    n = pending["pending"]
    tokens = results["meta"]["options"]["tokens"]
    growth_cache = pending["lookup_cache_pending_n_us"] / pending["lookup_cache_pending_1_us"]
    growth_call = pending["lookup_call_last_100_us"] / pending["lookup_call_first_100_us"]
    return [
        _target("lookup_cache (tight loop, worst state)", cache_us, _LOOKUP_CACHE_US, unit="µs"),
        _target(f"lookup(), {tokens} tokens", call_us, _LOOKUP_CALL_US, unit="µs"),
        _target(f"lookup_cache at {n} pending / at 1", growth_cache, _GROWTH_SLACK),
        _target(f"lookup() last 100 / first 100 of {n} pending", growth_call, _GROWTH_SLACK),
    ]


def _one_in_flight_targets(worlds: list[str], lat: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for w in worlds:
        r = lat.get(w, {})
        out.append(
            _target(
                f"rank CPU per lookup, one in flight, world {w}",
                r.get("rank_cpu_us_per_rank"),
                _CPU_LIMIT,
            )
        )
        out.append(
            _target(
                f"scheduler process CPU per lookup, one in flight, world {w}",
                r.get("scheduler_cpu_us"),
                _CPU_LIMIT,
            )
        )
    for w in (w for w in _E2E_WORLDS if w in worlds):
        r = lat.get(w, {})
        out.append(_target(f"e2e p50, world {w}", r.get("e2e_p50_ms"), _E2E_P50_LIMIT))
        out.append(_target(f"e2e p99, world {w}", r.get("e2e_p99_ms"), _E2E_P99_LIMIT))
    return out


def _ratio_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The ratio targets: ours / LMCache backoff 0 (value None without ``--vs-lmcache``)."""
    r = results.get("ratios", {}).get(RATIO_VARIANT, {})
    tput = results["ours"].get("throughput", {})
    out = _one_in_flight_targets(list(results["ours"]["latency"]), r.get("latency", {}))
    where = f"{tput.get('window')} in flight, world {tput.get('world')}"
    out.append(_target(f"throughput, {where}", r.get("throughput"), _THROUGHPUT_LIMIT, False))
    out.append(
        _target(
            f"total CPU per lookup (Redis included), {where}",
            r.get("in_flight_cpu_per_lookup"),
            _CPU_LIMIT,
        )
    )
    speedups = r.get("hashing_speedup", {})
    for n in (n for n in results["hashing"] if int(n) in HASH_TARGET_SIZES):
        for kind in ("list", "tensor"):
            value = speedups.get(n, {}).get(kind)
            out.append(
                _target(
                    f"hashing speed-up, {kind} at {n} tokens (LMCache ns / ours)",
                    value,
                    _HASH_SPEEDUP_LIMIT,
                    False,
                )
            )
    return out


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its measured value; ``met`` is None when not measured. Ratio targets
    are ours / LMCache backoff 0 of the same run, caller targets absolute."""
    return _caller_targets(results) + _ratio_targets(results)
