"""``python -m benchmarks.bench --floor``: ours against the protocol's floor (and LMCache).

For each world size the same one-in-flight loop (:func:`measure.sequential_latency`) runs
on our client and ranks, on the floor (:mod:`benchmarks.bench.floor`: the same
scripts and commands, none of the machinery) and on the native floor (the floor's ranks
with their turn in C, where its optional extension was built), in an order that rotates
from one world to the next so a drift of the machine's load falls on all. With
``--vs-lmcache``, LMCache at backoff 0 runs the same loop afterwards.

The ratios say where a gap to LMCache comes from: ours / floor is what our
implementation adds over the protocol; floor / LMCache is what the broker's design costs
(two hops through Redis) in Python on this machine; native / LMCache is what it costs
when no Python but the request's decoding runs in a rank's turn. In flight, the floors'
rate against LMCache's bounds what any implementation of the protocol reaches here:
Redis shares the machine's cores, and its CPU per lookup is the protocol's.

>>> out = floor_gap(BenchOptions.defaults(quick=True), url, "r1")   # doctest: +SKIP
>>> out["worlds"]["1"]["ratio"]["ours_floor"]["rank_cpu_us"]          # doctest: +SKIP
1.9
"""

from __future__ import annotations

from typing import Any

import redis

from benchmarks.bench.floor import FloorClient, native_floor_built
from benchmarks.bench.measure import (
    BenchOptions,
    LookupClientLike,
    Prompts,
    closed_loop,
    sequential_latency,
)
from benchmarks.bench.ours import (
    CpuMeter,
    client_for,
    engine_id,
    rank_host,
)

__all__ = ["FIGURES", "floor_gap", "render_floor_gap"]

#: The figures compared, as (key, label).
FIGURES = (
    ("e2e_p50_ms", "e2e p50 ms"),
    ("e2e_p99_ms", "e2e p99 ms"),
    ("lookup_call_us", "lookup() median µs"),
    ("scheduler_cpu_us", "scheduler CPU µs/lookup"),
    ("rank_cpu_us", "rank CPU µs/lookup/rank"),
    ("redis_cpu_us", "Redis CPU µs/lookup"),
)
_LMCACHE = "backoff0"  #: the LMCache variant compared (lmcache_side.VARIANTS)
#: The floor's rank host (``floor.main``).
_FLOOR_HOST = "benchmarks.bench.floor"


#: The in-flight figures compared at the throughput world, as (key, label).
IN_FLIGHT_FIGURES = (
    ("lookups_per_s", "lookups/s"),
    ("cpu_us", "CPU µs/lookup, Redis incl."),
    ("client_cpu_us", "client process CPU µs/lookup"),
    ("ranks_cpu_us", "all ranks' CPU µs/lookup"),
    ("redis_cpu_us", "Redis CPU µs/lookup"),
)


def _measure(
    opts: BenchOptions, url: str, client: LookupClientLike, pids: list[int], world: int, tag: str
) -> dict[str, Any]:
    """One side's figures at ``world``: the latency loop, with every process's CPU; at the
    throughput world, ``in_flight`` too."""
    server = redis.Redis.from_url(url)
    try:
        meter = CpuMeter(pids, server)
        prompts = Prompts(opts.tokens)
        run = sequential_latency(client, prompts, opts.lookups, opts.warmup, opts.poll_s, tag)
        cpu = meter.per_1000(opts.lookups + opts.warmup)
        figures = {
            "e2e_p50_ms": run["e2e"]["p50_ms"],
            "e2e_p99_ms": run["e2e"]["p99_ms"],
            "lookup_call_us": run["lookup_call_us"],
            # per_1000 is seconds per 1,000 lookups = ms per lookup; x1000: µs per lookup.
            "scheduler_cpu_us": cpu["client_process"] * 1000,
            "rank_cpu_us": cpu["ranks"] * 1000 / world,
            "redis_cpu_us": cpu["redis"] * 1000,
            "polls_per_lookup": run["polls_per_lookup"],
            "results": run["results"],
        }
        if world == opts.throughput_world:
            figures["in_flight"] = _in_flight(opts, client, CpuMeter(pids, server), f"{tag}-tp")
    finally:
        server.close()
    return figures


def _in_flight(
    opts: BenchOptions, client: LookupClientLike, meter: CpuMeter, tag: str
) -> dict[str, Any]:
    """``opts.window`` lookups kept in flight: the rate, and CPU per lookup of the client
    process, the ranks and Redis together."""
    run = closed_loop(client, Prompts(opts.tokens), opts.window, opts.duration_s, opts.poll_s, tag)
    cpu = meter.per_1000(run["completed"])
    return {
        "lookups_per_s": run["lookups_per_s"],
        "cpu_us": (cpu["client_process"] + cpu["ranks"] + cpu["redis"]) * 1000,
        "client_cpu_us": cpu["client_process"] * 1000,
        "ranks_cpu_us": cpu["ranks"] * 1000,
        "redis_cpu_us": cpu["redis"] * 1000,
        "results": run["results"],
    }


def _ours(opts: BenchOptions, url: str, run_id: str, world: int) -> dict[str, Any]:
    eid = engine_id(run_id, f"gap-ours-w{world}")
    with rank_host(opts, url, {eid: world}) as pids:
        client = client_for(url, eid, world)
        try:
            return _measure(opts, url, client, list(pids[eid].values()), world, "gap-ours")
        finally:
            client.close()


def _floor_side(
    opts: BenchOptions, url: str, run_id: str, world: int, name: str, host_args: tuple[str, ...]
) -> dict[str, Any]:
    eid = engine_id(run_id, f"gap-{name}-w{world}")
    with rank_host(opts, url, {eid: world}, module=_FLOOR_HOST, host_args=host_args) as pids:
        client = FloorClient(url, eid, world)  # both floors share the floor's client
        try:
            return _measure(opts, url, client, list(pids[eid].values()), world, f"gap-{name}")
        finally:
            client.close()


def _floor(opts: BenchOptions, url: str, run_id: str, world: int) -> dict[str, Any]:
    return _floor_side(opts, url, run_id, world, "floor", ())


def _native(opts: BenchOptions, url: str, run_id: str, world: int) -> dict[str, Any]:
    return _floor_side(opts, url, run_id, world, "native", ("--native",))


_SIDES = {"ours": _ours, "floor": _floor, "native": _native}


def _lmcache(opts: BenchOptions, run_id: str) -> dict[str, dict[str, Any]]:
    """LMCache at backoff 0, the same loop per world, and its throughput run."""
    from benchmarks.bench.lmcache_side import bench_lmcache

    measured = bench_lmcache(opts, run_id)[_LMCACHE]
    runs = measured["latency"]
    out: dict[str, dict[str, Any]] = {}
    for world, run in runs.items():
        cpu = run["cpu_per_1000"]
        out[world] = {
            "e2e_p50_ms": run["e2e"]["p50_ms"],
            "e2e_p99_ms": run["e2e"]["p99_ms"],
            "lookup_call_us": run["lookup_call_us"],
            "scheduler_cpu_us": cpu["client_process"] * 1000,
            "rank_cpu_us": cpu["ranks"] * 1000 / int(world),
            "redis_cpu_us": None,  # no broker
            "polls_per_lookup": run["polls_per_lookup"],
            "results": run["results"],
        }
    tput = measured.get("throughput")
    if tput is not None:
        cpu = tput["cpu_per_1000"]
        out[str(tput["world"])]["in_flight"] = {
            "lookups_per_s": tput["lookups_per_s"],
            "cpu_us": (cpu["client_process"] + cpu["ranks"]) * 1000,
            "client_cpu_us": cpu["client_process"] * 1000,
            "ranks_cpu_us": cpu["ranks"] * 1000,
            "redis_cpu_us": None,  # no broker
        }
    return out


def _ratio(
    a: dict[str, Any], b: dict[str, Any], figures: tuple[tuple[str, str], ...] = FIGURES
) -> dict[str, float | None]:
    return {k: (a[k] / b[k] if a.get(k) and b.get(k) else None) for k, _ in figures}


#: The ratios each table prints, as (key, numerator, denominator).
_RATIOS = (
    ("ours_floor", "ours", "floor"),
    ("floor_lmcache", "floor", "lmcache"),
    ("native_lmcache", "native", "lmcache"),
    ("ours_lmcache", "ours", "lmcache"),
)


def _in_flight_table(worlds: dict[str, dict[str, Any]], opts: BenchOptions) -> dict[str, Any]:
    """The throughput world's in-flight figures per side, and their ratios."""
    entry = worlds.get(str(opts.throughput_world), {})
    sides = {k: v["in_flight"] for k, v in entry.items() if k != "ratio" and "in_flight" in v}
    ratio = {
        key: _ratio(sides[a], sides[b], IN_FLIGHT_FIGURES)
        for key, a, b in _RATIOS
        if a in sides and b in sides
    }
    return {"world": opts.throughput_world, "window": opts.window, **sides, "ratio": ratio}


def floor_gap(opts: BenchOptions, url: str, run_id: str) -> dict[str, Any]:
    """Per world: each side's figures and the ratios ours / floor (and floor / LMCache).

    Raises:
        BenchError: a rank failed to start or a lookup never finished; with
            ``opts.vs_lmcache``, lmcache is missing.
    """
    names = [*_SIDES] if native_floor_built() else ["ours", "floor"]
    worlds: dict[str, dict[str, Any]] = {}
    for i, world in enumerate(opts.worlds):
        order = names[i % len(names) :] + names[: i % len(names)]
        sides = {side: _SIDES[side](opts, url, run_id, world) for side in order}
        worlds[str(world)] = sides
    if opts.vs_lmcache:
        for name, side in _lmcache(opts, run_id).items():
            worlds[name]["lmcache"] = side
    in_flight = _in_flight_table(worlds, opts)
    for entry in worlds.values():
        entry["ratio"] = {
            key: _ratio(entry[a], entry[b]) for key, a, b in _RATIOS if a in entry and b in entry
        }
    return {
        "lookups_per_side": opts.lookups,
        "tokens": opts.tokens,
        "native_built": "native" in names,
        "worlds": worlds,
        "in_flight": in_flight,
    }


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def _columns(entry: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The table's columns for one world, as (title, figures): the sides, then the ratios."""
    ratio = entry["ratio"]
    sides = [(t, entry[k]) for t, k in _SIDE_TITLES if k in entry]
    ratios = [(t, ratio[k]) for t, k in _RATIO_TITLES if k in ratio]
    return sides + ratios


_SIDE_TITLES = (("ours", "ours"), ("floor", "floor"), ("native", "native"), ("LMCache", "lmcache"))
_RATIO_TITLES = (
    ("ours/fl", "ours_floor"),
    ("fl/LMC", "floor_lmcache"),
    ("nat/LMC", "native_lmcache"),
    ("ours/LMC", "ours_lmcache"),
)


def render_floor_gap(result: dict[str, Any]) -> str:
    """The table ``--floor`` prints: per world, each figure on each side and the ratios."""
    lines = [
        "ours against the protocol's floor, one lookup in flight "
        f"({result['lookups_per_side']} lookups a side, {result['tokens']} tokens)"
    ]
    if not result.get("native_built", True):
        lines.append("  (no native floor: its optional C extension was not compiled)")
    for world, entry in result["worlds"].items():
        lines += _table(f"world {world}", _columns(entry), FIGURES)
    in_flight = result.get("in_flight", {})
    if in_flight.get("ratio"):
        title = f"{in_flight['window']} in flight, world {in_flight['world']}"
        lines += _table(title, _columns(in_flight), IN_FLIGHT_FIGURES)
    return "\n".join(lines)


def _table(
    title: str, columns: list[tuple[str, dict[str, Any]]], figures: tuple[tuple[str, str], ...]
) -> list[str]:
    lines = [f"  {title:<33}" + "".join(f"{t:>9}" for t, _ in columns)]
    for key, label in figures:
        lines.append(f"    {label:<30}" + "".join(_cell(c.get(key), 9) for _, c in columns))
    return lines
