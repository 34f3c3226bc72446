"""Liveness is a beat, not a batch: a slow engine, a slow link or one stalled engine call
never makes a live rank look dead. Real server, a real rank process around a synchronous
engine (LMCache without async loading answers on the rank's read loop), the scheduler's
client in this process:

* a burst of lookups at 30 ms of engine time each (100 in the default run, 500 in the long
  leg): several seconds of one batch, several leases long;
* the rank's link at 200 ms each way (through the fault proxy);
* one engine call stalled 2.5 s.

In each: 0 ``dead_rank`` answers while the rank's process lives, 0 fenced reports from
the sole owner (one lease claim), 0 broken promises (no hit's pins released early), and
every lookup a full hit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from faultkit import FAST, MakeLookupClient, alive, answer, config, prompt
from helpers import RealServer

from broker_lookup.config.env import env_name
from broker_lookup.processes import child_env, long_options
from faultproxy.proxy import FaultProxy

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPT = prompt(3000)
FULL = len(PROMPT)
#: Deadlines with room for a whole burst behind one synchronous engine (500 x 30 ms);
#: the lease and heartbeat stay FAST's (1.5 s), shorter than any of the faults.
PATIENT: dict[str, Any] = {"lookup_timeout_ms": 40_000, "lookup_timeout_max_ms": 40_000}
REPO = Path(__file__).parents[2]


class SlowRank:
    """A ``benchmarks.soak.slow_rank`` process; :meth:`stop` returns its summary."""

    def __init__(self, url: str, engine_id: str, sync_ms: int, stall_at: int, stall_ms: int):
        values = {**FAST, **PATIENT, "redis_url": url}
        extra = {env_name(k): str(v) for k, v in values.items()}
        flags = {"engine-id": engine_id, "sync-ms": sync_ms, "stall-at": stall_at}
        flags["stall-ms"] = stall_ms
        argv = [sys.executable, "-m", "benchmarks.soak.slow_rank", *long_options(flags)]
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,  # -m finds the checkout's benchmarks package there
            env=child_env(os.environ, extra),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def start_rank() -> Iterator[list[SlowRank]]:
    started: list[SlowRank] = []
    yield started
    for rank in started:
        rank.kill()


def _run(
    url: str,
    real_server: RealServer,
    engine_id: str,
    clients: MakeLookupClient,
    started: list[SlowRank],
    lookups: int,
    *,
    sync_ms: int = 0,
    stall_at: int = 0,
    stall_ms: int = 0,
    proxy: FaultProxy | None = None,
    delay_ms: int = 0,
) -> None:
    rank = SlowRank(url, engine_id, sync_ms, stall_at, stall_ms)
    started.append(rank)
    client = clients(config(real_server.url, **PATIENT), engine_id, 1)
    alive(client)
    if proxy is not None:
        proxy.delay(delay_ms)
    ids = [f"l-{i}" for i in range(lookups)]
    for lookup_id in ids:
        client.lookup(PROMPT, lookup_id)
    answers = {i: answer(client, i, timeout=90) for i in ids}
    assert rank.alive()
    if proxy is not None:
        proxy.clear()
    outcomes = dict(client.stats().outcomes)
    summary = rank.stop()
    counts = summary["counts"]
    broken = [i for i in summary["released_early"] if answers.get(i, 0) > 0]
    seen = {
        "outcomes": {k: v for k, v in outcomes.items() if v},
        "fenced": counts.get("report_fenced", 0),
        "claims": summary["claims"],
        "broken": len(broken),
        "hits": Counter(answers.values()),
    }
    assert seen["outcomes"].get("dead_rank", 0) == 0, seen
    assert seen["fenced"] == 0 and seen["claims"] == 1, seen
    assert seen["broken"] == 0, seen
    assert answers == dict.fromkeys(ids, FULL), seen


def test_a_burst_behind_a_synchronous_engine_never_lapses_the_lease(
    real_server: RealServer, engine_id: str, clients: MakeLookupClient, start_rank: list[SlowRank]
) -> None:
    """100 lookups at 30 ms each: 3 s of one batch, twice the lease."""
    _run(real_server.url, real_server, engine_id, clients, start_rank, 100, sync_ms=30)


@pytest.mark.long
def test_a_burst_of_500_behind_a_synchronous_engine_never_lapses_the_lease(
    real_server: RealServer, engine_id: str, clients: MakeLookupClient, start_rank: list[SlowRank]
) -> None:
    _run(real_server.url, real_server, engine_id, clients, start_rank, 500, sync_ms=30)


def test_one_engine_call_stalled_past_the_lease_costs_nothing(
    real_server: RealServer, engine_id: str, clients: MakeLookupClient, start_rank: list[SlowRank]
) -> None:
    """The 5th of 20 lookups stalls its engine call 2.5 s (the lease is 1.5 s)."""
    _run(
        real_server.url,
        real_server,
        engine_id,
        clients,
        start_rank,
        20,
        stall_at=5,
        stall_ms=2500,
    )


@pytest.mark.long
def test_a_slow_link_never_lapses_the_lease_nor_starves_the_reads(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    clients: MakeLookupClient,
    start_rank: list[SlowRank],
) -> None:
    """The rank's link at 200 ms each way; 50 lookups behind a 30 ms engine."""
    _run(
        fault_proxy.url,
        real_server,
        engine_id,
        clients,
        start_rank,
        50,
        sync_ms=30,
        proxy=fault_proxy,
        delay_ms=200,
    )
