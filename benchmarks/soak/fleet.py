"""``python -m benchmarks.soak --engines N``: a fleet of engines on one server, churning, breaking.

What runs: N engines (slots), each with its scheduler client in this process and its
own rank processes (``python -m workers``, one per rank: world size 1 in even slots,
2 in odd ones), each engine sending its own mixed traffic
(:mod:`benchmarks.soak.fleet_engine`). Throughout the run:

* churn (:mod:`benchmarks.soak.churn`): engines stop, by SIGTERM (ordered) or
  SIGKILL (a crash), and a new engine with a fresh id takes each one's slot;
* faults on a few engines (the odd slots, at most ``faulty``): rank kills and the
  network faults of the single-engine soak, less often;
* duplicates (:mod:`benchmarks.soak.fleet_duplicates`): a second scheduler on
  the steady engine's id and a second process serving its rank, when the build has
  one owner per rank;
* the server's ``used_memory``, key count and CPU sampled every 2 s
  (:mod:`benchmarks.soak.server_stats`).

At the end every engine stops and the keys left are audited
(:mod:`benchmarks.soak.fleet_checks`).
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.soak.chaos import ChaosTiming
from benchmarks.soak.churn import ChurnEvent, plan_churn
from benchmarks.soak.fleet_checks import Features
from benchmarks.soak.fleet_duplicates import Duplicates
from benchmarks.soak.fleet_engine import Engine, FleetSetup
from benchmarks.soak.fleet_report import fleet_summary
from benchmarks.soak.server_stats import ServerStats
from benchmarks.soak.traffic import CHUNK
from broker_lookup.config import LookupConfig
from broker_lookup.errors import ConfigError
from broker_lookup.tools.embedded import EmbeddedServer
from broker_lookup.transport.connection import make_factory

__all__ = ["FleetOptions", "run_fleet"]

_TIMEOUT_MS = 3000  #: lookup_timeout_ms: the machine runs many processes on few cores
_ENGINE_TTLS_MS = (15_000, 30_000, 60_000)  #: tried in turn where the build has a TTL
_CONCURRENCY = 6  #: lookups each engine keeps in flight
_STOP_S = 60.0  #: the whole fleet's stop at the end, at most


class FleetOptions:
    """How a fleet soak runs (the CLI's flags)."""

    def __init__(
        self,
        engines: int = 8,
        duration_s: float = 120.0,
        seed: int = 0,
        churn_every_s: tuple[float, float] = (6.0, 10.0),
        chaos_every_s: tuple[float, float] = (8.0, 16.0),
        calm_s: float = 10.0,
        faulty: int = 3,
        duplicates: bool | None = None,
        stream_cap: int = 2000,
    ) -> None:
        self.engines, self.duration_s, self.seed = engines, duration_s, seed
        self.churn_every_s, self.chaos_every_s = churn_every_s, chaos_every_s
        self.calm_s, self.faulty = calm_s, faulty
        #: None: run them where the build has one owner per rank
        self.duplicates = duplicates
        #: stream_maxlen and done_maxlen, so a live engine's streams reach their plateau
        #: early in the run (the default, 20,000, would take it minutes)
        self.stream_cap = stream_cap


class _Fleet:
    """Every engine of the soak by slot, the ones on their way out, and the gone ones."""

    def __init__(self, setup: FleetSetup, rng: random.Random, options: FleetOptions) -> None:
        self.setup, self.rng = setup, rng
        self.run_id = uuid.uuid4().hex[:6]
        faulty = [s for s in range(1, options.engines, 2)][: options.faulty]
        self._faulty = set(faulty)
        self._generation: Counter[int] = Counter()
        now = time.monotonic()
        self.live = {slot: self._spawn(slot, now) for slot in range(options.engines)}
        self.leaving: list[Engine] = []
        self.gone: list[Engine] = []

    def _spawn(self, slot: int, now: float) -> Engine:
        self._generation[slot] += 1
        engine_id = f"fleet-{self.run_id}-{slot}-{self._generation[slot]}"
        world = 1 if slot % 2 == 0 else 2
        rng = random.Random(self.rng.random())
        return Engine(self.setup, slot, engine_id, world, slot in self._faulty, rng, now)

    @property
    def engines(self) -> list[Engine]:
        return [*self.live.values(), *self.leaving, *self.gone]

    def tick(self, now: float, calm: bool) -> None:
        for engine in [*self.live.values(), *self.leaving]:
            engine.tick(now, calm)
        for engine in [e for e in self.leaving if e.state == "gone"]:
            self.leaving.remove(engine)
            self.gone.append(engine)

    def churn(self, event: ChurnEvent, now: float) -> bool:
        """Stop the slot's engine and start its successor; False if it is not serving yet."""
        engine = self.live[event.slot]
        if engine.state != "running":
            return False
        engine.stop(event.signal, now)
        self.leaving.append(engine)
        self.live[event.slot] = self._spawn(event.slot, now)
        return True

    def stop_all(self, now: float) -> None:
        """Begin the ordered stop of every live engine (the soak's end)."""
        for engine in self.live.values():
            if engine.state in ("starting", "running"):
                engine.stop("end", now)
        self.leaving.extend(self.live.values())
        self.live = {}

    def abort(self) -> None:
        """After an error: every process killed, every client closed, every proxy stopped."""
        for engine in [*self.live.values(), *self.leaving]:
            engine.proxies.clear()
            for proc in engine.ranks.procs:
                proc.kill()
                proc.wait()
            engine.client.close()
            engine.proxies.stop()


def _engine_ttl_ms(url: str, features: Features) -> int | None:
    """A short engine TTL, so gone engines' keys expire within the run; None without one."""
    if not features.engine_ttl:
        return None
    for ms in _ENGINE_TTLS_MS:
        try:
            LookupConfig.from_mapping({"redis_url": url, "engine_ttl_ms": ms}, source="soak")
        except ConfigError:
            continue
        return ms
    return int(getattr(LookupConfig(redis_url=url), "engine_ttl_ms"))  # noqa: B009 (may lack it)


def _settings(engine_ttl_ms: int | None, stream_cap: int) -> dict[str, object]:
    settings: dict[str, object] = {
        "chunk_size": CHUNK,
        "lookup_timeout_ms": _TIMEOUT_MS,
        "stream_maxlen": stream_cap,
        "done_maxlen": stream_cap,
        # The prompts differ between ranks on purpose: no warning for each of them.
        "rank_spread_warn_share": 1.0,
    }
    if engine_ttl_ms is not None:
        settings["engine_ttl_ms"] = engine_ttl_ms
    return settings


def _quiet_s() -> float:
    """As the single-engine soak's: lookup timeout + heartbeat TTL + 1 s of reconnects."""
    config = LookupConfig(lookup_timeout_ms=_TIMEOUT_MS)
    return (config.lookup_timeout_ms + config.heartbeat_ttl_ms) / 1000 + 1.0


def run_fleet(
    options: FleetOptions, redis_url: str | None = None, workdir: str | None = None
) -> dict[str, Any]:
    """Run the fleet soak; return its summary (see ``fleet_report``)."""
    features = Features.detect()
    duplicates = features.ownership if options.duplicates is None else options.duplicates
    rng = random.Random(options.seed)
    with ExitStack() as stack:
        embedded = redis_url is None
        if redis_url is None:
            redis_url = stack.enter_context(EmbeddedServer(startup_timeout_s=30.0)).url
        work = Path(workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bl-fleet-")))
        work.mkdir(parents=True, exist_ok=True)
        ttl_ms = _engine_ttl_ms(redis_url, features)
        factory = make_factory(LookupConfig(redis_url=redis_url), "bl-soak", socket_timeout_s=5.0)
        monitor = stack.enter_context(factory())
        timing = ChaosTiming(every_s=options.chaos_every_s)
        origin = time.monotonic()
        setup = FleetSetup(
            redis_url,
            _settings(ttl_ms, options.stream_cap),
            work,
            monitor,
            origin,
            _quiet_s(),
            timing,
            _CONCURRENCY,
        )
        fleet = _Fleet(setup, rng, options)
        stack.callback(fleet.abort)  # a no-op after a clean end: nothing is left live
        _wait_running(fleet)
        start = time.monotonic()
        stats = ServerStats(monitor, origin)
        at = start - origin + options.duration_s * 0.15, start - origin + options.duration_s * 0.6
        dups = Duplicates(setup, fleet.live[0], rng, *at)
        if duplicates:
            stack.callback(dups.finish, 10.0)
        run = _run(fleet, dups if duplicates else None, stats, start, rng, options)
        _stop(fleet)
        if duplicates:
            dups.finish(10.0)
        return fleet_summary(fleet.engines, dups, stats, monitor, features, ttl_ms, embedded, run)


def _run(
    fleet: _Fleet,
    dups: Duplicates | None,
    stats: ServerStats,
    start: float,
    rng: random.Random,
    options: FleetOptions,
) -> dict[str, Any]:
    """Drive the fleet for the soak's duration; the churn plan, and the server's CPU and
    the lookups sent before and after."""
    plan = plan_churn(
        rng,
        options.engines,
        options.duration_s - options.calm_s,
        options.churn_every_s,
        min_life_s=2 * options.churn_every_s[0],
    )
    before = {"cpu_s": stats.cpu_s(), "lookups": _lookups(fleet)}
    _drive(fleet, dups, stats, plan, start, options)
    seconds = time.monotonic() - start
    after = {"cpu_s": stats.cpu_s(), "lookups": _lookups(fleet, dups)}
    return {"seconds": seconds, "before": before, "after": after, "plan": plan}


def _lookups(fleet: _Fleet, dups: Duplicates | None = None) -> int:
    total = sum(e.traffic.counts["lookups"] for e in fleet.engines)
    return total + (dups.traffic.counts["lookups"] if dups and dups.traffic else 0)


def _wait_running(fleet: _Fleet) -> None:
    """Tick until every first engine serves (their traffic starts as each does)."""
    while any(e.state == "starting" for e in fleet.live.values()):
        fleet.tick(time.monotonic(), calm=True)
        time.sleep(0.01)


def _drive(
    fleet: _Fleet,
    dups: Duplicates | None,
    stats: ServerStats,
    plan: list[ChurnEvent],
    start: float,
    options: FleetOptions,
) -> None:
    until, calm_from = start + options.duration_s, start + options.duration_s - options.calm_s
    pending = list(plan)
    while (now := time.monotonic()) < until:
        fleet.tick(now, calm=now >= calm_from)
        # A stop whose engine is still starting waits until it serves.
        for event in [e for e in pending if now >= start + e.at_s]:
            if fleet.churn(event, now):
                pending.remove(event)
        if dups is not None:
            dups.tick(now)
        stats.tick(now)
        time.sleep(0.002)  # the scheduler's step loop; lookup_cache itself never waits


def _stop(fleet: _Fleet) -> None:
    """Stop every engine in order and wait until all are gone (bounded)."""
    fleet.stop_all(time.monotonic())
    deadline = time.monotonic() + _STOP_S
    while fleet.leaving and time.monotonic() < deadline:
        fleet.tick(time.monotonic(), calm=True)
        time.sleep(0.01)
    if fleet.leaving:
        raise RuntimeError(f"engines did not stop in {_STOP_S:.0f} s: {fleet.leaving}")
    for engine in fleet.gone:
        engine.join(5.0)
