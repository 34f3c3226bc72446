"""``python -m benchmarks.bench --cluster``: lookups/s of 1, 4, 8 engines on one node vs a cluster.

One run starts both topologies itself from the same server binary: one
:class:`~broker_lookup.tools.embedded.EmbeddedServer`, then a
:class:`~broker_lookup.tools.local_cluster.LocalCluster` of three masters. For each engine
count N it forks N engine processes (:mod:`benchmarks.bench.cluster_engines`); each
holds one :class:`RedisAsyncLookupClient` and one worker rank with a stub engine that
answers at once, and keeps ``window`` lookups in flight for ``duration_s``. The table gives the
summed lookups/s and how busy the servers were (CPU seconds per second: 1.00 is one
core saturated, which is where one node stops scaling and a cluster starts to pay).

Honest limits: engines and servers share this machine's cores, so on a small machine
the engine processes, not the server, are the bottleneck; the server CPU column shows
how far one node is from saturation. Engine ids are chosen so that their hash-tag
slots fall on the masters round-robin. See ``docs/scaling.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis
from redis.crc import key_slot

from benchmarks.bench.cluster_engines import TOKENS, run_engines
from broker_lookup.errors import BrokerLookupError, BrokerUnavailable
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.tools.local_cluster import LocalCluster, slot_ranges

__all__ = ["add_cluster_args", "cmd_cluster_bench", "render_cluster_table", "run_cluster_bench"]


def engine_ids(run_id: str, count: int, masters: int) -> list[str]:
    """``count`` engine ids whose slots fall on the ``masters`` slot ranges round-robin."""
    ranges = slot_ranges(masters)
    candidates = (f"bench-{run_id}-{n}" for n in itertools.count())
    ids: list[str] = []
    while len(ids) < count:
        first, last = ranges[len(ids) % masters]
        candidate = next(candidates)
        if first <= key_slot(KeySpace(candidate).requests.encode()) <= last:
            ids.append(candidate)
    return ids


def _measure(
    url: str, nodes: list[redis.Redis], ids: list[str], window: int, duration_s: float
) -> dict[str, Any]:
    results, cpu = run_engines(url, ids, window, duration_s, nodes)
    return {
        "lookups_per_s": round(sum(n / s for n, s in results), 1),
        "per_engine": [round(n / s, 1) for n, s in results],
        "server_cpu": [round(c, 2) for c in cpu],
    }


@contextmanager
def _topology(
    kind: str, masters: int, binary: str | None
) -> Iterator[tuple[str, list[redis.Redis]]]:
    if kind == "single":
        with EmbeddedServer(binary=binary) as server, redis.Redis.from_url(server.url) as node:
            yield server.url, [node]
        return
    with LocalCluster(masters, binary=binary) as cluster:
        yield cluster.url, [cluster.admin(i) for i in range(masters)]


def run_cluster_bench(
    engines: tuple[int, ...] = (1, 4, 8),
    duration_s: float = 3.0,
    *,
    window: int = 32,
    masters: int = 3,
    binary: str | None = None,
) -> dict[str, Any]:
    """Total lookups/s per engine count, on one node and on a ``masters``-master cluster."""
    if threading.active_count() > 1:
        raise BrokerLookupError("run the cluster bench from a process without threads (fork)")
    run_id = uuid.uuid4().hex[:8]
    meta = {
        "duration_s": duration_s,
        "window_per_engine": window,
        "masters": masters,
        "tokens": TOKENS,
        "engine_processes": True,
        "run_id": run_id,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    out: dict[str, Any] = {"meta": meta}
    for kind in ("single", "cluster"):
        with _topology(kind, masters, binary) as (url, nodes):
            cells = {}
            for n in engines:
                ids = engine_ids(f"{run_id}{kind[0]}{n}", n, masters)
                cells[str(n)] = _measure(url, nodes, ids, window, duration_s)
            out[kind] = cells
            meta.setdefault("server", _server_name(nodes[0]))
    meta["loadavg_end"] = os.getloadavg()
    return out


def _server_name(node: redis.Redis) -> str:
    info: Any = node.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info.get('redis_version')}"


def render_cluster_table(results: dict[str, Any]) -> str:
    """The table ``cmd_cluster_bench`` prints."""
    meta = results["meta"]
    lines = [
        f"lookups/s, one node vs a {meta['masters']}-master cluster ({meta['server']}; "
        f"{meta['duration_s']:g}s per cell, {meta['window_per_engine']} in flight per engine)",
        f"{'engines':>7}  {'single lookups/s':>16}  {'node CPU':>8}  "
        f"{'cluster lookups/s':>17}  {'busiest master CPU':>18}  {'cluster/single':>14}",
    ]
    for n, single in results["single"].items():
        cluster = results["cluster"][n]
        ratio = cluster["lookups_per_s"] / max(1.0, single["lookups_per_s"])
        lines.append(
            f"{n:>7}  {single['lookups_per_s']:>16,.0f}  {single['server_cpu'][0]:>8.2f}  "
            f"{cluster['lookups_per_s']:>17,.0f}  {max(cluster['server_cpu']):>18.2f}  "
            f"{ratio:>14.2f}"
        )
    lines.append(
        f"CPU: server CPU seconds per second (1.00 = one core saturated); {meta['cpus']} CPUs, "
        f"load average {meta['loadavg_start'][0]:.1f} at start, {meta['loadavg_end'][0]:.1f} at end"
    )
    return "\n".join(lines)


def add_cluster_args(p: argparse.ArgumentParser, standalone: bool = False) -> None:
    """Add ``--cluster`` (and, standalone, the options ``bench`` already has)."""
    help_ = "compare one node with a local Redis Cluster (1, 4, 8 engines)"
    p.add_argument("--cluster", action="store_true", help=help_)
    p.add_argument("--cluster-masters", type=int, default=3, help="masters of that cluster")
    if standalone:
        p.add_argument("--engines", type=lambda s: tuple(int(x) for x in s.split(",")))
        p.add_argument("--duration", type=float, help="seconds per cell (default 3)")
        p.add_argument("--out", help="also write the results as JSON here")


def cmd_cluster_bench(args: argparse.Namespace) -> int:
    """Run from parsed ``bench`` arguments (``--engines``, ``--duration``, ``--out`` reused).

    Exit codes as ``bench`` (:class:`~broker_lookup.processes.ExitCode`): UNREACHABLE when
    a server did not start.
    """
    if getattr(args, "redis_url", None):
        print("python -m benchmarks.bench --cluster starts its own servers: drop --redis-url")
        return ExitCode.USAGE
    try:
        results = run_cluster_bench(
            tuple(getattr(args, "engines", None) or (1, 4, 8)),
            getattr(args, "duration", None) or 3.0,
            masters=args.cluster_masters,
        )
    except BrokerLookupError as exc:
        print(f"python -m benchmarks.bench --cluster: {exc}", file=sys.stderr)
        return ExitCode.UNREACHABLE if isinstance(exc, BrokerUnavailable) else ExitCode.FAILED
    if getattr(args, "out", None):
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(render_cluster_table(results))
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench.cluster [--engines 1,4,8] [--duration 3]``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.cluster")
    add_cluster_args(p, standalone=True)
    return cmd_cluster_bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
