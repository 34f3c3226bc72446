"""Nothing outlives its engine, with real processes on a real server: an idle engine keeps
every key past ``engine_ttl_ms`` and still answers; once every process of it is killed
(SIGKILL: no clean shutdown deletes anything), all its keys are gone within the bound."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from faultkit import (
    FAST,
    MakeLookupClient,
    RankProcess,
    StartRank,
    alive,
    answer,
    config,
    prompt,
    second_scheduler,
)
from helpers import RealServer, engine_keys, holds_for, wait_until

from broker_lookup.config import env_name
from broker_lookup.processes import child_env
from broker_lookup.protocol.keys import KeySpace

# Real processes, seconds each: in the long leg (`-m long`), to keep the default run
# within its CI budget; the in-process engine TTL tests (tests/protocol/test_engine_ttl.py)
# run on fakeredis and a real server in the default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

HOT = prompt(1000)  # in memory on every rank: a full hit
#: Short enough to wait through; the FAST lookup hashes (deadline plus 500 ms) fit under it.
SHORT: dict[str, Any] = {"engine_ttl_ms": 3000, "key_grace_ms": 500}
TTL_S = SHORT["engine_ttl_ms"] / 1000
CLIENT_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "client_process.py"


def _scheduler(url: str, engine_id: str, log: Path) -> RankProcess:
    """The scheduler's client as its own process (``client_process.py``)."""
    values = {**FAST, **SHORT, "redis_url": url}
    env = child_env(os.environ, {env_name(k): str(v) for k, v in values.items()})
    argv = [sys.executable, str(CLIENT_SCRIPT), engine_id, "2", *map(str, HOT)]
    return RankProcess(argv, env, log)


def test_an_idle_engine_keeps_its_keys_and_a_killed_one_leaves_none(
    real_server: RealServer,
    engine_id: str,
    rank_procs: StartRank,
    clients: MakeLookupClient,
    tmp_path: Path,
) -> None:
    url, ks = real_server.url, KeySpace(engine_id)
    conn = redis.Redis.from_url(url)
    ranks = [rank_procs(url, engine_id, 2, r, [{"tokens": HOT}], **SHORT) for r in range(2)]
    scheduler = _scheduler(url, engine_id, tmp_path / "client.log")
    try:
        found = wait_until(lambda: re.search(r"^answer (\d+)$", scheduler.log(), re.M), timeout=120)
        assert isinstance(found, re.Match) and int(found.group(1)) == len(HOT)
        conn.xadd(ks.requests, {"m": b"junk"})  # dead-lettered: every lasting key exists
        wait_until(lambda: conn.exists(ks.dead), timeout=10)

        def all_there() -> bool:
            return all(conn.exists(key) for key in ks.lasting)

        holds_for(all_there, 2 * TTL_S, message="every lasting key of the idle engine")
        # The scheduler process holds the engine's lease: this client asks the idle ranks
        # beside it (a second scheduler would otherwise answer 0 without submitting).
        client = second_scheduler(clients(config(url, **SHORT), engine_id, 2))
        alive(client)
        client.lookup(HOT, "after-idle")
        assert answer(client, "after-idle", timeout=10) == len(HOT)
        client.close()

        for proc in (*ranks, scheduler):
            proc.kill9()
        left = engine_keys(conn, engine_id)
        assert set(ks.lasting) <= set(left)
        assert {k: ttl for k, ttl in left.items() if not 0 < ttl <= SHORT["engine_ttl_ms"]} == {}
        wait_until(
            lambda: not engine_keys(conn, engine_id),
            timeout=TTL_S + 30,  # the server expires them by TTL_S; the rest is a loaded box
            interval=0.2,
            message="every key of the killed engine expired",
        )
    finally:
        scheduler.close()
