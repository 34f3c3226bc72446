"""The fleet soak's two impostors on the steady engine: a second scheduler, a second rank.

Both arrive while the steady engine (slot 0, never churned, no faults) serves, as a
second vLLM replica started with the same ``engine_id`` would:

* a second scheduler client on its engine id, sending lookups of the same prompts
  under ids of its own. It must answer every one 0 (it owns nothing; recompute), so its
  :class:`~benchmarks.soak.traffic.Traffic` expects 0 for each prompt and
  any other answer counts as ``wrong`` there (reported as ``duplicate_answers``);
* a second process serving its rank 0, holding every prompt in full. Were it to take
  deliveries, the steady engine's misses and partial hits would come back as full
  hits: ``wrong`` on the steady engine. It is expected to stand down and exit on its
  own; its exit code is reported.

With one owner per (engine, rank), both hold; without it they would fail, so the fleet
soak runs them only where the build has it (or when told to).
"""

from __future__ import annotations

import random
import signal
import threading
from collections import Counter
from typing import Any

from benchmarks.soak.faults import FaultLog
from benchmarks.soak.fleet_engine import Engine, FleetSetup
from benchmarks.soak.rig import Ranks
from benchmarks.soak.traffic import CHUNKS, Prompt, Traffic
from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.config import LookupMetadata
from broker_lookup.processes import ExitCode

__all__ = ["Duplicates"]

_CONCURRENCY = 4  #: the duplicate scheduler's lookups in flight


class Duplicates:
    """The second scheduler and rank process of ``owner``, from ``start_s`` on.

    The scheduler sends lookups until ``stop_s`` (seconds since the soak's start), then
    drains and closes; the rank process runs until it exits or the soak ends.
    """

    def __init__(
        self, setup: FleetSetup, owner: Engine, rng: random.Random, start_s: float, stop_s: float
    ) -> None:
        self.setup = setup
        self.owner = owner
        self.rng = rng
        self.start_at = setup.origin + start_s
        self.stop_at = setup.origin + stop_s
        self.state = "waiting"
        self.client: RedisAsyncLookupClient | None = None
        self.traffic: Traffic | None = None
        self.rank: Ranks | None = None
        self.rank_exit: tuple[int, float] | None = None  #: (exit code, when)
        self.refused = ""  #: the error the duplicate scheduler's client raised, if any
        self.rank_ran_to_end = False  #: the rank process was still running at the end
        self._closer: threading.Thread | None = None
        self._drain_until = 0.0

    def tick(self, now: float) -> None:
        """Start them when due (and the owner serves), drive the scheduler's lookups."""
        if self.state == "waiting" and now >= self.start_at and self.owner.state == "running":
            self._start(now)
        if self.rank is not None and self.rank_exit is None:
            code = self.rank.procs[0].poll()
            if code is not None:
                self.rank_exit = (code, now)
        if self.traffic is None or self.state == "done":
            return
        if self.state == "running":
            while len(self.traffic.inflight) < _CONCURRENCY:
                self.traffic.issue(now)
            if now >= self.stop_at:
                self.state, self._drain_until = "draining", now + self._timeout_s + 3.0
        self.traffic.poll(now)
        if self.state == "draining" and (not self.traffic.inflight or now >= self._drain_until):
            self._close()

    @property
    def _timeout_s(self) -> float:
        return self.setup.timeout_ms / 1000

    def _start(self, now: float) -> None:
        owner, setup = self.owner, self.setup
        world = owner.world
        full = [Prompt(p.tokens, [CHUNKS] * world, p.tier) for p in owner.prompts]
        work = setup.work / f"{owner.engine_id}-duplicate"
        work.mkdir(parents=True, exist_ok=True)
        # All its ranks on the server directly: world 1 (the steady engine's) is one process.
        urls = [setup.url] * world
        self.rank = Ranks(urls, owner.engine_id, full, work, setup.timeout_ms, setup.settings)
        meta = LookupMetadata(engine_id=owner.engine_id, world_size=world)
        try:
            self.client = RedisAsyncLookupClient(setup.config(setup.url), meta)
        except Exception as exc:  # it must answer 0, not raise: reported, no lookups sent
            self.refused = repr(exc)
            self.state = "done"
            return
        nothing = [Prompt(p.tokens, [0] * world, p.tier) for p in owner.prompts]
        log = FaultLog(setup.quiet_s, setup.origin)
        self.traffic = Traffic(self.client, nothing, self.rng, log, self._timeout_s)
        self.traffic.prefix = "duplicate"
        self.state = "running"

    def _close(self) -> None:
        assert self.client is not None  # started before it drains
        self._closer = threading.Thread(target=self.client.close, name="close-duplicate")
        self._closer.start()
        self.state = "done"

    def finish(self, timeout_s: float) -> None:
        """At the soak's end: close the scheduler (bounded), stop the rank if it still runs."""
        if self.client is not None and self._closer is None:
            self._close()
        if self._closer is not None:
            self._closer.join(timeout_s)
        if self.rank is not None and self.rank_exit is None and self.rank.procs:
            self.rank.stop(timeout_s)
            self.rank_ran_to_end = True

    def report(self) -> dict[str, Any]:
        """Its lookups and answers, the scheduler's outcomes, and how the rank ended."""
        if self.rank is None:
            return {"ran": False}
        counts = self.traffic.counts if self.traffic is not None else Counter[str]()
        outcomes = self.client.stats().outcomes if self.client is not None else {}
        exit_code, exited_at = self.rank_exit or (None, None)
        return {
            "ran": True,
            "engine_id": self.owner.engine_id,
            "scheduler_raised": self.refused,
            "scheduler_lookups": counts["lookups"],
            "scheduler_answered_0": counts["right"],
            "scheduler_answered_not_0": counts["wrong"],
            "scheduler_hangs": counts["hangs"],
            "scheduler_outcomes": outcomes,
            "rank_exit_code": exit_code,
            "rank_exit_name": _exit_name(exit_code),
            "rank_ran_to_end": self.rank_ran_to_end,
            "rank_exited_s": None if exited_at is None else round(exited_at - self.setup.origin, 1),
        }


def _exit_name(code: int | None) -> str | None:
    """The name of a ``python -m workers`` exit code (``ExitCode``), or of its signal."""
    if code is None:
        return None
    if code < 0:
        return signal.Signals(-code).name
    try:
        return ExitCode(code).name
    except ValueError:
        return None
