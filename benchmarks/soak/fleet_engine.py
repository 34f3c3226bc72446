"""One engine of the fleet soak: its rank processes, its scheduler client, traffic and faults.

An :class:`Engine` goes ``starting`` (ranks spawned, client waiting for their
heartbeats) -> ``running`` (lookups judged by its own
:class:`~benchmarks.soak.traffic.Traffic`, faults from its own
:class:`~benchmarks.soak.chaos.Chaos` if it is one of the faulty few) ->
``draining`` -> ``stopping`` -> ``gone``, driven by :meth:`Engine.tick` from the fleet
loop, which never blocks on one engine. Each engine judges its lookups against its own
:class:`~benchmarks.soak.faults.FaultLog`: a fault of one engine explains no
zero of another.

Its client always reaches the server through a fault proxy of its own, so a crash can
cut it; its ranks do only on a faulty engine (the proxies run in the soak's process, and
the machine has few cores). A stop is ordered (``term``: lookups drained, client closed,
SIGTERM to the ranks) or a crash (``kill``: SIGKILL to the ranks and the client's link
refused, with lookups in flight; they must still be answered, 0 being right then).
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from benchmarks.soak.chaos import Chaos, ChaosTiming
from benchmarks.soak.faults import FaultLog
from benchmarks.soak.rig import Beats, Proxies, Ranks
from benchmarks.soak.traffic import Traffic, make_prompts
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupConfig, LookupMetadata
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.local_ranks import STOP_TIMEOUT_S

__all__ = ["Engine", "FleetSetup"]

_START_TIMEOUT_S = 120.0  #: the machine is loaded: a rank's interpreter may take long to start
_DRAIN_GRACE_S = 3.0  #: past the hang limit, a drain gives up (those lookups are hangs)
_EXIT_CHECK_S = 0.5  #: how often a running engine checks that its ranks are alive


@dataclass(frozen=True)
class FleetSetup:
    """What every engine of one fleet soak shares."""

    url: str  #: the server, direct
    settings: dict[str, object]  #: config fields of every client and rank but the URL
    work: Path  #: each engine's logs and disk tiers go to a directory of its id in here
    monitor: redis.Redis  #: a direct connection, for heartbeat reads
    origin: float  #: the soak's start (``time.monotonic()``)
    quiet_s: float  #: how long a fault's effect outlasts it (see FaultLog)
    timing: ChaosTiming  #: of each faulty engine's faults
    concurrency: int  #: lookups each engine keeps in flight

    def config(self, url: str) -> LookupConfig:
        """The config of a client on ``url``."""
        return LookupConfig.from_mapping({**self.settings, "redis_url": url}, source="soak")

    @property
    def timeout_ms(self) -> int:
        """lookup_timeout_ms of every client and rank."""
        return self.config(self.url).lookup_timeout_ms


class Engine:
    """One engine: ``world`` rank processes and a client, from start to gone.

    Args:
        setup: The fleet's shared settings.
        slot: Its place in the fleet (a stopped engine's successor takes its slot).
        engine_id: A fresh id.
        world: Its world size (one process per rank, the production shape).
        faulty: Whether its ranks sit behind fault proxies and it gets faults.
        rng: Its own random source (prompts, traffic, faults).
        now: When it starts (its ranks are spawned now).
    """

    def __init__(
        self,
        setup: FleetSetup,
        slot: int,
        engine_id: str,
        world: int,
        faulty: bool,
        rng: random.Random,
        now: float,
    ) -> None:
        self.slot, self.engine_id, self.world, self.faulty = slot, engine_id, world, faulty
        self.setup = setup
        work = setup.work / engine_id
        work.mkdir(parents=True, exist_ok=True)
        ranks = [f"rank{r}" for r in range(world)]
        self.proxies = Proxies(setup.url, ["client", *(ranks if faulty else [])]).start()
        urls = [self.proxies.url(r) if faulty else setup.url for r in ranks]
        self.prompts = make_prompts(rng, world)
        self.ranks = Ranks(urls, engine_id, self.prompts, work, setup.timeout_ms, setup.settings)
        config = setup.config(self.proxies.url("client"))
        self.client = RedisAsyncLookupClient(
            config, LookupMetadata(engine_id=engine_id, world_size=world)
        )
        self.log = FaultLog(setup.quiet_s, setup.origin)
        self.traffic = Traffic(self.client, self.prompts, rng, self.log, setup.timeout_ms / 1000)
        self.chaos = None
        if faulty:
            beats = Beats(setup.monitor, KeySpace(engine_id), world)
            self.chaos = Chaos(
                rng, self.log, self.proxies, self.ranks, None, beats, config, setup.timing
            )
        self.state = "starting"
        self.signal = ""  #: how it stopped: "term", "kill", or "end" (the soak's end)
        self.unexpected_exits: list[int] = []  #: exit codes of ranks that died on their own
        self.exit_codes: list[int] = []
        self.started_at = now
        self.ready_at: float | None = None
        self.gone_at: float | None = None
        self._until = 0.0  #: the end of the current drain or stop
        self._exits_checked = 0.0
        self._exited: set[int] = set()  #: pids of ranks seen dead on their own
        self._closer: threading.Thread | None = None

    def tick(self, now: float, calm: bool) -> None:
        """Advance by one step of the fleet loop; ``calm``: no new fault starts."""
        if self.state == "starting":
            self._check_started(now)
        elif self.state == "running":
            self._run(now, calm)
        elif self.state == "draining":
            self.traffic.poll(now)
            if self.chaos is not None:
                self.chaos.settle(now)
            if not self.traffic.inflight or now >= self._until:
                self._after_drain(now)
        elif self.state == "stopping":
            self._check_stopped(now)

    def stop(self, signal: str, now: float) -> None:
        """Begin to stop: ``kill`` is a crash; ``term`` (or ``end``, the soak's end) drains
        its lookups, then closes the client and SIGTERMs the ranks."""
        self.signal = signal
        if self.chaos is not None:
            self.chaos.finish(now)
        if signal == "kill":
            self.log.begin("engine_kill", "all", now)  # explains every 0 from here on
            for proc in self.ranks.procs:
                proc.kill()
            client = self.proxies.by_name["client"]
            client.refuse()  # the scheduler is gone: nothing it sends arrives any more
            client.reset()
            self.gone_at = now
        self.state = "draining"
        self._until = now + self.setup.timeout_ms / 1000 + _DRAIN_GRACE_S

    def _check_started(self, now: float) -> None:
        if not self.client.stats().dead_ranks:
            self.state, self.ready_at = "running", now
            if self.chaos is not None:
                self.chaos.start(now)
            return
        failed = [(r, p.returncode) for r, p in enumerate(self.ranks.procs) if p.poll() is not None]
        if failed or now - self.started_at > _START_TIMEOUT_S:
            tails = {r: self.ranks.log_tail(r) for r, _ in failed}
            raise RuntimeError(f"engine {self.engine_id}: ranks did not start {failed}: {tails}")

    def _run(self, now: float, calm: bool) -> None:
        while len(self.traffic.inflight) < self.setup.concurrency:
            self.traffic.issue(now)
        self.traffic.poll(now)
        if self.chaos is None:
            pass
        elif calm:
            self.chaos.settle(now)
        else:
            self.chaos.tick(now)
        if now - self._exits_checked >= _EXIT_CHECK_S:
            self._exits_checked = now
            self._check_exits(now)

    def _check_exits(self, now: float) -> None:
        """A rank that exits on its own (not a kill of the soak's) is a failure: counted,
        and its engine's zeros from then on are explained by it."""
        for rank, proc in enumerate(self.ranks.procs):
            code = proc.poll()
            if code is not None and proc.pid not in self._exited:
                self._exited.add(proc.pid)
                self.unexpected_exits.append(code)
                self.log.begin("rank_exit", f"rank{rank}", now, f"exit code {code}")

    def _after_drain(self, now: float) -> None:
        """The client closes (on a thread: it may wait for its threads); ``term`` ranks
        get SIGTERM."""
        self._closer = threading.Thread(
            target=self.client.close, name=f"close-{self.engine_id}", daemon=True
        )
        self._closer.start()
        for proc in self.ranks.procs:
            if proc.poll() is None:
                proc.terminate()
        self.state, self._until = "stopping", now + STOP_TIMEOUT_S

    def _check_stopped(self, now: float) -> None:
        alive = [p for p in self.ranks.procs if p.poll() is None]
        if alive and now >= self._until:
            for proc in alive:
                proc.kill()  # ignored SIGTERM for STOP_TIMEOUT_S: counted by its exit code
            return
        if alive or (self._closer is not None and self._closer.is_alive()):
            return
        self.exit_codes = [p.wait() for p in self.ranks.procs]
        self.proxies.stop()
        self.gone_at = self.gone_at or now
        self.state = "gone"

    def join(self, timeout_s: float) -> None:
        """Wait (bounded) for the client's close, at the soak's end."""
        if self._closer is not None:
            self._closer.join(timeout_s)

    def record(self) -> dict[str, Any]:
        """This engine for the report: its id, shape, life and how it ended."""
        origin = self.setup.origin

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - origin, 1)

        return {
            "engine_id": self.engine_id,
            "slot": self.slot,
            "world": self.world,
            "faulty": self.faulty,
            "stopped_by": self.signal,
            "started_s": rel(self.started_at),
            "ready_s": rel(self.ready_at),
            "gone_s": rel(self.gone_at),
            **{k: self.traffic.counts[k] for k in ("lookups", "zero", "wrong", "lost_hits")},
            "exit_codes": self.exit_codes,
            "faults": self.log.counts(),
        }
