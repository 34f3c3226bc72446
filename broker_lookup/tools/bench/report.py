"""``broker-lookup bench`` results: targets met or missed, ours/LMCache ratios, the table."""

from __future__ import annotations

from typing import Any

__all__ = ["evaluate_targets", "ratios", "render"]

#: (name, limit, unit): "<=" targets unless the unit says "/s".
_E2E_TARGETS = {"4": (0.8, 2.5), "8": (1.5, 4.0)}
_GROWTH_SLACK = 1.5  #: "nothing grows with pending count": n-pending cost <= 1.5x the 1-pending


def _target(name: str, value: float | None, limit: float, at_most: bool = True) -> dict[str, Any]:
    met = None if value is None else (value <= limit if at_most else value >= limit)
    return {"name": name, "limit": limit, "value": value, "met": met}


def _hash_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    row = results.get("hashing", {}).get("131072")
    return [
        _target("hashing list ns/token at 128k", row and row["list_ns_per_token"], 8.0),
        _target("hashing tensor ns/token at 128k", row and row["tensor_ns_per_token"], 10.0),
    ]


def _growth_targets(pending: dict[str, Any]) -> list[dict[str, Any]]:
    one = pending["lookup_cache_pending_1_us"]
    many = pending["lookup_cache_pending_n_us"]
    first = pending["lookup_call_first_100_us"]
    last = pending["lookup_call_last_100_us"]
    n = pending["pending"]
    return [
        _target(f"lookup_cache at {n} pending / at 1 (x)", many / one, _GROWTH_SLACK),
        _target(f"lookup() last 100 / first 100 of {n} pending (x)", last / first, _GROWTH_SLACK),
    ]


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of issue #4 with its measured value; ``met`` is None when not measured."""
    ours = results["ours"]
    lat = ours["latency"]
    pending = ours["pending"]
    cache_us = max(
        pending["lookup_cache_pending_1_us"],
        pending["lookup_cache_pending_n_us"],
        pending["lookup_cache_unknown_us"],
    )
    call_us = max(run["lookup_call_us"] for run in lat.values())
    out = [
        _target("lookup_cache µs (tight loop, worst state)", cache_us, 2.0),
        _target(f"lookup() µs, {results['meta']['options']['tokens']} tokens", call_us, 60.0),
    ]
    for world, (p50, p99) in _E2E_TARGETS.items():
        e2e = lat.get(world, {}).get("e2e")
        out.append(_target(f"e2e p50 ms, world {world}", e2e and e2e["p50_ms"], p50))
        out.append(_target(f"e2e p99 ms, world {world}", e2e and e2e["p99_ms"], p99))
    tput = ours.get("throughput", {})
    out.append(
        _target(
            f"lookups/s, {tput.get('window')} in flight, world {tput.get('world')}",
            tput.get("lookups_per_s"),
            10_000.0,
            at_most=False,
        )
    )
    return out + _hash_targets(results) + _growth_targets(pending)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """ours / LMCache for every shared measurement, per LMCache client variant (<1: we win,
    except throughput, where >1 is a win)."""
    ours = results["ours"]
    theirs = results["lmcache"]
    out: dict[str, Any] = {}
    for variant in ("default", "backoff0"):
        lm = theirs[variant]
        per_world = {}
        for world, run in ours["latency"].items():
            other = lm["latency"].get(world)
            if other is None:
                continue
            per_world[world] = {
                k: _ratio(run["e2e"][k], other["e2e"][k]) for k in ("p50_ms", "p99_ms", "max_ms")
            }
            per_world[world]["lookup_call_us"] = _ratio(
                run["lookup_call_us"], other["lookup_call_us"]
            )
        tput = _ratio(
            ours.get("throughput", {}).get("lookups_per_s"),
            lm.get("throughput", {}).get("lookups_per_s"),
        )
        out[variant] = {"latency": per_world, "throughput": tput}
    return out


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
            z = lm["backoff0"]["latency"].get(world, {}).get("e2e", {})
            r = results["ratios"]["backoff0"]["latency"].get(world, {})
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


def _hash_rows(results: dict[str, Any]) -> list[str]:
    lm = results.get("lmcache", {}).get("hashing", {})
    rows = [f"{'tokens':>7} | ours list tensor | LMCache list tensor"]
    for n, row in results["hashing"].items():
        other = lm.get(n, {})
        rows.append(
            f"{n:>7} | {_f(row['list_ns_per_token'], 1):>9} {_f(row['tensor_ns_per_token'], 1):>6}"
            f" | {_f(other.get('list_ns_per_token'), 1):>12}"
            f" {_f(other.get('tensor_ns_per_token'), 1):>6}"
        )
    return rows


def render(results: dict[str, Any]) -> str:
    """The human-readable table of a results dict."""
    meta = results["meta"]
    p = results["ours"]["pending"]
    opts = meta["options"]
    lines = [
        f"broker-lookup bench ({'quick' if opts['quick'] else 'full'}; {meta['redis']['server']}"
        f" {meta['redis']['kind']}; {meta['cpus']} CPUs; load {meta['loadavg_start'][0]:.1f};"
        f" {opts['tokens']} tokens; poll every {opts['poll_us']:g} µs)",
        "",
        "End-to-end latency, one lookup in flight (ms)",
        *_latency_rows(results),
        "",
        "Throughput",
        *_throughput_rows(results),
        "",
        f"Caller cost (µs): lookup_cache unknown {_f(p['lookup_cache_unknown_us'], 3)}, "
        f"pending with 1 {_f(p['lookup_cache_pending_1_us'], 3)}, with {p['pending']} "
        f"{_f(p['lookup_cache_pending_n_us'], 3)}; lookup() first 100 "
        f"{_f(p['lookup_call_first_100_us'], 1)}, last 100 {_f(p['lookup_call_last_100_us'], 1)}",
        f"Redis memory per in-flight lookup: {_f(p['key_bytes_per_lookup'], 0)} bytes in keys "
        f"(hash {_f(p['lookup_hash_bytes'], 0)} + stream entry {_f(p['stream_entry_bytes'], 0)});"
        f" used_memory grew {_f(p['redis_bytes_per_lookup'], 0)} bytes per lookup",
        "",
        "CPU seconds per 1,000 lookups",
        *_cpu_rows(results),
        "",
        "Hashing (ns/token)",
        *_hash_rows(results),
        "",
        "Targets",
    ]
    for t in results["targets"]:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
        lines.append(f"  {verdict:>6}  {t['name']}: {_f(t['value'])} (target {t['limit']:g})")
    return "\n".join(lines)
