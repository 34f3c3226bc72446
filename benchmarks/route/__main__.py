"""``python -m benchmarks.route``: route a request trace by the fleet query (with and without
reservation), by an event-fed index at several lags, and round robin; measure the query.

Per arm, a fresh fleet of reference engines with finite memory (they evict, least recently
used first) behind in-process ranks on one server replays the same seeded trace (prompts
sharing prefixes, :mod:`benchmarks.route.trace`) with the same restarts
(:mod:`benchmarks.route.simulate`). Figures per arm: tokens reused per request, and the
false-hit rate: requests routed expecting N tokens whose engine's own lookup found fewer.
Then the query alone over 4, 8 and 16 engines of process ranks: p50/p99 and Redis CPU
per query (:mod:`benchmarks.route.latency`).

    python -m benchmarks.route            # the full run
    python -m benchmarks.route --quick    # seconds: CI's smoke run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Any

import redis

from benchmarks.route.fleet import Fleet
from benchmarks.route.latency import query_cost
from benchmarks.route.policies import EventIndex, FleetQuery, Policy, RoundRobin
from benchmarks.route.report import render
from benchmarks.route.simulate import run_arm
from benchmarks.route.trace import make_trace
from broker_lookup import FleetClient, LookupConfig

__all__ = ["main", "run"]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers separated by commas") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 0")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of requests a second > 0")
    return value


def parser() -> argparse.ArgumentParser:
    """The command's options; ``--quick`` replaces the sizes' defaults."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.route",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--redis-url", help="default: an embedded Valkey")
    p.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    p.add_argument("--engines", type=_positive, help="engines routed to (default 8; quick 4)")
    p.add_argument("--capacity", type=_positive, default=40, help="chunks each engine holds")
    p.add_argument("--requests", type=_positive, help="requests per arm (default 2000; quick 150)")
    p.add_argument("--groups", type=_positive, default=48, help="shared prefixes in the trace")
    p.add_argument("--prefix-chunks", type=_positive, default=4)
    p.add_argument("--own-chunks", type=_positive, default=4, help="most chunks a request adds")
    p.add_argument("--in-flight", type=_count, default=8, help="routed, not yet looked up")
    p.add_argument("--rate", type=_rate, default=100.0, help="requests a second (trace time)")
    p.add_argument("--restarts", type=_count, help="engine restarts per arm (default 6; quick 1)")
    p.add_argument("--lags-ms", type=_ints, default=[10, 100, 1000], help="the index's lags")
    p.add_argument("--reserve-ms", type=_count, default=2000)
    p.add_argument("--latency-engines", type=_ints, help="default 4,8,16; quick 4")
    p.add_argument(
        "--queries", type=_positive, help="queries per fleet size (default 2000; quick 100)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", help="also write the JSON result here")
    return p


def _defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    for name, full, small in (
        ("engines", 8, 4),
        ("requests", 2000, 150),
        ("restarts", 6, 1),
        ("latency_engines", [4, 8, 16], [4]),
        ("queries", 2000, 100),
    ):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)


def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Every arm, then the query's cost; the result. The run's keys are deleted after."""
    config = LookupConfig(redis_url=url)
    run_id = uuid.uuid4().hex[:8]
    try:
        arms = _arms(args, config, run_id)
        latency = [query_cost(url, run_id, n, args.queries, 20) for n in args.latency_engines]
    finally:
        _delete_keys(url, run_id)
    return {"run_id": run_id, "arms": arms, "query_cost": latency}


def _arms(args: argparse.Namespace, config: LookupConfig, run_id: str) -> dict[str, Any]:
    """Each policy on a fresh fleet, the same trace and the same restarts."""
    trace = make_trace(
        config, args.requests, args.groups, args.prefix_chunks, args.own_chunks, args.seed
    )
    rng = random.Random(args.seed + 1)
    restarts = {
        rng.randrange(args.requests // 10, args.requests): rng.randrange(args.engines)
        for _ in range(args.restarts)
    }
    plans: list[tuple[str, Any]] = [
        (f"fleet query, reserve {args.reserve_ms} ms", args.reserve_ms),
        ("fleet query, no reservation", 0),
        *((f"event index, lag {lag} ms", lag / 1000) for lag in args.lags_ms),
        ("round robin", None),
    ]
    arms: dict[str, Any] = {}
    fleet_client = FleetClient(config, deadline_ms=100)
    try:
        for k, (name, knob) in enumerate(plans):
            fleet = Fleet(config, f"bench-{run_id}-a{k}", args.engines, args.capacity)
            try:
                policy: Policy
                if name.startswith("fleet query"):
                    policy = FleetQuery(fleet_client, fleet.ids, knob)
                elif name.startswith("event index"):
                    policy = EventIndex(args.engines, knob)
                else:
                    policy = RoundRobin(args.engines)
                arms[name] = run_arm(fleet, policy, trace, restarts, args.in_flight, args.rate)
            finally:
                fleet.close()
    finally:
        fleet_client.close()
    return arms


def _delete_keys(url: str, run_id: str) -> None:
    """Drop every key of this run: a shared server keeps no benchmark litter."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"bl:{{bench-{run_id}-*", count=1000))
        for start in range(0, len(keys), 500):
            client.unlink(*keys[start : start + 500])
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    """Run on ``--redis-url`` or an embedded server; print the table (or JSON)."""
    args = parser().parse_args(argv)
    _defaults(args)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    load_before = os.getloadavg()
    with ExitStack() as stack:
        url = args.redis_url
        if url is None:
            from broker_lookup.tools.embedded import EmbeddedServer

            server = EmbeddedServer().start()
            stack.callback(server.stop)
            url = server.url
        result = run(args, url)
    settings = {k: v for k, v in vars(args).items() if k not in ("redis_url", "json", "out")}
    result.update(
        settings=settings,
        load_average=[load_before, os.getloadavg()],
        cpus=os.cpu_count(),
        seconds=round(time.monotonic() - started, 1),
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
