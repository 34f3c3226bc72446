"""``python -m benchmarks.bench.probe_load``: do an engine's lookups pay for the fleet query?

Paired, as ``--paired``: one engine's rank (the bench's own, ``our_ranks``) serves one
lookup in flight at a time, in rounds of three sides, their order rotating: no probes;
a steady probe load (``--rate`` fleet queries a second, from another process) aimed at a
sibling engine's rank on the same server (the control: the box and the server carry the
same load, this rank none of it); the same load aimed at this engine. Per round: the
lookups' p50 and p99 and this rank's CPU per lookup. A drift of the box's load falls on
every side of a round alike, so the medians of the per-round ratios are the figures:
``self / sibling`` is what answering probes costs this rank's lookups, ``sibling / none``
what the load costs the box. The rank's CPU per probe is the difference of the self and
sibling sides' CPU over the probes it answered.

    python -m benchmarks.bench.probe_load --rounds 20 --lookups 300 --rate 200
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Any

from benchmarks.bench.measure import BenchOptions, Prompts, cpu_seconds_of, sequential_latency
from benchmarks.bench.ours import client_for, engine_id, rank_host
from broker_lookup import FleetClient, LookupConfig

__all__ = ["main", "probe_load"]


def _drive(url: str, targets: list[str], rate: float, tokens: int, mode: Any, done: Any) -> None:
    """The probe load (its own process): ``rate`` queries a second to ``targets[mode - 1]``
    while ``mode`` is not 0, until it is -1."""
    fleet = FleetClient(LookupConfig(redis_url=url), deadline_ms=100)
    prompt = Prompts(tokens, seed=1).get(0)
    gap = 1.0 / rate
    try:
        while mode.value >= 0:
            if mode.value == 0:
                time.sleep(0.01)
                continue
            due, aim = time.monotonic(), mode.value
            while mode.value == aim:
                answer = fleet.query(prompt, engines=[targets[aim - 1]])
                with done.get_lock():
                    done.value += sum(len(e.answered) for e in answer.engines)
                due += gap
                time.sleep(max(0.0, due - time.monotonic()))
    finally:
        fleet.close()


_SIDES = ("none", "sibling", "self")


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(y / x for x, y in zip(a, b, strict=True) if x > 0)


def probe_load(url: str, rounds: int, lookups: int, rate: float, tokens: int) -> dict[str, Any]:
    """``rounds`` rounds of the three sides (see the module docstring)."""
    opts = BenchOptions.defaults(False, lookups=lookups, tokens=tokens)
    run_id = uuid.uuid4().hex[:8]
    eid, sibling = engine_id(run_id, "probe-load"), engine_id(run_id, "sibling")
    spawn = multiprocessing.get_context("spawn")
    mode, done = spawn.Value("i", 0), spawn.Value("q", 0)
    sides: list[dict[str, list[float]]] = [{"p50": [], "p99": [], "cpu": []} for _ in _SIDES]
    probes = 0
    with ExitStack() as stack:
        hosts = stack.enter_context(rank_host(opts, url, {eid: 1, sibling: 1}))
        pids = list(hosts[eid].values())
        client = client_for(url, eid, 1)
        stack.callback(client.close)
        driver = spawn.Process(target=_drive, args=(url, [sibling, eid], rate, tokens, mode, done))
        driver.start()
        stack.callback(driver.join, 10)
        stack.callback(setattr, mode, "value", -1)
        prompts = Prompts(tokens)
        sequential_latency(client, prompts, opts.warmup, 0, opts.poll_s, "w")
        for r in range(rounds):
            for k in range(len(_SIDES)):
                side = (k + r) % len(_SIDES)
                mode.value = side
                if side:
                    time.sleep(0.2)  # the load is steady before the round starts
                before, answered = cpu_seconds_of(pids), done.value
                run = sequential_latency(client, prompts, lookups, 0, opts.poll_s, f"r{r}s{side}")
                sides[side]["cpu"].append((cpu_seconds_of(pids) - before) * 1e6 / lookups)
                sides[side]["p50"].append(run["e2e"]["p50_ms"])
                sides[side]["p99"].append(run["e2e"]["p99_ms"])
                if side == 2:
                    probes += done.value - answered
                mode.value = 0
    spent = sum(sides[2]["cpu"]) - sum(sides[1]["cpu"])
    return {
        "rounds": rounds,
        "lookups_per_round": lookups,
        "tokens": tokens,
        "probe_rate_per_s": rate,
        "probes_answered_in_rounds": probes,
        "sides": {
            name: {k: statistics.median(v) for k, v in s.items()}
            for name, s in zip(_SIDES, sides, strict=True)
        },
        "self_over_sibling": {k: _ratio(sides[1][k], sides[2][k]) for k in sides[0]},
        "sibling_over_none": {k: _ratio(sides[0][k], sides[1][k]) for k in sides[0]},
        "rank_cpu_us_per_probe": spent * lookups / probes if probes else None,
    }


def render(result: dict[str, Any]) -> str:
    """The run as a short table."""
    lines = [
        f"lookups under {result['probe_rate_per_s']:g} fleet queries/s: {result['rounds']} "
        f"rounds of 3 sides x {result['lookups_per_round']} lookups "
        f"({result['tokens']} tokens), one in flight, world 1",
        f"  {'probes aimed at':<22}{'p50 ms':>8}{'p99 ms':>8}{'rank µs/lookup':>16}",
    ]
    for name, side in result["sides"].items():
        lines.append(f"  {name:<22}{side['p50']:>8.3f}{side['p99']:>8.3f}{side['cpu']:>16.1f}")
    for label, key in (
        ("self / sibling", "self_over_sibling"),
        ("sibling / none", "sibling_over_none"),
    ):
        r = result[key]
        lines.append(f"  {label:<22}{r['p50']:>8.3f}{r['p99']:>8.3f}{r['cpu']:>16.3f}")
    per_probe = result["rank_cpu_us_per_probe"]
    if per_probe is not None:
        lines.append(
            f"  rank CPU per probe answered: {per_probe:.1f} µs "
            f"({result['probes_answered_in_rounds']} probes in the measured rounds)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run it on ``--redis-url`` or an embedded server; print the table (or JSON)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.probe_load", description=__doc__)
    p.add_argument("--redis-url", help="default: an embedded Valkey")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--lookups", type=int, default=300, help="lookups per round a side")
    p.add_argument("--rate", type=float, default=200.0, help="fleet queries a second")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with ExitStack() as stack:
        url = args.redis_url
        if url is None:
            from broker_lookup.tools.embedded import EmbeddedServer

            server = EmbeddedServer().start()
            stack.callback(server.stop)
            url = server.url
        result = probe_load(url, args.rounds, args.lookups, args.rate, args.tokens)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
