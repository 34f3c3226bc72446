"""``python -m benchmarks.bench`` results as a table: each figure, ours / LMCache, targets."""

from __future__ import annotations

from typing import Any

from benchmarks.bench.figures import RATIO_VARIANT

__all__ = ["render"]

_LM0 = RATIO_VARIANT


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _latency_rows(results: dict[str, Any]) -> list[str]:
    lm = results.get("lmcache")
    head = f"{'world':>5} | {'ours p50':>8} {'p99':>7} {'max':>7} {'call µs':>7}"
    if lm:
        head += " | LMCache 10ms p50   p99 | LMCache 0 p50    p99 | ours/LM0 p50  p99"
    rows = [head]
    for world, run in results["ours"]["latency"].items():
        e = run["e2e"]
        row = f"{world:>5} | {_f(e['p50_ms']):>8} {_f(e['p99_ms']):>7} {_f(e['max_ms']):>7}"
        row += f" {_f(run['lookup_call_us'], 1):>7}"
        if lm:
            d = lm["default"]["latency"].get(world, {}).get("e2e", {})
            z = lm[_LM0]["latency"].get(world, {}).get("e2e", {})
            r = results["ratios"][_LM0]["latency"].get(world, {})
            row += f" | {_f(d.get('p50_ms')):>16} {_f(d.get('p99_ms')):>5}"
            row += f" | {_f(z.get('p50_ms')):>13} {_f(z.get('p99_ms')):>6}"
            row += f" | {_f(r.get('p50_ms')):>12} {_f(r.get('p99_ms')):>4}"
        rows.append(row)
    return rows


def _throughput_rows(results: dict[str, Any]) -> list[str]:
    ours = results["ours"]
    t = ours.get("throughput", {})
    rows = [
        f"ours: {_f(t.get('lookups_per_s'), 0)} lookups/s with {t.get('window')} in flight at "
        f"world {t.get('world')} (queueing p50 {_f(t.get('latency', {}).get('p50_ms'))} ms)"
    ]
    for name, run in results.get("lmcache", {}).items():
        if name in ("default", "backoff0") and "throughput" in run:
            rows.append(f"LMCache {name}: {_f(run['throughput']['lookups_per_s'], 0)} lookups/s")
    if "ratios" in results:
        rows.append(f"ours / LMCache {_LM0}: {_f(results['ratios'][_LM0]['throughput'])}x")
    for n, run in ours.get("engines", {}).items():
        rows.append(
            f"{n:>3} engine(s) x {run['ranks_per_engine']} rank(s), {run['window_per_engine']} "
            f"in flight each: {_f(run['lookups_per_s'], 0)} lookups/s in all "
            f"(worst engine p99 {_f(run['p99_ms_max'])} ms)"
        )
    return rows


def _cpu_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    t = results["ours"].get("throughput", {}).get("cpu_per_1000")
    if t:
        rows.append(
            f"ours (throughput run): caller {_f(t['caller_thread'], 3)}, client threads "
            f"{_f(t['client_threads'], 3)}, ranks {_f(t['ranks'], 3)}, redis {_f(t['redis'], 3)}"
        )
    for name, run in results.get("lmcache", {}).items():
        c = run.get("throughput", {}).get("cpu_per_1000") if isinstance(run, dict) else None
        if c:
            rows.append(
                f"LMCache {name}: caller {_f(c['caller_thread'], 3)}, client threads "
                f"{_f(c['client_threads'], 3)}, ranks {_f(c['ranks'], 3)}"
            )
    return rows


def _us(side: dict[str, Any] | None, world: str, key: str) -> float | None:
    value: float | None = (side or {}).get("one_in_flight", {}).get(world, {}).get(key)
    return value


def _one_in_flight_cpu_rows(results: dict[str, Any]) -> list[str]:
    figs = results["figures"]
    ours = figs["ours"]
    lm0 = figs.get("lmcache", {}).get(_LM0)
    ratio = results.get("ratios", {}).get(_LM0, {}).get("latency", {})
    rows = [
        f"{'world':>5} | {'rank: ours':>10} {'LM0':>6} {'ratio':>5} | "
        f"{'scheduler process: ours (caller + threads)':>42} {'LM0 (caller + threads)':>22} "
        f"{'ratio':>5} | {'ours Redis':>10} | {'polls: ours':>11} {'LM0':>4}"
    ]
    for w in ours["one_in_flight"]:
        r = ratio.get(w, {})

        def sched(side: dict[str, Any] | None, world: str = w) -> str:
            if _us(side, world, "scheduler_cpu_us") is None:
                return "-"
            total = _f(_us(side, world, "scheduler_cpu_us"), 0)
            caller = _f(_us(side, world, "caller_thread_cpu_us"), 0)
            threads = _f(_us(side, world, "client_threads_cpu_us"), 0)
            return f"{total} ({caller} + {threads})"

        rows.append(
            f"{w:>5} | {_f(_us(ours, w, 'rank_cpu_us_per_rank'), 0):>10}"
            f" {_f(_us(lm0, w, 'rank_cpu_us_per_rank'), 0):>6}"
            f" {_f(r.get('rank_cpu_us_per_rank')):>5} | {sched(ours):>42} {sched(lm0):>22}"
            f" {_f(r.get('scheduler_cpu_us')):>5} | {_f(_us(ours, w, 'redis_cpu_us'), 0):>10}"
            f" | {_f(_us(ours, w, 'polls_per_lookup'), 1):>11}"
            f" {_f(_us(lm0, w, 'polls_per_lookup'), 1):>4}"
        )
    return rows


def _in_flight_cpu_rows(results: dict[str, Any]) -> list[str]:
    sides = {"ours": results["figures"]["ours"]}
    for name, side in results["figures"].get("lmcache", {}).items():
        sides[f"LMCache {name}"] = side
    rows = []
    for name, side in sides.items():
        c = side.get("in_flight", {}).get("cpu_us_per_lookup")
        if not c:
            continue
        redis_part = f" + Redis {_f(c['redis'], 1)}" if "redis" in c else ""
        rows.append(
            f"{name}: caller {_f(c['caller_thread'], 1)} + client threads "
            f"{_f(c['client_threads'], 1)} + ranks {_f(c['ranks'], 1)}{redis_part}"
            f" = {_f(c['total'], 1)}"
        )
    r = results.get("ratios", {}).get(_LM0)
    if r:
        rows.append(
            f"ours / LMCache {_LM0}: {_f(r['in_flight_cpu_per_lookup'])}x with Redis, "
            f"{_f(r['in_flight_cpu_per_lookup_without_redis'])}x without"
        )
    return rows


def _idle_rows(results: dict[str, Any]) -> list[str]:
    figs = results["figures"]
    ours = figs["ours"].get("idle")
    if not ours:
        return []
    lm0 = figs.get("lmcache", {}).get(_LM0, {}).get("idle", {})
    ratio = results.get("ratios", {}).get(_LM0, {}).get("idle", {})
    rows = [f"{'':>18} {'ours':>6} {'LM0':>6} {'ratio':>5}"]
    for key, name in (("rank_ms_per_s", "rank process"), ("scheduler_ms_per_s", "scheduler")):
        rows.append(
            f"{name:>18} {_f(ours.get(key)):>6} {_f(lm0.get(key)):>6} {_f(ratio.get(key)):>5}"
        )
    return rows


def _hash_rows(results: dict[str, Any]) -> list[str]:
    lm = results.get("lmcache", {}).get("hashing", {})
    speedup = results.get("ratios", {}).get(_LM0, {}).get("hashing_speedup", {})
    rows = [f"{'tokens':>7} | ours list tensor | LMCache list tensor | LMCache / ours list tensor"]
    for n, row in results["hashing"].items():
        other = lm.get(n, {})
        rows.append(
            f"{n:>7} | {_f(row['list_ns_per_token'], 1):>9} {_f(row['tensor_ns_per_token'], 1):>6}"
            f" | {_f(other.get('list_ns_per_token'), 1):>12}"
            f" {_f(other.get('tensor_ns_per_token'), 1):>6}"
            f" | {_f(speedup.get(n, {}).get('list')):>21}"
            f" {_f(speedup.get(n, {}).get('tensor')):>6}"
        )
    return rows


def _load(meta: dict[str, Any]) -> str:
    ours = f"{meta['loadavg_start'][0]:.1f}"
    lm = meta.get("loadavg_lmcache_start")
    if lm is None:
        return ours
    uneven = (
        lm[0] > 1.5 * meta["loadavg_start"][0] + 1 or meta["loadavg_start"][0] > 1.5 * lm[0] + 1
    )
    note = " (uneven: read the ratios with care)" if uneven else ""
    return f"{ours} at our start, {lm[0]:.1f} at LMCache's{note}"


def _caller_rows(results: dict[str, Any]) -> list[str]:
    p = results["ours"]["pending"]
    return [
        f"Caller cost (µs): lookup_cache unknown {_f(p['lookup_cache_unknown_us'], 3)}, "
        f"pending with 1 {_f(p['lookup_cache_pending_1_us'], 3)}, with {p['pending']} "
        f"{_f(p['lookup_cache_pending_n_us'], 3)}; lookup() first 100 "
        f"{_f(p['lookup_call_first_100_us'], 1)}, last 100 {_f(p['lookup_call_last_100_us'], 1)}",
        f"Redis memory per in-flight lookup: {_f(p['key_bytes_per_lookup'], 0)} bytes in keys "
        f"(hash {_f(p['lookup_hash_bytes'], 0)} + stream entry {_f(p['stream_entry_bytes'], 0)});"
        f" used_memory grew {_f(p['redis_bytes_per_lookup'], 0)} bytes per lookup",
    ]


def _target_rows(results: dict[str, Any]) -> list[str]:
    rows = [f"Targets (ratios: ours / LMCache {_LM0} of this run)"]
    for t in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        bound = "<=" if t.get("at_most", True) else ">="
        unit = t.get("unit", "")
        rows.append(
            f"  {verdict:>6}  {t['name']}: {_f(t['value'])}{unit if t['value'] is not None else ''}"
            f" (target {bound} "
            f"{t['limit']:g}{unit})"
        )
    return rows


def render(results: dict[str, Any]) -> str:
    """The human-readable table of a results dict."""
    meta = results["meta"]
    opts = meta["options"]
    tput = results["ours"].get("throughput", {})
    lines = [
        f"benchmarks.bench ({'quick' if opts['quick'] else 'full'}; {meta['redis']['server']}"
        f" {meta['redis']['kind']}; {meta['cpus']} CPUs; load {_load(meta)};"
        f" {opts['tokens']} tokens; poll every {opts['poll_us']:g} µs)",
        "",
        "End-to-end latency, one lookup in flight (ms)",
        *_latency_rows(results),
        "",
        "CPU per lookup, one lookup in flight (µs; rank: per rank process; scheduler process:"
        " the whole client process, the caller's polling loop included on both sides)",
        *_one_in_flight_cpu_rows(results),
        "",
        "Throughput",
        *_throughput_rows(results),
        "",
        f"CPU per lookup, {tput.get('window')} in flight, world {tput.get('world')} (µs)",
        *_in_flight_cpu_rows(results),
        "",
        *_caller_rows(results),
        "",
        "Idle: no lookup, every rank process up, one client (ms of CPU a second; scheduler:"
        " the client's threads)",
        *_idle_rows(results),
        "",
        "CPU seconds per 1,000 lookups (throughput runs)",
        *_cpu_rows(results),
        "",
        "Hashing (ns/token)",
        *_hash_rows(results),
        "",
        *_target_rows(results),
    ]
    return "\n".join(lines)
