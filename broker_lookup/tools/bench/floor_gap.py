"""``broker-lookup bench --floor``: ours against the protocol's floor (and LMCache), one in flight.

For each world size the same one-in-flight loop (:func:`measure.sequential_latency`) runs
on our client and ranks, then on the floor (:mod:`broker_lookup.tools.bench.floor`: the
same scripts and commands, none of the machinery), alternating which goes first from
one world to the next so a drift of the machine's load falls on both. With
``--vs-lmcache``, LMCache at backoff 0 runs the same loop afterwards.

The ratios say where a gap to LMCache comes from: ours / floor is what our
implementation adds over the protocol; floor / LMCache is what the broker's design costs
(two hops through Redis) in Python on this machine.

>>> out = floor_gap(BenchOptions.defaults(quick=True), url, "r1")   # doctest: +SKIP
>>> out["worlds"]["1"]["ratio"]["ours_floor"]["rank_cpu_us"]          # doctest: +SKIP
1.9
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import redis

from broker_lookup.tools.bench.floor import FloorClient
from broker_lookup.tools.bench.measure import (
    BenchOptions,
    LookupClientLike,
    Prompts,
    sequential_latency,
)
from broker_lookup.tools.bench.ours import (
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
_FLOOR_HOST = "broker_lookup.tools.bench.floor"


def _measure(
    opts: BenchOptions, url: str, client: LookupClientLike, pids: list[int], world: int, tag: str
) -> dict[str, Any]:
    """One side's figures at ``world``: the latency loop, with every process's CPU."""
    server = redis.Redis.from_url(url)
    try:
        meter = CpuMeter(pids, server)
        prompts = Prompts(opts.tokens)
        run = sequential_latency(client, prompts, opts.lookups, opts.warmup, opts.poll_s, tag)
        cpu = meter.per_1000(opts.lookups + opts.warmup)
    finally:
        server.close()
    return {
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


def _ours(opts: BenchOptions, url: str, run_id: str, world: int) -> dict[str, Any]:
    eid = engine_id(run_id, f"gap-ours-w{world}")
    with rank_host(opts, url, {eid: world}) as pids:
        client = client_for(url, eid, world)
        try:
            return _measure(opts, url, client, list(pids[eid].values()), world, "gap-ours")
        finally:
            client.close()


def _floor(opts: BenchOptions, url: str, run_id: str, world: int) -> dict[str, Any]:
    eid = engine_id(run_id, f"gap-floor-w{world}")
    with rank_host(opts, url, {eid: world}, module=_FLOOR_HOST) as pids:
        client = FloorClient(url, eid, world)
        try:
            return _measure(opts, url, client, list(pids[eid].values()), world, "gap-floor")
        finally:
            client.close()


_SIDES = {"ours": _ours, "floor": _floor}


def _lmcache(opts: BenchOptions, run_id: str) -> dict[str, dict[str, Any]]:
    """LMCache at backoff 0, the same loop per world (no throughput run)."""
    from broker_lookup.tools.bench.lmcache_side import bench_lmcache

    runs = bench_lmcache(replace(opts, throughput_world=0), run_id)[_LMCACHE]["latency"]
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
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {k: (a[k] / b[k] if a.get(k) and b.get(k) else None) for k, _ in FIGURES}


def floor_gap(opts: BenchOptions, url: str, run_id: str) -> dict[str, Any]:
    """Per world: each side's figures and the ratios ours / floor (and floor / LMCache).

    Raises:
        BenchError: a rank failed to start or a lookup never finished; with
            ``opts.vs_lmcache``, lmcache is missing.
    """
    worlds: dict[str, dict[str, Any]] = {}
    for i, world in enumerate(opts.worlds):
        order = ("ours", "floor") if i % 2 == 0 else ("floor", "ours")
        sides = {side: _SIDES[side](opts, url, run_id, world) for side in order}
        worlds[str(world)] = {
            **sides,
            "ratio": {"ours_floor": _ratio(sides["ours"], sides["floor"])},
        }
    if opts.vs_lmcache:
        for name, side in _lmcache(opts, run_id).items():
            entry = worlds[name]
            entry["lmcache"] = side
            entry["ratio"]["floor_lmcache"] = _ratio(entry["floor"], side)
            entry["ratio"]["ours_lmcache"] = _ratio(entry["ours"], side)
    return {"lookups_per_side": opts.lookups, "tokens": opts.tokens, "worlds": worlds}


def _cell(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.2f}"


def render_floor_gap(result: dict[str, Any]) -> str:
    """The table ``--floor`` prints: per world, each figure on each side and the ratios."""
    lines = [
        "ours against the protocol's floor, one lookup in flight "
        f"({result['lookups_per_side']} lookups a side, {result['tokens']} tokens)"
    ]
    for world, entry in result["worlds"].items():
        lm = "lmcache" in entry
        head = f"  world {world:<27}{'ours':>9}{'floor':>9}"
        head += f"{'LMCache':>9}" if lm else ""
        head += f"{'ours/fl':>9}" + (f"{'fl/LMC':>9}{'ours/LMC':>9}" if lm else "")
        lines.append(head)
        ratio = entry["ratio"]
        for key, label in FIGURES:
            row = f"    {label:<30}{_cell(entry['ours'][key], 9)}{_cell(entry['floor'][key], 9)}"
            if lm:
                row += _cell(entry["lmcache"][key], 9)
            row += _cell(ratio["ours_floor"][key], 9)
            if lm:
                row += _cell(ratio["floor_lmcache"][key], 9) + _cell(ratio["ours_lmcache"][key], 9)
            lines.append(row)
    return "\n".join(lines)
