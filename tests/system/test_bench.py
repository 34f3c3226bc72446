"""``python -m benchmarks.bench --quick`` end to end: every section present and sane, no leftovers.

No timing thresholds: CI boxes are loaded and noisy. What is checked is that each
measurement ran and produced a plausible number, that rank and driver processes are
gone afterwards, and that a run against a shared server leaves none of its keys behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import RealServer

from benchmarks.bench.command import (
    BenchOptions,
    add_bench_parser,
    cmd_bench,
    run_bench,
    run_features_cost,
)
from benchmarks.bench.figures import RATIO_VARIANT
from benchmarks.bench.floor import native_floor_built
from benchmarks.bench.lmcache_side import VARIANTS, require_lmcache
from benchmarks.bench.measure import BenchError
from benchmarks.bench.report import render

# Smoke runs of the benchmark tool: CI also runs `python -m benchmarks.bench --quick` in its own
# phase; here in the long leg, so the default run stays short.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(240)]


def _descendants_and_strays(run_id: str | None) -> set[int]:
    """Our live child processes, plus any process whose command line names the run."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state == "Z":
            continue
        if int(ppid) == me or (run_id and f"bench-{run_id}-" in cmdline):
            found.add(int(entry))
    return found


def _bench_args(*argv: str) -> argparse.Namespace:
    """``python -m benchmarks.bench ARGV`` parsed by the subcommand's own parser."""
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def _one_figure_table(
    args: argparse.Namespace, capsys: pytest.CaptureFixture[str], labels: list[str]
) -> str:
    """Run a one-figure mode through the CLI: it succeeds, prints every label and leaves
    no process behind; its table."""
    before = _descendants_and_strays(None)
    assert cmd_bench(args) == 0
    table = capsys.readouterr().out
    for label in labels:
        assert label in table
    assert _descendants_and_strays(None) - before == set(), "processes left behind"
    return table


def _positive(value: Any, what: str) -> None:
    assert isinstance(value, (int, float)) and value > 0, f"{what} = {value!r}"


def _check_latency(latency: dict[str, Any], worlds: tuple[int, ...], tokens: int) -> None:
    assert set(latency) == {str(w) for w in worlds}
    for world, run in latency.items():
        e2e = run["e2e"]
        assert e2e["n"] > 0
        _positive(e2e["p50_ms"], f"world {world} p50")
        assert e2e["p50_ms"] <= e2e["p99_ms"] <= e2e["max_ms"] < 30_000
        _positive(run["lookup_call_us"], f"world {world} lookup() cost")
        assert run["results"] == {str(tokens): e2e["n"]}, "every lookup must be a full hit"
        assert run["cpu_per_1000"]["ranks"] >= 0


def _check_ours(ours: dict[str, Any], opts: BenchOptions) -> None:
    _check_latency(ours["latency"], opts.worlds, opts.tokens)
    tput = ours["throughput"]
    _positive(tput["lookups_per_s"], "throughput")
    assert tput["completed"] > 0 and tput["world"] == opts.throughput_world
    _positive(tput["cpu_per_1000"]["caller_thread"], "caller CPU per 1000")
    _positive(tput["cpu_per_1000"]["ranks"], "rank CPU per 1000")
    assert set(ours["engines"]) == {str(n) for n in opts.engines}
    for n, run in ours["engines"].items():
        _positive(run["lookups_per_s"], f"{n} engines throughput")
        assert len(run["per_engine_lookups_per_s"]) == int(n)
    pending = ours["pending"]
    assert pending["pending"] == pending["still_pending"] == opts.pending
    for key in (
        "lookup_cache_unknown_us",
        "lookup_cache_pending_1_us",
        "lookup_cache_pending_n_us",
        "lookup_call_first_100_us",
        "lookup_call_last_100_us",
        "lookup_hash_bytes",
        "stream_entry_bytes",
        "key_bytes_per_lookup",
    ):
        _positive(pending[key], key)
    assert pending["key_bytes_per_lookup"] < 64 * 1024
    idle = ours["idle"]  # every engine's ranks (the mute one's too), then one client
    assert idle["rank_processes"] == sum(opts.worlds) + 1
    _positive(idle["rank_ms_per_s"], "an idle rank's CPU")  # it beats and reads: never 0
    _positive(idle["scheduler_ms_per_s"], "an idle client's CPU")
    assert isinstance(pending["redis_bytes_per_lookup"], float)  # a shared server may blur it


_PER_LOOKUP = {"rank_cpu_us_per_rank", "scheduler_cpu_us", "e2e_p50_ms", "e2e_p99_ms"}


def _check_figures(side: dict[str, Any], worlds: tuple[int, ...], redis_too: bool) -> None:
    """The per-lookup figures of one side: every world, CPU with 1,000 in flight."""
    assert set(side["one_in_flight"]) == {str(w) for w in worlds}
    for world, row in side["one_in_flight"].items():
        assert _PER_LOOKUP <= set(row) and ("redis_cpu_us" in row) == redis_too
        _positive(row["scheduler_cpu_us"], f"world {world} scheduler CPU per lookup")
    cpu = side["in_flight"]["cpu_us_per_lookup"]
    assert {"caller_thread", "client_threads", "ranks", "total"} <= set(cpu)
    assert ("redis" in cpu) == redis_too
    _positive(cpu["total"], "CPU per lookup in flight")


def _check_results(results: dict[str, Any], opts: BenchOptions) -> None:
    assert {"meta", "ours", "hashing", "figures", "targets"} <= set(results)
    _check_ours(results["ours"], opts)
    _check_figures(results["figures"]["ours"], opts.worlds, redis_too=True)
    assert set(results["hashing"]) == {str(n) for n in opts.hash_sizes}
    for row in results["hashing"].values():
        _positive(row["list_ns_per_token"], "list hashing")
        _positive(row["tensor_ns_per_token"], "tensor hashing")
    assert results["targets"] and all(t["met"] in (True, False, None) for t in results["targets"])
    json.dumps(results)  # JSON-able as written to --out


def test_quick_run_has_every_section_and_leaves_nothing(real_server: RealServer) -> None:
    url = real_server.url if real_server.kind == "external" else None  # None: embedded
    opts = BenchOptions.defaults(quick=True, redis_url=url)
    before = _descendants_and_strays(None)
    results = run_bench(opts)
    _check_results(results, opts)
    run_id = results["meta"]["run_id"]
    assert _descendants_and_strays(run_id) - before == set(), "processes left behind"
    if url:
        client = redis.Redis.from_url(url)
        try:
            assert not list(client.scan_iter(match=f"bl:{{bench-{run_id}-*"))
        finally:
            client.close()


def test_cli_writes_json_and_table(
    real_server: RealServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    argv = ["--quick", "--redis-url", real_server.url, "--out", str(out)]
    args = _bench_args(*argv, "--worlds", "1", "--engines", "1", "--lookups", "30")
    assert args.func is cmd_bench
    assert cmd_bench(args) == 0
    results = json.loads(out.read_text())
    assert set(results["ours"]["latency"]) == {"1"}
    assert results["ours"]["throughput"]["world"] == 1
    table = capsys.readouterr().out
    for line in ("End-to-end latency", "CPU per lookup, one lookup in flight", "Targets"):
        assert line in table


def test_vs_lmcache_without_lmcache_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lmcache", None)  # makes every lmcache import fail
    with pytest.raises(BenchError, match="install-lmcache-cpu"):
        run_bench(BenchOptions.defaults(quick=True, vs_lmcache=True))


@pytest.mark.lmcache
def test_vs_lmcache_measures_both_variants(real_server: RealServer) -> None:
    try:
        require_lmcache()
    except BenchError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the LMCache comparison: {exc}")
        pytest.skip(str(exc))
    opts = BenchOptions.defaults(
        quick=True,
        redis_url=real_server.url,
        vs_lmcache=True,
        worlds=(1,),
        throughput_world=1,
        engines=(1,),
        lookups=30,
        lmcache_slow_lookups=10,
        duration_s=0.3,
        window=50,
        pending=50,
        hash_sizes=(1024, 8192),
    )
    before = _descendants_and_strays(None)
    results = run_bench(opts)
    for name in VARIANTS:
        _check_latency(results["lmcache"][name]["latency"], opts.worlds, opts.tokens)
        _positive(results["lmcache"][name]["throughput"]["lookups_per_s"], f"{name} throughput")
        ratio = results["ratios"][name]["latency"]["1"]["p50_ms"]
        _positive(ratio, f"{name} p50 ratio")
    _positive(results["lmcache"]["hashing"]["1024"]["list_ns_per_token"], "LMCache hashing")
    _check_issue12_shape(results, opts)
    assert _descendants_and_strays(results["meta"]["run_id"]) - before == set()


def _check_issue12_shape(results: dict[str, Any], opts: BenchOptions) -> None:
    """Every issue-12 figure on both sides, its ratio, its target and its line in the table."""
    for name in VARIANTS:
        _check_figures(results["figures"]["lmcache"][name], opts.worlds, redis_too=False)
        ratio = results["ratios"][name]
        for key in ("rank_cpu_us_per_rank", "scheduler_cpu_us", "p99_ms"):
            _positive(ratio["latency"]["1"][key], f"{name} {key} ratio")
        _positive(ratio["throughput"], f"{name} throughput ratio")
        _positive(ratio["in_flight_cpu_per_lookup"], f"{name} CPU in flight ratio")
        _positive(ratio["hashing_speedup"]["8192"]["tensor"], f"{name} hashing speed-up")
    theirs = results["figures"]["lmcache"][RATIO_VARIANT]["idle"]
    assert theirs["rank_processes"] == sum(opts.worlds)
    assert theirs["rank_ms_per_s"] >= 0 and theirs["scheduler_ms_per_s"] >= 0
    names = " | ".join(t["name"] for t in results["targets"])
    for part in (
        "rank CPU per lookup, one in flight, world 1",
        "scheduler process CPU per lookup, one in flight, world 1",
        "e2e p50, world 1",
        "e2e p99, world 1",
        "throughput, 50 in flight",
        "total CPU per lookup (Redis included)",
        "hashing speed-up, list at 8192",
        "hashing speed-up, tensor at 8192",
        "lookup_cache (tight loop",
    ):
        assert part in names
    assert all(t["value"] is not None for t in results["targets"]), "a ratio was not measured"
    table = render(results)
    for line in (
        "CPU per lookup, one lookup in flight",
        "caller's polling loop included on both sides",
        "CPU per lookup, 50 in flight, world 1",
        "ours / LMCache backoff0",
        "LMCache / ours",
        "Targets (ratios: ours / LMCache backoff0",
        "Idle: no lookup, every rank process up, one client",
    ):
        assert line in table


def test_features_cost_compares_both_sides(
    real_server: RealServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.bench.features_cost import FIGURES

    args = _bench_args(
        "--features-cost", "--quick", "--redis-url", real_server.url, "--lookups", "40"
    )
    table = _one_figure_table(args, capsys, [label for _, label in FIGURES])
    assert "partial answers (world 2, 40 lookups a side" in table
    assert "results written" not in table  # no --out: bench-results.json is left alone
    results = run_features_cost(
        BenchOptions.defaults(quick=True, redis_url=real_server.url, lookups=20)
    )
    cost = results["features_cost"]
    assert cost["on"]["recorded"] >= cost["on"]["lookups"] > 0  # warm-up lookups too
    assert cost["off"]["recorded"] == 0
    for side in ("off", "on"):
        for key, _ in FIGURES:
            _positive(cost[side][key], f"{side} {key}")
        assert cost["ratio"]["e2e_p50_ms"] is not None
    json.dumps(results)


def test_floor_compares_ours_with_the_protocols_floor(
    real_server: RealServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.bench.floor_gap import FIGURES, IN_FLIGHT_FIGURES

    out = tmp_path / "floor.json"
    argv = ["--floor", "--quick", "--redis-url", real_server.url, "--out", str(out)]
    args = _bench_args(*argv, "--lookups", "40")
    table = _one_figure_table(args, capsys, [label for _, label in FIGURES])
    assert "ours against the protocol's floor, one lookup in flight (40 lookups" in table
    results = json.loads(out.read_text())
    gap = results["floor_gap"]
    assert set(gap["worlds"]) == {"1", "2"}  # --quick's worlds
    # CI and this checkout build the C extensions; a box without a compiler has no native side.
    assert gap["native_built"] is native_floor_built()
    sides = ("ours", "floor", "native") if gap["native_built"] else ("ours", "floor")
    for world, entry in gap["worlds"].items():
        assert [s for s in ("ours", "floor", "native") if s in entry] == list(sides)
        for side in sides:
            # Every lookup of every side answered the stub's full hit: the floors' ranks
            # ran report.lua to completion, not a shortcut.
            assert entry[side]["results"] == {"1024": 40}, (world, side)
            for key, _ in FIGURES:
                _positive(entry[side][key], f"world {world} {side} {key}")
        assert set(entry["ratio"]["ours_floor"]) == {key for key, _ in FIGURES}
        assert "lmcache" not in entry  # no --vs-lmcache
    # At --quick's throughput world (2), each side also kept --quick's window in flight.
    in_flight = gap["in_flight"]
    assert (in_flight["world"], in_flight["window"]) == (2, 200)
    assert "200 in flight, world 2" in table
    for side in sides:
        figures = in_flight[side]
        assert figures == gap["worlds"]["2"][side]["in_flight"]
        _positive(figures["lookups_per_s"], f"{side} in flight rate")
        # CPU counts the client process, the ranks and Redis together.
        parts = ("client_cpu_us", "ranks_cpu_us", "redis_cpu_us")
        assert all(figures[part] > 0 for part in parts), side
        assert figures["cpu_us"] == pytest.approx(sum(figures[part] for part in parts)), side
        # The floors' ranks always report: every completion is the stub's full hit.
        if side != "ours":
            assert set(figures["results"]) == {"1024"}, side
        assert figures["results"].get("1024", 0) > 0, side
    assert set(in_flight["ratio"]) == {"ours_floor"}
    assert set(in_flight["ratio"]["ours_floor"]) == {key for key, _ in IN_FLIGHT_FIGURES}
    client = redis.Redis.from_url(real_server.url)
    try:
        assert not list(client.scan_iter(match=f"bl:{{bench-{results['meta']['run_id']}-*"))
    finally:
        client.close()


def test_paired_runs_two_kinds_of_rank_in_alternating_rounds(
    real_server: RealServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "paired.json"
    # ours=<this checkout>: the source-tree side, here the same code as its partner.
    source = str(Path(__file__).resolve().parents[2])
    argv = ["--paired", f"ours={source},floor", "--quick", "--redis-url", real_server.url]
    args = _bench_args(*argv, "--rounds", "3", "--lookups", "15", "--out", str(out))
    table = _one_figure_table(args, capsys, ["B / A per round: median", "A ours=", "B floor"])
    assert "3 alternating rounds of 15 lookups a side" in table
    paired = json.loads(out.read_text())["paired"]
    assert paired["sides"] == [f"ours={source}", "floor"]
    for side in (0, 1):
        # Every lookup of both sides answered the stub's full hit, 3 rounds of 15.
        assert paired["results"][side] == {"1024": 45}, side
        cpu = paired["rank_cpu_us"][side]
        assert len(cpu["rounds"]) == 3
        for value in (*cpu["rounds"], cpu["median"], cpu["min"]):
            _positive(value, f"side {side} rank CPU")
    ratio = paired["ratio"]
    assert ratio["rounds"] == 3 and ratio["q1"] <= ratio["median"] <= ratio["q3"]
    _positive(ratio["median"], "ratio")


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("ours", "expected two sides"),
        ("ours,lmcache", "'lmcache'"),
        ("floor=/tmp,ours", "only ours takes a source tree"),
        ("ours=/nonexistent/tree,ours", "'/nonexistent/tree' holds no broker-lookup source"),
    ],
)
def test_paired_refuses_a_side_it_cannot_run_and_names_it(
    spec: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _bench_args("--paired", spec)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_redis_cost_counts_each_command_per_lookup_and_restores_the_slow_log(
    real_server: RealServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    conn = redis.Redis.from_url(real_server.url)
    slowlog_before = conn.config_get("slowlog-*")
    out = tmp_path / "cost.json"
    argv = ["--redis-cost", "--quick", "--redis-url", real_server.url, "--out", str(out)]
    args = _bench_args(*argv, "--worlds", "2", "--lookups", "30", "--duration", "0.5")
    table = _one_figure_table(args, capsys, ["world 2, one in flight", "world 2, in flight"])
    cost = json.loads(out.read_text())["redis_cost"]
    assert set(cost) == {"2"} and cost["2"]["floor_ops"] == 10  # 3 + 3 per rank + 1
    for phase in ("one_in_flight", "in_flight"):
        figures = cost["2"][phase]
        _positive(figures["redis_cpu_us"], phase)
        commands = figures["commands"]
        # Each lookup is one submit and, at world 2, two reports: one script call each with
        # one in flight, one a batch of submits or of a rank's reports with many.
        low = 1 if phase == "one_in_flight" else 0.01
        assert low <= commands["evalsha"]["calls"] <= 3.5, (phase, commands["evalsha"])
        assert commands["hset"]["calls"] >= 2.5, (phase, commands["hset"])  # submit + 2 reports
        assert {"submit", "report"} <= set(figures["scripts"]), phase
    assert "evalsha" in table and "submit" in table
    assert conn.config_get("slowlog-*") == slowlog_before
    conn.close()
