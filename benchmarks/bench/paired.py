"""``python -m benchmarks.bench --paired A,B``: two kinds of rank side by side, alternating.

One bench run against another moves by about ±30 % on a small shared box, which hides any
change under 10 %. A paired run keeps both sides' ranks up at once on one server, drives
each with our own client (so only the ranks differ), one lookup in flight at world 1, in
alternating rounds of ``--lookups`` lookups (A then B, then B then A), and reads each rank
process's CPU around each of its rounds. A drift of the machine's load falls on both sides of
a round alike, so the median of the per-round ratios B / A is far steadier than either
side's own figure. ``--paired ours,ours`` measures the harness's own spread on the day.

A side is ``ours`` (our ranks with the stub engine, as the bench runs them), ``floor`` or
``native`` (the protocol's floor and native floor, ``benchmarks/bench/floor.py``), or
``ours=PATH``: our ranks from another source tree, for a before and after (a ``git
worktree`` of the older commit with its C extensions built: ``python setup.py build_ext
--inplace`` there).

>>> sides = parse_sides("ours=/tmp/base,ours")                        # doctest: +SKIP
>>> out = paired(BenchOptions.defaults(False, lookups=300), url, "r1", sides, 100)  # doctest: +SKIP
>>> out["ratio"]["median"]                                           # doctest: +SKIP
0.97
"""

from __future__ import annotations

import os
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench.floor import native_floor_built
from benchmarks.bench.measure import (
    BenchOptions,
    Prompts,
    cpu_seconds_of,
    sequential_latency,
)
from benchmarks.bench.ours import client_for, engine_id, rank_host

__all__ = ["Side", "paired", "parse_sides", "render_paired"]

_OURS = "benchmarks.bench.our_ranks"
_FLOOR = "benchmarks.bench.floor"


@dataclass(frozen=True)
class Side:
    """One side of a paired run: which rank host serves it, from which source tree."""

    name: str  #: as given: ``ours``, ``floor``, ``native`` or ``ours=PATH``
    module: str  #: the rank host's module
    host_args: tuple[str, ...] = ()
    source: str | None = None  #: a source tree put first on the ranks' PYTHONPATH

    def env(self) -> dict[str, str] | None:
        """The rank host's environment: this process's, with ``source`` first on the path."""
        if self.source is None:
            return None
        path = os.environ.get("PYTHONPATH")
        joined = self.source if not path else self.source + os.pathsep + path
        return {**os.environ, "PYTHONPATH": joined}


def parse_side(text: str) -> Side:
    """One side from its spec (see the module's docstring).

    Raises:
        ValueError: an unknown kind, a missing or non-source PATH, or a native floor that
            was not built; the message names the value.
    """
    kind, has_path, path = text.strip().partition("=")
    if kind == "ours" and has_path:
        tree = Path(path).expanduser()
        if not (tree / "workers").is_dir() or not (tree / "broker_lookup").is_dir():
            raise ValueError(f"--paired side {text!r}: {path!r} holds no broker-lookup source tree")
        return Side(text, _OURS, source=str(tree.resolve()))
    if has_path:
        raise ValueError(f"--paired side {text!r}: only ours takes a source tree (ours=PATH)")
    if kind == "ours":
        return Side(text, _OURS)
    if kind == "floor":
        return Side(text, _FLOOR)
    if kind == "native":
        if not native_floor_built():
            raise ValueError("--paired side 'native': the native floor's extension is not built")
        return Side(text, _FLOOR, ("--native",))
    raise ValueError(f"--paired side {text!r}: expected ours, floor, native or ours=PATH")


def parse_sides(text: str) -> tuple[Side, Side]:
    """``A,B`` as two sides.

    Raises:
        ValueError: not two sides, or a side that :func:`parse_side` refuses.
    """
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--paired {text!r}: expected two sides, A,B")
    return parse_side(parts[0]), parse_side(parts[1])


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _round(
    client: Any,
    pids: list[int],
    tag: str,
    opts: BenchOptions,
    prompts: Prompts,
    results: dict[str, int],
) -> float:
    """One side's round: its rank CPU in µs per lookup (its answers counted into ``results``)."""
    before = cpu_seconds_of(pids)
    run = sequential_latency(client, prompts, opts.lookups, 0, opts.poll_s, tag)
    spent = cpu_seconds_of(pids) - before
    for hits, count in run["results"].items():
        results[hits] = results.get(hits, 0) + count
    return spent * 1e6 / opts.lookups


def paired(
    opts: BenchOptions, url: str, run_id: str, sides: tuple[Side, Side], rounds: int
) -> dict[str, Any]:
    """``rounds`` alternating rounds of ``opts.lookups`` lookups on each side.

    Raises:
        BenchError: a rank host failed to start, or a lookup never finished.
    """
    with ExitStack() as stack:
        clients, pids = [], []
        for i, side in enumerate(sides):
            eid = engine_id(run_id, f"paired-{i}")
            host = rank_host(
                opts, url, {eid: 1}, module=side.module, host_args=side.host_args, env=side.env()
            )
            pids.append(list(stack.enter_context(host)[eid].values()))
            client = client_for(url, eid, 1)
            stack.callback(client.close)
            clients.append(client)
        prompts = Prompts(opts.tokens)
        for i, client in enumerate(clients):
            sequential_latency(client, prompts, opts.warmup, 0, opts.poll_s, f"pw{i}")
        cpu_us: list[list[float]] = [[], []]
        results: list[dict[str, int]] = [{}, {}]
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                tag = f"p{r}-{i}"
                cpu_us[i].append(_round(clients[i], pids[i], tag, opts, prompts, results[i]))
    ratios = sorted(b / a for a, b in zip(cpu_us[0], cpu_us[1], strict=True) if a > 0)
    q1, median, q3 = _quartiles(ratios) if ratios else (0.0, 0.0, 0.0)
    return {
        "sides": [side.name for side in sides],
        "rounds": rounds,
        "lookups_per_round": opts.lookups,
        "tokens": opts.tokens,
        "rank_cpu_us": [
            {"median": statistics.median(v), "min": min(v), "rounds": v} for v in cpu_us
        ],
        "ratio": {"median": median, "q1": q1, "q3": q3, "rounds": len(ratios)},
        "results": [{k: v for k, v in sorted(r.items())} for r in results],
    }


def render_paired(result: dict[str, Any]) -> str:
    """The paired run as a short table."""
    a, b = result["sides"]
    cpu = result["rank_cpu_us"]
    ratio = result["ratio"]
    return "\n".join(
        [
            f"paired rank CPU, one lookup in flight, world 1: {result['rounds']} alternating "
            f"rounds of {result['lookups_per_round']} lookups a side ({result['tokens']} tokens)",
            f"  {'side':<32} {'µs/lookup median':>17} {'min':>8}",
            f"  A {a:<30} {cpu[0]['median']:>17.1f} {cpu[0]['min']:>8.1f}",
            f"  B {b:<30} {cpu[1]['median']:>17.1f} {cpu[1]['min']:>8.1f}",
            f"  B / A per round: median {ratio['median']:.3f}, "
            f"quartiles {ratio['q1']:.3f}-{ratio['q3']:.3f} ({ratio['rounds']} rounds)",
            f"  (--paired {a},{a} measures the harness's own spread on the day)",
        ]
    )
