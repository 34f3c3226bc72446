"""``python -m benchmarks.bench``: latency, caller cost, throughput, hashing, memory and CPU.

Runs against an embedded Valkey (default) or ``--redis-url``, with worker ranks as real
processes (``python -m benchmarks.bench.our_ranks``) that answer at once, so what is
measured is the lookup path itself: client, Redis, server, and the hand-offs between them.
``--vs-lmcache`` runs the same loops on LMCache 0.5.6's ZMQ client and server and adds
the ratios. ``--quick`` is the CI smoke mode (world sizes 1 and 2, a few hundred
lookups, small hashing sizes, well under a minute). ``--features-cost`` runs only the
one-in-flight loop and the throughput loop with the client's optional features (rank
insights, size-aware deadlines, partial answers) off and on, and prints both and the
ratio (``features_cost.py``). ``--floor`` runs only the one-in-flight loop on ours and on
the protocol's floor (``floor.py``: the same scripts and commands, none of the machinery),
and with ``--vs-lmcache`` on LMCache too, and prints the ratios (``floor_gap.py``).
``--redis-cost`` prints what Redis pays per lookup, by command and by script
(``redis_cost.py``). The
polling model is described in ``benchmarks.bench.measure``; the results and how
to read them in ``docs/performance.md``.

>>> results = run_bench(BenchOptions.defaults(quick=True))   # doctest: +SKIP
>>> results["ours"]["latency"]["1"]["e2e"]["p50_ms"]          # doctest: +SKIP
0.41
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import redis

from benchmarks.bench.cluster import add_cluster_args, cmd_cluster_bench
from benchmarks.bench.figures import evaluate_targets, figures, ratios
from benchmarks.bench.hash_timing import hashing, paired_hashing
from benchmarks.bench.measure import BenchError, BenchOptions
from benchmarks.bench.report import render
from broker_lookup.errors import BrokerUnavailable
from broker_lookup.processes import ExitCode

__all__ = [
    "BenchOptions",
    "add_bench_parser",
    "cmd_bench",
    "configure_parser",
    "main",
    "run_bench",
    "run_features_cost",
    "run_floor_gap",
]

HELP = "measure lookup latency, caller cost, throughput, hashing, memory and CPU"


@contextmanager
def _redis_url(opts: BenchOptions) -> Iterator[tuple[str, str]]:
    """The URL to use and what it is; an embedded server lives for the block."""
    if opts.redis_url:
        yield opts.redis_url, "external"
        return
    from broker_lookup.tools.embedded import EmbeddedServer

    server = EmbeddedServer().start()
    try:
        yield server.url, "embedded"
    finally:
        server.stop()


def _server_meta(url: str, kind: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info: Any = client.info("server")
    finally:
        client.close()
    name = "valkey" if "valkey_version" in info else "redis"
    version = info.get("valkey_version") or info.get("redis_version")
    return {"kind": kind, "server": f"{name} {version}"}


def _delete_keys(url: str, run_id: str) -> None:
    """Drop every key of this run (an external server keeps no bench litter)."""
    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=f"bl:{{bench-{run_id}-*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                client.unlink(*batch)
                batch.clear()
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


def _ours(opts: BenchOptions, run_id: str, meta: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.bench.engines import concurrency
    from benchmarks.bench.ours import latency_and_probes

    with _redis_url(opts) as (url, kind):
        meta["redis"] = _server_meta(url, kind)
        try:
            ours = latency_and_probes(opts, url, run_id)
            ours["engines"] = {str(n): concurrency(opts, url, run_id, n) for n in opts.engines}
        finally:
            if kind == "external":
                _delete_keys(url, run_id)
    return ours


def _source_version() -> str | None:
    """``git describe --always --dirty`` of the checkout, if it is one."""
    import subprocess

    try:
        done = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _lmcache_first(opts: BenchOptions) -> None:
    """With ``vs_lmcache``, fail now if lmcache is missing, not after the long part."""
    if opts.vs_lmcache:
        from benchmarks.bench.lmcache_side import require_lmcache

        require_lmcache()


def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Run every measurement ``opts`` asks for; return the results as a JSON-able dict.

    Raises:
        BenchError: a rank or driver failed, or lmcache is missing for ``vs_lmcache``.
        BrokerUnavailable: the embedded server did not start.
    """
    _lmcache_first(opts)
    run_id = uuid.uuid4().hex[:8]
    meta: dict[str, Any] = {
        "run_id": run_id,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": _source_version(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "options": asdict(opts),
    }
    t0 = time.monotonic()
    results: dict[str, Any] = {"meta": meta, "ours": _ours(opts, run_id, meta)}
    if opts.vs_lmcache:
        from benchmarks.bench.lmcache_side import bench_lmcache

        meta["loadavg_lmcache_start"] = os.getloadavg()  # the sides run one after the other
        results["lmcache"] = bench_lmcache(opts, run_id)
        from benchmarks.bench.lmcache_side import require_lmcache

        pair = paired_hashing(require_lmcache(), opts.hash_sizes)
        results["hashing"], results["lmcache"]["hashing"] = pair
    else:
        results["hashing"] = hashing(opts.hash_sizes)
    results["figures"] = figures(results)
    if opts.vs_lmcache:
        results["ratios"] = ratios(results)
    results["targets"] = evaluate_targets(results)
    meta["loadavg_end"] = os.getloadavg()
    meta["seconds"] = round(time.monotonic() - t0, 1)
    return results


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add ``bench``'s options to ``p`` (for a CLI subcommand registry)."""
    p.add_argument("--redis-url", help="use this server (default: start an embedded Valkey)")
    p.add_argument("--quick", action="store_true", help="CI smoke mode: small and fast")
    p.add_argument("--vs-lmcache", action="store_true", help="also measure LMCache 0.5.6")
    p.add_argument("--out", help="JSON results file (default bench-results.json)")
    p.add_argument(
        "--features-cost",
        action="store_true",
        help="only compare latency and CPU per lookup with one in flight, and the rate and "
        "CPU per lookup with the throughput window in flight, with rank insights, "
        "size-aware deadlines and partial answers off and on (world 2, or the largest of "
        "--worlds), and print the ratio",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="only compare the one-in-flight figures of ours with the protocol's floor (the "
        "same scripts and commands without our client's and ranks' machinery) per world "
        "size, and with --vs-lmcache with LMCache's too, and print the ratios",
    )
    p.add_argument(
        "--paired",
        type=_sides,
        metavar="A,B",
        help="only compare two kinds of rank (ours, floor, native, or ours=PATH: our ranks "
        "from another source tree) in alternating rounds of --lookups lookups, one in "
        "flight, world 1, and print the median of the per-round rank CPU ratios B / A",
    )
    p.add_argument(
        "--redis-cost",
        action="store_true",
        help="only measure Redis's cost per lookup by command and by script, the round trips "
        "per lookup (the server's reads) and the floor, one in flight and --window in "
        "flight, per world size (default 1,4,8)",
    )
    p.add_argument("--window", type=int, help="lookups in flight in the throughput runs")
    p.add_argument("--rounds", type=int, help="rounds a side for --paired (default 100)")
    p.add_argument("--lookups", type=int, help="measured lookups per latency run")
    p.add_argument("--duration", type=float, help="seconds per throughput run")
    p.add_argument("--poll-us", type=float, help="sleep between polls in µs (0: sleep(0))")
    p.add_argument("--worlds", type=_ints, help="world sizes, e.g. 1,2,4,8")
    p.add_argument("--engines", type=_ints, help="concurrent engine counts, e.g. 1,4,16")
    add_cluster_args(p)  # --cluster: one node vs a local Redis Cluster (bench_cluster.py)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated ints") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ints >= 1")
    return values


def _sides(text: str) -> Any:
    from benchmarks.bench.paired import parse_sides

    try:
        return parse_sides(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an ``add_subparsers()`` object; ``args.func`` runs it."""
    p: argparse.ArgumentParser = subparsers.add_parser("bench", help=HELP, description=HELP)
    configure_parser(p)
    p.set_defaults(func=cmd_bench)
    return p


def _options(args: argparse.Namespace) -> BenchOptions:
    given = {
        "redis_url": args.redis_url,
        "lookups": args.lookups,
        "duration_s": args.duration,
        "poll_us": args.poll_us,
        "worlds": args.worlds,
        "engines": args.engines,
        "vs_lmcache": args.vs_lmcache,
        "window": getattr(args, "window", None),
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    opts = BenchOptions.defaults(args.quick, **overrides)
    if opts.throughput_world not in opts.worlds:  # throughput runs on a measured world
        opts = replace(opts, throughput_world=max(opts.worlds))
    return opts


def _one_figure(
    opts: BenchOptions, name: str, measure: Callable[[str, str], dict[str, Any]]
) -> dict[str, Any]:
    """``{"meta": ..., name: measure(url, run_id)}`` on the bench's server (an external
    one keeps none of the run's keys)."""
    run_id = uuid.uuid4().hex[:8]
    with _redis_url(opts) as (url, kind):
        meta: dict[str, Any] = {
            "run_id": run_id,
            "source": _source_version(),
            "loadavg_start": os.getloadavg(),
            "redis": _server_meta(url, kind),
            "options": asdict(opts),
        }
        try:
            return {"meta": meta, name: measure(url, run_id)}
        finally:
            if kind == "external":
                _delete_keys(url, run_id)


def run_features_cost(opts: BenchOptions, world: int = 2) -> dict[str, Any]:
    """``--features-cost``: :func:`features_cost.features_cost` on the bench's server.

    Raises:
        BenchError: a rank or lookup failed.
        BrokerUnavailable: the embedded server did not start.
    """
    from benchmarks.bench.features_cost import features_cost

    return _one_figure(
        opts, "features_cost", lambda url, run_id: features_cost(opts, url, run_id, world)
    )


def run_floor_gap(opts: BenchOptions) -> dict[str, Any]:
    """``--floor``: :func:`floor_gap.floor_gap` on the bench's server.

    Raises:
        BenchError: a rank or lookup failed, or lmcache is missing for ``vs_lmcache``.
        BrokerUnavailable: the embedded server did not start.
    """
    from benchmarks.bench.floor_gap import floor_gap

    _lmcache_first(opts)
    return _one_figure(opts, "floor_gap", lambda url, run_id: floor_gap(opts, url, run_id))


def _cmd_one_figure(
    args: argparse.Namespace,
    run: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], str],
) -> int:
    """Run one figure's mode and print its table; JSON only to an explicit ``--out``."""
    try:
        results = run()
    except (BrokerUnavailable, BenchError) as exc:
        print(f"python -m benchmarks.bench: {exc}", file=sys.stderr)
        return ExitCode.UNREACHABLE if isinstance(exc, BrokerUnavailable) else ExitCode.FAILED
    print(render(results))
    if args.out:  # the full run's file is not overwritten by this small figure
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults written to {args.out}")
    return ExitCode.OK


def _cmd_features_cost(args: argparse.Namespace) -> int:
    from benchmarks.bench.features_cost import render_features_cost

    opts = _options(args)
    world = max(args.worlds) if args.worlds else 2
    return _cmd_one_figure(
        args,
        lambda: run_features_cost(opts, world),
        lambda results: render_features_cost(results["features_cost"]),
    )


def _cmd_floor_gap(args: argparse.Namespace) -> int:
    from benchmarks.bench.floor_gap import render_floor_gap

    opts = _options(args)
    return _cmd_one_figure(
        args,
        lambda: run_floor_gap(opts),
        lambda results: render_floor_gap(results["floor_gap"]),
    )


def run_paired(opts: BenchOptions, sides: tuple[Any, Any], rounds: int) -> dict[str, Any]:
    """``--paired``: :func:`paired.paired` on the bench's server.

    Raises:
        BenchError: a rank host failed to start, or a lookup never finished.
        BrokerUnavailable: the embedded server did not start.
    """
    from benchmarks.bench.paired import paired

    return _one_figure(opts, "paired", lambda url, run_id: paired(opts, url, run_id, sides, rounds))


def _cmd_paired(args: argparse.Namespace) -> int:
    from benchmarks.bench.paired import render_paired

    rounds = args.rounds if args.rounds is not None else (4 if args.quick else 100)
    if rounds < 1:
        print(f"python -m benchmarks.bench: --rounds {rounds}: expected >= 1", file=sys.stderr)
        return ExitCode.USAGE
    if args.lookups is None:
        args.lookups = 20 if args.quick else 300
    opts = _options(args)
    return _cmd_one_figure(
        args,
        lambda: run_paired(opts, args.paired, rounds),
        lambda results: render_paired(results["paired"]),
    )


def _cmd_redis_cost(args: argparse.Namespace) -> int:
    from benchmarks.bench.redis_cost import redis_cost, render_redis_cost

    if args.worlds is None:
        args.worlds = (1, 4, 8)
    opts = _options(args)
    return _cmd_one_figure(
        args,
        lambda: _one_figure(opts, "redis_cost", lambda url, run_id: redis_cost(opts, url, run_id)),
        lambda results: render_redis_cost(results["redis_cost"]),
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the bench from parsed arguments: JSON to ``--out``, a table on stdout."""
    if getattr(args, "cluster", False):
        if args.out is None:
            args.out = "bench-results.json"  # the cluster bench always writes its results
        return cmd_cluster_bench(args)
    if getattr(args, "features_cost", False):
        return _cmd_features_cost(args)
    if getattr(args, "floor", False):
        return _cmd_floor_gap(args)
    if getattr(args, "paired", None) is not None:
        return _cmd_paired(args)
    if getattr(args, "redis_cost", False):
        return _cmd_redis_cost(args)
    opts = _options(args)
    out = args.out or "bench-results.json"
    try:
        results = run_bench(opts)
    except BrokerUnavailable as exc:
        print(f"python -m benchmarks.bench: {exc}", file=sys.stderr)
        return ExitCode.UNREACHABLE
    except BenchError as exc:
        print(f"python -m benchmarks.bench: {exc}", file=sys.stderr)
        return ExitCode.FAILED
    Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print(render(results))
    print(f"\nresults written to {out}")
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench ARGS``, from a checkout."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=HELP)
    configure_parser(p)
    return cmd_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
