"""``python -m benchmarks.soak --liveness``: a rank is alive while it works, however slowly.

What runs: one engine of ``ranks`` rank processes (:mod:`benchmarks.soak.slow_rank`),
each around a synchronous engine that answers on the rank's read loop, as LMCache does
without async loading: ``sync_ms`` per lookup (30 ms), and now and then one call stalled
``stall_ms`` (2.5 s, longer than the lease and the heartbeat TTL). Every rank reaches the
server through its own fault proxy; the last ``slow_links`` ranks' links are slow, a
delay redrawn every few seconds within ``delay_ms`` (150-200 ms) each way. The
scheduler's client, in this process, keeps ``concurrency`` lookups in flight and now and
then sends a burst of ``burst`` more at once (one batch of the fast ranks several leases
long); every lookup is a full hit on every rank. Nothing is killed: every rank lives to
the end.

What it counts. These must be 0, and the command exits 1 if one is not:

* ``wrong``: an answer other than the full hit or 0;
* ``dead_rank``: lookups the client answered ``dead_rank`` (every rank process lived),
  but for those answered while the box itself stalled or less than a heartbeat TTL + 1 s
  after (:mod:`benchmarks.soak.box_stalls`: the server or this process did not run for
  1 s or more), counted apart as ``dead_rank_in_box_stalls``;
* ``fenced``: reports the ranks sent that Redis answered ``fenced`` (each rank is its
  sole owner: no second process ever claims it);
* ``broken_promises``: hits answered for a lookup whose pins a rank released early (not
  when its pin TTL ended: nobody retrieves them here);
* ``hangs``: lookups unanswered past their deadline + 2 s;
* ``unexpected_exits``: rank processes that ended before the stop.

The zeros (a lookup answered 0 at its deadline: a hit the scheduler did not get), the
latency, the lease claims and losses of each rank and the engine's stalls are there to
be read.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks.soak.box_stalls import BoxStalls
from benchmarks.soak.rig import Proxies
from benchmarks.soak.traffic import CHUNK, CHUNKS
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata, env_name
from broker_lookup.processes import child_env, long_options
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.transport.connection import make_factory

__all__ = ["MUST_BE_ZERO", "LivenessOptions", "format_liveness", "run_liveness"]

#: The counts that fail the liveness soak unless they are 0.
MUST_BE_ZERO = ("wrong", "dead_rank", "fenced", "broken_promises", "hangs", "unexpected_exits")
_REPO = Path(__file__).resolve().parents[2]
_START_S = 120.0  #: the box is loaded: a rank's interpreter may take long to start
_STOP_S = 30.0
_HANG_GRACE_S = 2.0
_REDRAW_S = (2.0, 5.0)  #: how long one slow link's delay holds before it is drawn again


@dataclass(frozen=True)
class LivenessOptions:
    """How a liveness soak runs (the CLI's ``--liveness`` with ``--duration``, ``--ranks``,
    ``--seed``)."""

    duration_s: float = 120.0
    ranks: int = 2
    slow_links: int = 1  #: the last ranks' links are slow
    sync_ms: float = 30.0
    stall_ms: float = 2500.0
    stall_every_s: tuple[float, float] = (8.0, 16.0)  #: per rank
    delay_ms: tuple[float, float] = (150.0, 200.0)  #: each way
    concurrency: int = 8
    burst: int = 50  #: lookups sent at once, every ``burst_every_s``
    burst_every_s: tuple[float, float] = (15.0, 25.0)
    #: lookup_timeout_ms: a burst queued behind a slow link and a stall fits
    timeout_ms: int = 30_000
    seed: int = 0


def _settings(url: str, options: LivenessOptions) -> dict[str, object]:
    """Config fields of the client and every rank; leases and heartbeats are the defaults."""
    return {
        "redis_url": url,
        "chunk_size": CHUNK,
        "lookup_timeout_ms": options.timeout_ms,
        "lookup_timeout_max_ms": options.timeout_ms,
    }


class _Rank:
    """One slow rank process; its stdout (``ready``, then the summary line) in a file."""

    def __init__(self, rank: int, url: str, engine_id: str, o: LivenessOptions, work: Path):
        self.out_path, self.log_path = work / f"rank-{rank}.out", work / f"rank-{rank}.log"
        flags = {
            "engine-id": engine_id,
            "world-size": o.ranks,
            "rank": rank,
            "sync-ms": o.sync_ms,
            "stall-ms": o.stall_ms,
            "stall-every": f"{o.stall_every_s[0]}-{o.stall_every_s[1]}",
            "seed": o.seed * 1000 + rank,
        }
        env = {env_name(k): str(v) for k, v in _settings(url, o).items()}
        argv = [sys.executable, "-m", "benchmarks.soak.slow_rank", *long_options(flags)]
        self._files: list[IO[bytes]] = [self.out_path.open("wb"), self.log_path.open("wb")]
        self.proc = subprocess.Popen(
            argv,
            cwd=_REPO,  # -m finds the checkout's benchmarks package there
            env=child_env(os.environ, env),
            stdin=subprocess.DEVNULL,
            stdout=self._files[0],
            stderr=self._files[1],
        )

    def stop(self) -> dict[str, Any] | None:
        """SIGTERM, then its summary (None if it printed none: it died or hung)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()
        for f in self._files:
            f.close()
        lines = self.out_path.read_text(errors="replace").strip().splitlines()
        try:
            summary: dict[str, Any] = json.loads(lines[-1])
        except (IndexError, ValueError):
            return None
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class _Traffic:
    """Lookups of full hits, ``concurrency`` in flight; every answer judged."""

    def __init__(self, client: RedisAsyncLookupClient, concurrency: int, timeout_s: float):
        self.client, self.concurrency, self.timeout_s = client, concurrency, timeout_s
        self.full = CHUNKS * CHUNK
        self.inflight: dict[str, float] = {}
        self.answers: dict[str, int] = {}
        self.counts: Counter[str] = Counter()
        self.latencies_ms: list[float] = []
        self.dead_rank_at: list[tuple[float, int]] = []  #: (when seen, how many answers)
        self._dead_seen = 0
        self._n = 0

    def issue(self, now: float, more: int = 0) -> None:
        """Up to ``concurrency`` in flight, and ``more`` beyond (a burst)."""
        for _ in range(max(0, self.concurrency - len(self.inflight)) + more):
            self._n += 1
            lookup_id = f"lv-{self._n}"
            base = self._n * 1000
            self.client.lookup(list(range(base, base + self.full)), lookup_id)
            self.inflight[lookup_id] = now
            self.counts["lookups"] += 1

    def poll(self, now: float) -> None:
        for lookup_id, started in list(self.inflight.items()):
            result = self.client.lookup_cache(lookup_id)
            if result is None:
                if now - started > self.timeout_s + _HANG_GRACE_S:
                    del self.inflight[lookup_id]
                    self.counts["hangs"] += 1
                continue
            del self.inflight[lookup_id]
            self.client.clear_lookup_status(lookup_id)  # as vLLM clears on allocation
            self.answers[lookup_id] = result
            self.latencies_ms.append((now - started) * 1000)
            verdict = "right" if result == self.full else "zero" if result == 0 else "wrong"
            self.counts[verdict] += 1
        dead = self.client.stats().outcomes.get("dead_rank", 0)
        if dead > self._dead_seen:
            self.dead_rank_at.append((now, dead - self._dead_seen))
            self._dead_seen = dead


class _SlowLinks:
    """The slow ranks' proxies: each holds a delay drawn in ``delay_ms`` for 2-5 s."""

    def __init__(self, rng: random.Random, proxies: Proxies, names: list[str], o: LivenessOptions):
        self._rng, self._proxies, self._range = rng, proxies, o.delay_ms
        self._next = dict.fromkeys(names, 0.0)
        self.drawn: list[float] = []

    def tick(self, now: float) -> None:
        for name, at in self._next.items():
            if now >= at:
                ms = round(self._rng.uniform(*self._range), 1)
                self._proxies.by_name[name].delay(ms)
                self.drawn.append(ms)
                self._next[name] = now + self._rng.uniform(*_REDRAW_S)


def run_liveness(
    options: LivenessOptions, redis_url: str | None = None, workdir: str | None = None
) -> dict[str, Any]:
    """Run the liveness soak; return its summary (``passed``: every count of
    :data:`MUST_BE_ZERO` is 0)."""
    o = options
    rng = random.Random(o.seed)
    with ExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(EmbeddedServer(startup_timeout_s=30.0)).url
        work = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bl-live-")))
        work.mkdir(parents=True, exist_ok=True)
        engine_id = f"liveness-{uuid.uuid4().hex[:8]}"
        names = [f"rank{r}" for r in range(o.ranks)]
        proxies = Proxies(redis_url, names).start()
        stack.callback(proxies.stop)  # after the ranks stop: they use it to the end
        ranks = [_Rank(r, proxies.url(n), engine_id, o, work) for r, n in enumerate(names)]
        for rank in ranks:
            stack.callback(rank.kill)
        config = LookupConfig.from_mapping(_settings(redis_url, o), source="soak")
        client = RedisAsyncLookupClient(
            config, LookupMetadata(engine_id=engine_id, world_size=o.ranks)
        )
        stack.callback(client.close)
        stack.callback(proxies.clear)  # first on the way out: nothing stays slowed
        monitor = stack.enter_context(make_factory(config, "bl-soak", socket_timeout_s=10.0)())
        _wait_alive(client, ranks)
        stalls = BoxStalls(monitor).start()
        stack.callback(stalls.stop)
        slow = _SlowLinks(rng, proxies, names[o.ranks - o.slow_links :], o)
        traffic = _Traffic(client, o.concurrency, o.timeout_ms / 1000)
        started = time.monotonic()
        _drive(traffic, slow, stalls, started + o.duration_s, o, rng)
        seconds = time.monotonic() - started
        exited = [r for r, rank in enumerate(ranks) if rank.proc.poll() is not None]
        outcomes = dict(client.stats().outcomes)
        proxies.clear()
        client.close()
        summaries = [rank.stop() for rank in ranks]
        stalls.stop()
        grace_s = config.heartbeat_ttl_ms / 1000 + 1.0
        in_stalls = sum(n for at, n in traffic.dead_rank_at if stalls.explains(at, grace_s))
        box: dict[str, float] = {"dead_rank_in_box_stalls": in_stalls}
        box.update(box_stalls=len(stalls.stalls), box_stalled_s=stalls.total_s())
        summary = _summary(o, traffic, outcomes, summaries, exited, slow, seconds, proxies)
        summary.update(box, dead_rank=summary["dead_rank"] - in_stalls)
        summary["passed"] = all(summary[k] == 0 for k in MUST_BE_ZERO)
        return summary


def _wait_alive(client: RedisAsyncLookupClient, ranks: list[_Rank]) -> None:
    deadline = time.monotonic() + _START_S
    while client.stats().dead_ranks:
        failed = {str(r.log_path): r.proc.returncode for r in ranks if r.proc.poll() is not None}
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"slow ranks did not start (exit codes {failed}); see their logs")
        time.sleep(0.05)


def _drive(
    traffic: _Traffic,
    slow: _SlowLinks,
    stalls: BoxStalls,
    until: float,
    o: LivenessOptions,
    rng: random.Random,
) -> None:
    next_burst = time.monotonic() + rng.uniform(*o.burst_every_s) / 2
    while (now := time.monotonic()) < until:
        stalls.step(now)
        slow.tick(now)
        burst = o.burst if now >= next_burst else 0
        if burst:
            next_burst = now + rng.uniform(*o.burst_every_s)
            traffic.counts["bursts"] += 1
        traffic.issue(now, burst)
        traffic.poll(now)
        # The scheduler's step loop (lookup_cache never waits); this process runs the
        # fault proxies too, which a busier loop would slow beyond their delay.
        time.sleep(0.005)
    drain_until = time.monotonic() + traffic.timeout_s + _HANG_GRACE_S + 1.0
    while traffic.inflight and time.monotonic() < drain_until:
        slow.tick(time.monotonic())
        traffic.poll(time.monotonic())
        time.sleep(0.005)
    traffic.poll(float("inf"))  # what is still unanswered now hangs


def _summary(
    o: LivenessOptions,
    traffic: _Traffic,
    outcomes: dict[str, int],
    summaries: list[dict[str, Any] | None],
    exited: list[int],
    slow: _SlowLinks,
    seconds: float,
    proxies: Proxies,
) -> dict[str, Any]:
    ranks = [s or {} for s in summaries]
    released = {i for s in ranks for i in s.get("released_early", [])}
    broken = sorted(i for i in released if traffic.answers.get(i, 0) > 0)
    lat = sorted(traffic.latencies_ms)

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

    counts = {k: traffic.counts[k] for k in ("lookups", "right", "zero", "wrong", "hangs")}
    out: dict[str, Any] = {
        "mode": "liveness",
        "bursts": traffic.counts["bursts"],
        "options": asdict(o),
        "duration_s": round(seconds, 1),
        **counts,
        "dead_rank": outcomes.get("dead_rank", 0),
        "fenced": sum(int(s.get("counts", {}).get("report_fenced", 0)) for s in ranks),
        "broken_promises": len(broken),
        "broken_examples": broken[:5],
        "unexpected_exits": len(exited) + sum(1 for s in summaries if s is None),
        "released_early": len(released),
        "released_at_pin_ttl": sum(int(s.get("released_at_ttl", 0)) for s in ranks),
        "lease_claims": [s.get("claims") for s in ranks],
        "leases_lost": [s.get("lost") for s in ranks],
        "engine_calls": [s.get("calls") for s in ranks],
        "stalls": [s.get("stalls") for s in ranks],
        "slow_ranks": list(range(o.ranks - o.slow_links, o.ranks)),
        "delays_drawn_ms": [min(slow.drawn, default=0), max(slow.drawn, default=0)],
        "client_outcomes": {k: v for k, v in outcomes.items() if v},
        "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
        "lookups_per_s": round(traffic.counts["lookups"] / seconds, 1) if seconds else 0.0,
        # A box starved of CPU can keep a live process from its beat for a lease: read
        # the counts with it.
        "load_average_1m": round(os.getloadavg()[0], 1),
        "proxy_stats": proxies.stats(),
    }
    out["passed"] = all(out[k] == 0 for k in MUST_BE_ZERO)
    return out


def format_liveness(s: dict[str, Any]) -> str:
    """The summary for a person."""
    o = s["options"]
    lines = [
        f"liveness soak: {s['duration_s']} s, {o['ranks']} ranks at {o['sync_ms']:g} ms per "
        f"lookup, stalls of {o['stall_ms']:g} ms (per rank {s['stalls']}), slow links on ranks "
        f"{s['slow_ranks']} ({s['delays_drawn_ms'][0]}-{s['delays_drawn_ms'][1]} ms each way)",
        f"{s['lookups']} lookups ({s['bursts']} bursts of {o['burst']}): "
        f"{s['right']} full hits, {s['zero']} zero; "
        f"{s['lookups_per_s']}/s; latency p50 {s['latency_ms']['p50']} ms, "
        f"p99 {s['latency_ms']['p99']} ms, max {s['latency_ms']['max']} ms",
        f"lease claims {s['lease_claims']}, leases lost {s['leases_lost']}, "
        f"released early {s['released_early']} (at the pin TTL "
        f"{s['released_at_pin_ttl']}); client outcomes {s['client_outcomes']}",
        f"box stalls (server or soak not running for 1 s or more): {s['box_stalls']}, "
        f"{s['box_stalled_s']} s; dead_rank answers in them {s['dead_rank_in_box_stalls']}",
        "must be 0: " + ", ".join(f"{k} {s[k]}" for k in MUST_BE_ZERO),
        f"load average (1 min) at the end: {s['load_average_1m']}",
        "OK" if s["passed"] else "FAILED",
    ]
    return "\n".join(lines)
