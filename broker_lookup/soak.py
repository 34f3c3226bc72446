"""``broker-lookup soak``: mixed traffic against real rank processes while things break.

A client drives hits, misses, partial hits, cancels and id reuse against N rank
processes, while ranks are SIGKILLed and restarted and the embedded server restarts at
random. Every prompt's right answer (the min over ranks) is known, so it counts:

* ``wrong``: a result that is neither 0 nor the right answer (must be 0);
* ``hangs``: a lookup still unanswered ``lookup_timeout_ms`` + 2 s after it started (must be 0);
* ``leaked_keys``: keys of the engine without a TTL, streams excepted (must be 0);
plus p99 latency and the RSS of every process at start and at the end."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from broker_lookup._procs import child_env, python_module, spawn, terminate
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.connection import make_factory
from broker_lookup.embedded import EmbeddedServer
from broker_lookup.keys import KeySpace

__all__ = ["add_soak_parser", "cmd_soak", "run_soak", "setup_soak_parser"]

_CHUNK, _CHUNKS, _PROMPTS = 16, 8, 48
_TIMEOUT_MS, _HANG_GRACE_S, _CONCURRENCY = 2000, 2.0, 32
_LOAD_DELAY_MS = 5  #: per disk chunk, so cancels and kills land mid-prefetch
_CHAOS_EVERY_S = (3.0, 8.0)
_SAMPLES = 20_000  #: latencies kept for the p99
_COUNTS = ("lookups", "right", "zero", "wrong", "hangs", "cancels", "reused_ids", "rank_kills")


def rss_kb(pid: int | None) -> int | None:
    """VmRSS of ``pid`` in KiB (None if it is gone)."""
    try:
        found = re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    except (OSError, TypeError):
        return None
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Prompt:
    """A prompt and the chunks each rank holds of it; the right answer is their min."""

    tokens: list[int]
    stored: list[int]  #: leading chunks preloaded, per rank
    tier: str


def make_prompts(rng: random.Random, ranks: int) -> list[Prompt]:
    """Full hits, misses and partial hits, some of them on the (slow) disk tier."""
    out = []
    for i in range(_PROMPTS):
        stored = [  # kinds: 0 full hit, 1 miss (rank 0 has nothing), 2 partial hit
            _CHUNKS if i % 3 == 0 else 0 if i % 3 == 1 and r == 0 else rng.randint(1, _CHUNKS)
            for r in range(ranks)
        ]
        tokens = list(range(i * 100_000, i * 100_000 + _CHUNKS * _CHUNK))
        out.append(Prompt(tokens, stored, "disk" if i % 4 == 0 else "memory"))
    return out


class Ranks:
    """The rank processes: start, kill -9 and restart, stop, measure."""

    def __init__(self, url: str, engine_id: str, prompts: list[Prompt], workdir: Path) -> None:
        self.n = len(prompts[0].stored)
        self.workdir = workdir
        preload = workdir / "preload.json"
        items = [
            {"tokens": p.tokens, "ranks": [r], "fraction": p.stored[r] / _CHUNKS, "tier": p.tier}
            for p in prompts
            for r in range(self.n)
        ]
        preload.write_text(json.dumps({"prompts": items}))
        settings = {"redis_url": url, "chunk_size": _CHUNK, "lookup_timeout_ms": _TIMEOUT_MS}
        self._env = child_env(os.environ, {env_name(k): str(v) for k, v in settings.items()})
        self._args = [
            "--engine-id", engine_id, "--world-size", str(self.n), "--metrics-port", "0",
            "--preload", str(preload), "--connect-timeout", "60",
            "--load-delay-ms", str(_LOAD_DELAY_MS), "--log-level", "WARNING",
        ]  # fmt: skip
        self.started: dict[int, float] = {}
        self.procs = [self.start(r) for r in range(self.n)]

    def start(self, rank: int) -> subprocess.Popen[bytes]:
        args = [*self._args, "--rank", str(rank), "--disk-dir", str(self.workdir / f"d{rank}")]
        self.started[rank] = time.monotonic()
        with open(self.workdir / f"rank-{rank}.log", "ab") as log:
            return spawn(python_module("workers", args), self._env, output=log)

    def kill_and_restart(self, rank: int) -> None:
        self.procs[rank].kill()  # SIGKILL: a crash, no ordered shutdown
        self.procs[rank].wait()
        self.procs[rank] = self.start(rank)

    def stop(self) -> list[int]:
        # A rank inside interpreter start-up has no handler yet: let it reach one first.
        time.sleep(max(0.0, max(self.started.values()) + 0.5 - time.monotonic()))
        return terminate(self.procs, 30.0)


@dataclass
class Traffic:
    """Lookups in flight and everything counted about them."""

    client: RedisAsyncLookupClient
    prompts: list[Prompt]
    rng: random.Random
    inflight: dict[str, tuple[Prompt, float]] = field(default_factory=dict)
    free_ids: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    serial: int = 0
    observed: int = 0

    def issue(self, now: float) -> None:
        """One new lookup; a fifth reuse the id of a finished one (a new generation)."""
        if self.free_ids and self.rng.random() < 0.2:
            lookup_id = self.free_ids.pop(self.rng.randrange(len(self.free_ids)))
            self.counts["reused_ids"] += 1
        else:
            self.serial += 1
            lookup_id = f"soak-{self.serial}"
        prompt = self.rng.choice(self.prompts)
        self.client.lookup(prompt.tokens, lookup_id)
        self.inflight[lookup_id] = (prompt, now)
        self.counts["lookups"] += 1

    def poll(self, now: float) -> None:
        """Collect answers, judge them, cancel a few, flag hangs."""
        for lookup_id, (prompt, started) in list(self.inflight.items()):
            if self.rng.random() < 0.002:
                self.client.cancel_lookup(lookup_id)
                self._done(lookup_id, "cancels")
                continue
            got = self.client.lookup_cache(lookup_id)
            if got is None:
                if now - started > _TIMEOUT_MS / 1000 + _HANG_GRACE_S:
                    self.client.cancel_lookup(lookup_id)
                    self._done(lookup_id, "hangs")
                continue
            self._observe(now - started)
            right = min(prompt.stored) * _CHUNK
            verdict = "right" if got == right else "zero" if got == 0 else "wrong"
            self.client.clear_lookup_status(lookup_id)
            self._done(lookup_id, verdict)

    def _observe(self, seconds: float) -> None:
        """Reservoir sample of latencies: p99 without a list as long as the soak."""
        self.observed += 1
        if len(self.latencies) < _SAMPLES:
            self.latencies.append(seconds)
        elif (slot := self.rng.randrange(self.observed)) < _SAMPLES:
            self.latencies[slot] = seconds

    def _done(self, lookup_id: str, verdict: str) -> None:
        del self.inflight[lookup_id]
        self.counts[verdict] += 1
        if len(self.free_ids) < 1000:
            self.free_ids.append(lookup_id)


def leaked_keys(client: redis.Redis, keys: KeySpace) -> tuple[list[str], dict[str, int]]:
    """Keys of the engine without a TTL (streams excepted), and the stream lengths."""
    leaked, streams = [], {}
    for key in client.scan_iter(match=keys.pattern, count=500):
        name = key.decode() if isinstance(key, bytes) else str(key)
        if client.type(key) in (b"stream", "stream"):
            streams[name] = int(client.xlen(key))
        elif int(client.pttl(key)) == -1:
            leaked.append(name)
    return leaked, streams


def _drive(traffic: Traffic, ranks: Ranks, server: EmbeddedServer | None, until: float) -> None:
    rng = traffic.rng
    next_chaos = time.monotonic() + rng.uniform(*_CHAOS_EVERY_S)
    while (now := time.monotonic()) < until:
        while len(traffic.inflight) < _CONCURRENCY:
            traffic.issue(now)
        traffic.poll(now)
        if now >= next_chaos:
            if server is not None and rng.random() < 0.3:
                server.restart()
                traffic.counts["server_restarts"] += 1
            else:
                ranks.kill_and_restart(rng.randrange(ranks.n))
                traffic.counts["rank_kills"] += 1
            next_chaos = time.monotonic() + rng.uniform(*_CHAOS_EVERY_S)
        time.sleep(0.002)  # the scheduler's step loop; lookup_cache itself never waits
    drain_until = time.monotonic() + _TIMEOUT_MS / 1000 + _HANG_GRACE_S + 1
    while traffic.inflight and time.monotonic() < drain_until:
        traffic.poll(time.monotonic())
        time.sleep(0.005)


def _wait_alive(client: RedisAsyncLookupClient, ranks: Ranks, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.stats()["dead_ranks"]:
        failed = [p.returncode for p in ranks.procs if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"ranks did not start (exit codes {failed}); see their logs")
        time.sleep(0.05)


def run_soak(
    duration_s: float, ranks: int, redis_url: str | None = None, seed: int = 0
) -> dict[str, Any]:
    """Soak for ``duration_s`` seconds against ``ranks`` rank processes; return the summary."""
    rng = random.Random(seed)
    with ExitStack() as stack:
        server = None
        if redis_url is None:
            server = stack.enter_context(EmbeddedServer(startup_timeout_s=30.0))
            redis_url = server.url
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bl-soak-")))
        keys = KeySpace(f"soak-{uuid.uuid4().hex[:8]}")
        config = LookupConfig(redis_url=redis_url, chunk_size=_CHUNK, lookup_timeout_ms=_TIMEOUT_MS)
        prompts = make_prompts(rng, ranks)
        procs = Ranks(redis_url, keys.engine_id, prompts, workdir)
        stack.callback(procs.stop)
        client = RedisAsyncLookupClient(
            config, LookupMetadata(engine_id=keys.engine_id, world_size=ranks)
        )
        stack.callback(client.close)
        _wait_alive(client, procs, 120.0)
        summary: dict[str, Any] = {"rss_kb_start": _rss(procs, server)}
        traffic = Traffic(client, prompts, rng)
        started = time.monotonic()
        _drive(traffic, procs, server, started + duration_s)
        summary["rss_kb_end"] = _rss(procs, server)
        summary["duration_s"] = round(time.monotonic() - started, 1)
        client.close()
        summary["rank_exit_codes"] = procs.stop()
        conn = stack.enter_context(make_factory(config, "bl-soak")())
        leaked, summary["stream_lengths"] = leaked_keys(conn, keys)
        return summary | _summary(traffic, client.stats(), leaked)


def _rss(ranks: Ranks, server: EmbeddedServer | None) -> dict[str, int | None]:
    pids: dict[str, int | None] = {"client": os.getpid()}
    pids.update({f"rank{r}": p.pid for r, p in enumerate(ranks.procs)})
    pids["server"] = server.pid if server is not None else None
    return {name: rss_kb(pid) for name, pid in pids.items()}


def _summary(traffic: Traffic, stats: dict[str, Any], leaked: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {k: traffic.counts[k] for k in (*_COUNTS, "server_restarts")}
    lat = sorted(traffic.latencies)
    out.update(
        leaked_keys=len(leaked),
        leaked_examples=leaked[:5],
        p99_latency_ms=round(lat[int(len(lat) * 0.99)] * 1000, 2) if lat else 0.0,
        client_outcomes=stats["outcomes"],
        client_redis_errors=stats["redis_errors"],
    )
    return out


def setup_soak_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``broker-lookup soak``."""
    p.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    p.add_argument("--redis-url", help="use this server (default: an embedded one, restarted)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def add_soak_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``soak`` on an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = subparsers.add_parser("soak", help="chaos soak; see --help")
    setup_soak_parser(p)
    return p


def cmd_soak(args: argparse.Namespace) -> int:
    """Run the soak, print the summary as JSON; 0 iff no wrong result, hang or leaked key."""
    if args.duration <= 0 or args.ranks < 1:
        print("broker-lookup soak: --duration must be > 0 and --ranks >= 1", file=sys.stderr)
        return 2
    summary = run_soak(args.duration, args.ranks, args.redis_url, args.seed)
    print(json.dumps(summary, indent=2, sort_keys=True))
    ok = summary["wrong"] == summary["hangs"] == summary["leaked_keys"] == 0
    return 0 if ok else 1
