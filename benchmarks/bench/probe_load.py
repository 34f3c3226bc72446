"""``python -m benchmarks.bench.probe_load``: do an engine's lookups pay for the fleet query?

Paired, as ``--paired``: one engine's ranks (the bench's own, ``our_ranks``) serve one
lookup in flight at a time, in alternating rounds with and without a steady probe load
(``--rate`` fleet queries a second for the same engine, from another process, so only the
ranks and the server share the load). Per round: the lookups' p50 and p99 and the rank
processes' CPU per lookup. A drift of the box's load falls on both sides of a round pair
alike, so the median of the per-round ratios (with / without) is the figure; the rank's
CPU per probe is the difference of the two sides' CPU over the probes answered.

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


def _drive(url: str, eid: str, rate: float, tokens: int, on: Any, stop: Any, done: Any) -> None:
    """The probe load (its own process): ``rate`` queries a second while ``on`` is set."""
    fleet = FleetClient(LookupConfig(redis_url=url), deadline_ms=100)
    prompt = Prompts(tokens, seed=1).get(0)
    gap = 1.0 / rate
    try:
        while not stop.is_set():
            if not on.wait(0.1):
                continue
            due = time.monotonic()
            while on.is_set() and not stop.is_set():
                answer = fleet.query(prompt, engines=[eid])
                with done.get_lock():
                    done.value += sum(len(e.answered) for e in answer.engines)
                due += gap
                time.sleep(max(0.0, due - time.monotonic()))
    finally:
        fleet.close()


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(y / x for x, y in zip(a, b, strict=True) if x > 0)


def probe_load(url: str, rounds: int, lookups: int, rate: float, tokens: int) -> dict[str, Any]:
    """Alternating rounds without (side 0) and with (side 1) the probe load."""
    opts = BenchOptions.defaults(False, lookups=lookups, tokens=tokens)
    eid = engine_id(uuid.uuid4().hex[:8], "probe-load")
    spawn = multiprocessing.get_context("spawn")
    on, stop, done = spawn.Event(), spawn.Event(), spawn.Value("q", 0)
    sides: list[dict[str, list[float]]] = [{"p50": [], "p99": [], "cpu": []} for _ in (0, 1)]
    probes = 0
    with ExitStack() as stack:
        pids = list(stack.enter_context(rank_host(opts, url, {eid: 1}))[eid].values())
        client = client_for(url, eid, 1)
        stack.callback(client.close)
        driver = spawn.Process(target=_drive, args=(url, eid, rate, tokens, on, stop, done))
        driver.start()
        stack.callback(driver.join, 10)
        stack.callback(stop.set)
        prompts = Prompts(tokens)
        sequential_latency(client, prompts, opts.warmup, 0, opts.poll_s, "w")
        for r in range(rounds):
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                if side:
                    on.set()
                    time.sleep(0.2)  # the load is steady before the round starts
                before, answered = cpu_seconds_of(pids), done.value
                run = sequential_latency(client, prompts, lookups, 0, opts.poll_s, f"r{r}s{side}")
                sides[side]["cpu"].append((cpu_seconds_of(pids) - before) * 1e6 / lookups)
                sides[side]["p50"].append(run["e2e"]["p50_ms"])
                sides[side]["p99"].append(run["e2e"]["p99_ms"])
                if side:
                    probes += done.value - answered
                    on.clear()
    off_cpu, on_cpu = (statistics.median(s["cpu"]) for s in sides)
    return {
        "rounds": rounds,
        "lookups_per_round": lookups,
        "tokens": tokens,
        "probe_rate_per_s": rate,
        "probes_answered_in_rounds": probes,
        "sides": [{k: statistics.median(v) for k, v in s.items()} for s in sides],
        "ratio_with_over_without": {k: _ratio(sides[0][k], sides[1][k]) for k in sides[0]},
        "rank_cpu_us_per_probe": (
            (on_cpu - off_cpu) * lookups * rounds / probes if probes else None
        ),
    }


def render(result: dict[str, Any]) -> str:
    """The run as a short table."""
    off, on = result["sides"]
    ratio = result["ratio_with_over_without"]
    lines = [
        f"lookups with and without {result['probe_rate_per_s']:g} fleet queries/s: "
        f"{result['rounds']} alternating rounds of {result['lookups_per_round']} lookups "
        f"({result['tokens']} tokens), one in flight, world 1",
        f"  {'':<16}{'p50 ms':>8}{'p99 ms':>8}{'rank µs/lookup':>16}",
        f"  {'without probes':<16}{off['p50']:>8.3f}{off['p99']:>8.3f}{off['cpu']:>16.1f}",
        f"  {'with probes':<16}{on['p50']:>8.3f}{on['p99']:>8.3f}{on['cpu']:>16.1f}",
        f"  {'with / without':<16}{ratio['p50']:>8.3f}{ratio['p99']:>8.3f}{ratio['cpu']:>16.3f}",
    ]
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
