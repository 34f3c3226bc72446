"""``python -m benchmarks.soak``: mixed traffic against real rank processes while things break.

What runs: a client in this process sends what a scheduler sends (hits, misses, partial
hits, cancels, and lookup ids used again; :mod:`benchmarks.soak.traffic`) to N
worker rank processes (``python -m workers``). Every process, the client included, reaches
the server through its own TCP fault proxy (:mod:`benchmarks.soak.rig`), so a
network fault hits one process while the others run on.

What breaks: every few seconds (``--chaos-every``), one fault drawn at random
(:mod:`benchmarks.soak.chaos`):

* a rank is SIGKILLed, then restarted;
* the embedded server restarts, losing its data (it runs without persistence);
* one process's network fails: a hold, a reset, a lost reply, or added latency.

No fault starts in the last ``--calm`` seconds, so the lookups there show that everything
recovered.

What it counts (:mod:`benchmarks.soak.report`). These must be 0, and the
command exits 1 if one is not:

* ``wrong``: a result that is neither 0 nor the right answer;
* ``hangs``: a lookup still unanswered ``lookup_timeout_ms`` + 2 s after it started;
* ``leaked_keys``: keys of the engine without a TTL (streams are trimmed instead);
* ``lost_hits``: a 0 for a hit although no fault was in effect during the lookup's life
  (:mod:`benchmarks.soak.faults` says which fault was in effect when).

The rest is there to be read: the faults of each kind, p99 latency, the RSS of every process
at the start and at the end, the client's breaker openings and rejected lookups, and the
slowest recovery after each kind of fault. The summary goes to stdout as JSON and to stderr
for a person.

With ``--engines N`` it soaks a fleet instead: N engines on one server, churning, with
duplicates of one engine's scheduler and rank (:mod:`benchmarks.soak.fleet`). With
``--liveness`` it soaks one engine's liveness instead: ranks around a synchronous slow
engine, stalls and slow links, nothing killed (:mod:`benchmarks.soak.liveness`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import redis

from benchmarks.soak.chaos import Chaos, ChaosTiming
from benchmarks.soak.faults import FaultLog
from benchmarks.soak.fleet import FleetOptions, run_fleet
from benchmarks.soak.fleet_report import format_fleet_summary
from benchmarks.soak.liveness import LivenessOptions, format_liveness, run_liveness
from benchmarks.soak.report import format_summary, passed, summarize
from benchmarks.soak.rig import Beats, Proxies, Ranks, rss_kb
from benchmarks.soak.traffic import CHUNK, Prompt, Traffic, make_prompts
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.processes import ExitCode
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.transport.connection import make_factory

__all__ = ["add_soak_parser", "cmd_soak", "main", "run_soak", "setup_soak_parser"]

HELP = "chaos soak: mixed lookups while ranks are killed, the server restarts, the network fails"

_TIMEOUT_MS = 2000  #: lookup_timeout_ms of the client and the ranks
_CONCURRENCY = 32  #: lookups the client keeps in flight
_FLEET_CALM_S = FleetOptions().calm_s


def _config(url: str) -> LookupConfig:
    return LookupConfig(redis_url=url, chunk_size=CHUNK, lookup_timeout_ms=_TIMEOUT_MS)


def leaked_keys(client: redis.Redis, keys: KeySpace) -> tuple[list[str], dict[str, int]]:
    """Keys of the engine without a TTL (streams excepted), and the stream lengths."""
    leaked: list[str] = []
    streams: dict[str, int] = {}
    for key in client.scan_iter(match=keys.pattern, count=500):
        name = key.decode() if isinstance(key, bytes) else str(key)
        if client.type(key) in (b"stream", "stream"):
            streams[name] = int(client.xlen(key))
        elif int(client.pttl(key)) == -1:
            leaked.append(name)
    return leaked, streams


def _drive(traffic: Traffic, chaos: Chaos, until: float, calm_s: float) -> None:
    chaos.start(time.monotonic())
    while (now := time.monotonic()) < until:
        while len(traffic.inflight) < _CONCURRENCY:
            traffic.issue(now)
        traffic.poll(now)
        if now < until - calm_s:
            chaos.tick(now)
        else:  # the calm at the end: everything must be right again
            chaos.settle(now)
        time.sleep(0.002)  # the scheduler's step loop; lookup_cache itself never waits
    chaos.finish(time.monotonic())
    # The lookups still in flight are answered (or hang) within the hang limit.
    drain_until = time.monotonic() + traffic.timeout_s + 3.0
    while traffic.inflight and time.monotonic() < drain_until:
        traffic.poll(time.monotonic())
        chaos.settle(time.monotonic())
        time.sleep(0.005)


def _wait_alive(client: RedisAsyncLookupClient, ranks: Ranks, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stats().dead_ranks:
        failed = [p.returncode for p in ranks.procs if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"ranks did not start (exit codes {failed}); see their logs")
        time.sleep(0.05)


def _quiet_s(config: LookupConfig) -> float:
    """How long a fault's effect outlasts it: a lookup sent just before its end may time
    out, a rank it silenced may be taken for dead until its next heartbeat, then 1 s of
    reconnects."""
    return (config.lookup_timeout_ms + config.heartbeat_ttl_ms) / 1000 + 1.0


def run_soak(
    duration_s: float,
    ranks: int,
    redis_url: str | None = None,
    seed: int = 0,
    chaos_every_s: tuple[float, float] = ChaosTiming.every_s,
    workdir: str | None = None,
    calm_s: float = 0.0,
) -> dict[str, Any]:
    """Soak for ``duration_s`` seconds against ``ranks`` rank processes; return the summary.

    A fault comes every ``chaos_every_s`` seconds (random within the range), none in the
    last ``calm_s`` seconds (lookups there show that everything recovered). The ranks'
    logs and disk tiers go to ``workdir`` (kept), or to a temporary directory.
    """
    rng = random.Random(seed)
    with ExitStack() as stack:
        server = None
        if redis_url is None:
            server = stack.enter_context(EmbeddedServer(startup_timeout_s=30.0))
            redis_url = server.url
        work = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bl-soak-")))
        work.mkdir(parents=True, exist_ok=True)
        keys = KeySpace(f"soak-{uuid.uuid4().hex[:8]}")
        config = _config(redis_url)
        proxies, procs, client, prompts = _rig(stack, rng, redis_url, keys, ranks, work)
        monitor = stack.enter_context(make_factory(config, "bl-soak", socket_timeout_s=1.0)())
        summary: dict[str, Any] = {"rss_kb_start": _rss(procs, server)}
        started = time.monotonic()
        log = FaultLog(_quiet_s(config), started)
        timing = ChaosTiming(every_s=chaos_every_s)
        chaos = Chaos(rng, log, proxies, procs, server, Beats(monitor, keys, ranks), config, timing)
        traffic = Traffic(client, prompts, rng, log, config.lookup_timeout_ms / 1000)
        _drive(traffic, chaos, started + duration_s, calm_s)
        summary["rss_kb_end"] = _rss(procs, server)
        summary["duration_s"] = round(time.monotonic() - started, 1)
        client.close()
        summary["rank_exit_codes"] = procs.stop()
        leaked, summary["stream_lengths"] = leaked_keys(monitor, keys)
        summary["proxy_stats"] = proxies.stats()
        return summary | summarize(traffic, log, client.stats(), leaked)


def _rig(
    stack: ExitStack, rng: random.Random, url: str, keys: KeySpace, ranks: int, work: Path
) -> tuple[Proxies, Ranks, RedisAsyncLookupClient, list[Prompt]]:
    """A proxy per process, the ranks and the client behind them, all alive; ``stack``
    stops them in order (faults cleared, client, ranks, then the proxies)."""
    proxies = Proxies(url, ["client", *(f"rank{r}" for r in range(ranks))]).start()
    stack.callback(proxies.stop)  # after the processes stop: they use it to the end
    prompts = make_prompts(rng, ranks)
    urls = [proxies.url(f"rank{r}") for r in range(ranks)]
    procs = Ranks(urls, keys.engine_id, prompts, work, _TIMEOUT_MS)
    stack.callback(procs.stop)
    client = RedisAsyncLookupClient(
        _config(proxies.url("client")), LookupMetadata(engine_id=keys.engine_id, world_size=ranks)
    )
    stack.callback(client.close)
    stack.callback(proxies.clear)  # first on the way out: nothing stays held or slowed
    _wait_alive(client, procs, 120.0)
    return proxies, procs, client, prompts


def _rss(ranks: Ranks, server: EmbeddedServer | None) -> dict[str, int | None]:
    pids: dict[str, int | None] = {"client": os.getpid()}  # the fault proxies run in it too
    pids.update({f"rank{r}": p.pid for r, p in enumerate(ranks.procs)})
    pids["server"] = server.pid if server is not None else None
    return {name: rss_kb(pid) for name, pid in pids.items()}


def _interval(text: str) -> tuple[float, float]:
    """``"MIN-MAX"`` or ``"S"`` seconds, for ``--chaos-every``."""
    low, _, high = text.partition("-")
    try:
        pair = (float(low), float(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not seconds or MIN-MAX seconds: {text!r}") from None
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"need 0 < MIN <= MAX, not {text!r}")
    return pair


def setup_soak_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``python -m benchmarks.soak``."""
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--ranks", type=int, help="rank processes (default 2; not with --engines)")
    p.add_argument("--redis-url", help="use this server (default: an embedded one, restarted)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    low, high = ChaosTiming.every_s
    flow, fhigh = FleetOptions().chaos_every_s
    p.add_argument(
        "--chaos-every",
        type=_interval,
        metavar="MIN-MAX",
        help=f"seconds between faults, random in the range (default {low:g}-{high:g}; "
        f"with --engines, per faulty engine, {flow:g}-{fhigh:g})",
    )
    p.add_argument(
        "--calm",
        type=float,
        help="seconds at the end without new faults (default 0; with --engines, 10)",
    )
    p.add_argument("--json", help="also write the summary as JSON to this file")
    p.add_argument(
        "--workdir", help="keep the ranks' logs and disk tiers here (default: a temp dir)"
    )
    p.add_argument(
        "--liveness",
        action="store_true",
        help="a liveness soak instead: --ranks ranks around a synchronous 30 ms engine, "
        "2.5 s engine stalls, the last rank's link 150-200 ms each way; exit 1 on any wrong "
        "answer, dead_rank answer, fenced report, broken promise or hang",
    )
    fleet = p.add_argument_group("fleet (many engines on one server)")
    fleet.add_argument(
        "--engines", type=int, default=0, help="engines at a time (default 0: one engine)"
    )
    clow, chigh = FleetOptions().churn_every_s
    fleet.add_argument(
        "--churn-every",
        type=_interval,
        default=FleetOptions().churn_every_s,
        metavar="MIN-MAX",
        help=f"seconds between engine stops, random in the range (default {clow:g}-{chigh:g})",
    )
    fleet.add_argument(
        "--faulty", type=int, default=FleetOptions().faulty, help="engines that get faults"
    )
    fleet.add_argument(
        "--no-duplicates",
        action="store_true",
        help="no second scheduler or rank process on an engine id (they run by default "
        "where the build has one owner per rank)",
    )


def add_soak_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``soak`` on an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = subparsers.add_parser("soak", help="chaos soak; see --help")
    setup_soak_parser(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.soak ARGS``, from a checkout."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=HELP)
    setup_soak_parser(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), as an exit code
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    return cmd_soak(args)


def cmd_soak(args: argparse.Namespace) -> int:
    """Run the soak (one engine, or a fleet with ``--engines``); print the summary as JSON
    on stdout and for a person on stderr.

    OK (0) iff every check holds (one engine: no wrong result, hang, leaked key or lost
    hit); else FAILED.
    """
    problem = _usage_problem(args)
    if problem:
        print(f"python -m benchmarks.soak: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    if args.engines:
        summary = run_fleet(_fleet_options(args), args.redis_url, args.workdir)
        text, ok = format_fleet_summary(summary), bool(summary["passed"])
    elif args.liveness:
        options = LivenessOptions(
            duration_s=args.duration, ranks=args.ranks or LivenessOptions.ranks, seed=args.seed
        )
        summary = run_liveness(options, args.redis_url, args.workdir)
        text, ok = format_liveness(summary), bool(summary["passed"])
    else:
        summary = run_soak(
            args.duration,
            2 if args.ranks is None else args.ranks,
            args.redis_url,
            args.seed,
            args.chaos_every or ChaosTiming.every_s,
            args.workdir,
            args.calm or 0.0,
        )
        text, ok = format_summary(summary), passed(summary)
    dumped = json.dumps(summary, indent=2, sort_keys=True)
    print(dumped)
    if args.json:
        Path(args.json).write_text(dumped + "\n")
    print(text, file=sys.stderr)
    return ExitCode.OK if ok else ExitCode.FAILED


def _usage_problem(args: argparse.Namespace) -> str:
    """What is wrong with the arguments, or ""."""
    calm = args.calm if args.calm is not None else (_FLEET_CALM_S if args.engines else 0.0)
    if args.duration <= 0 or not 0 <= calm < args.duration:
        return "--duration must be > 0 and 0 <= --calm < --duration"
    if args.liveness:
        if args.engines or args.chaos_every or args.calm is not None:
            return "--liveness takes no --engines, --chaos-every or --calm: it injects its own"
        if args.ranks is not None and args.ranks < 2:
            return "--liveness needs --ranks >= 2: a fast rank beside a slow link"
        return ""
    if args.engines:
        if args.ranks is not None:
            return "--ranks is not for --engines: engines run 1 or 2 ranks each"
        if args.engines < 2 or args.faulty < 0:
            return "--engines must be >= 2 (one is the soak without it) and --faulty >= 0"
    elif args.ranks is not None and args.ranks < 1:
        return "--ranks must be >= 1"
    return ""


def _fleet_options(args: argparse.Namespace) -> FleetOptions:
    return FleetOptions(
        engines=args.engines,
        duration_s=args.duration,
        seed=args.seed,
        churn_every_s=args.churn_every,
        chaos_every_s=args.chaos_every or FleetOptions().chaos_every_s,
        calm_s=_FLEET_CALM_S if args.calm is None else args.calm,
        faulty=args.faulty,
        duplicates=False if args.no_duplicates else None,
    )
