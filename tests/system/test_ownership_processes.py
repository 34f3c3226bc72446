"""One owner per rank with real rank processes on a real server: a duplicated rank never
answers, waits, exits 4 after its bounded wait and takes over once the owner is gone; an
owner paused past its lease comes back fenced (none of its reports is recorded)."""

from __future__ import annotations

import signal
import urllib.error
import urllib.request

import pytest
import redis
from faultkit import MakeLookupClient, StartRank, alive, answer, beat, config, prompt
from helpers import RealServer, wait_until

from broker_lookup.processes import ExitCode, free_port
from broker_lookup.protocol.keys import KeySpace, rank_role

# Real processes, seconds each: in the long leg (`-m long`), to keep the default run
# within its CI budget; the in-process ownership tests (tests/protocol/test_ownership.py,
# test_owners_in_process.py) run on fakeredis and a real server in the default run.
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.long]

PROMPT = prompt(5000, chunks=256)  # 1,024 tokens at the tests' chunk size
FULL = len(PROMPT)
SLOW = prompt(9000)  # on disk: 8 chunks x 250 ms of loading
CLAIM_WAIT_S = 8.0


def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:  # not listening yet
        return 0, str(exc)


def _holder_pid(conn: redis.Redis, ks: KeySpace) -> int | None:
    pid = beat(conn, ks.heartbeat(0)).get("pid")
    return pid if isinstance(pid, int) else None


def _lease_record(conn: redis.Redis, ks: KeySpace) -> tuple[str, str]:
    """Rank 0's lease record: its token and the holder's identity (JSON)."""
    raw = conn.get(ks.owner(rank_role(0)))
    assert isinstance(raw, bytes), raw
    token, identity = raw.decode().split(" ", 1)
    return token, identity


def test_a_duplicated_rank_never_answers_waits_exits_4_then_takes_over(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    owner = rank_procs(real_server.url, engine_id, 1, 0, [{"tokens": PROMPT}])
    wait_until(lambda: _holder_pid(conn, ks) == owner.pid, timeout=90, message="owner serving")
    port = free_port()
    options = {"claim-timeout": CLAIM_WAIT_S, "metrics-port": port}
    newcomer = rank_procs(real_server.url, engine_id, 1, 0, [], options=options)
    wait_until(lambda: "already served by" in newcomer.log(), timeout=90, message="its ERROR")
    line = next(x for x in newcomer.log().splitlines() if "already served by" in x)
    assert " ERROR " in line and f"pid {owner.pid}" in line and f"pid {newcomer.pid}" in line
    wait_until(lambda: _readyz(port)[0] != 0, timeout=30, message="its HTTP endpoint")
    code, body = _readyz(port)
    assert code == 503 and "held by another process" in body and f"pid {owner.pid}" in body
    client = clients(config(real_server.url, lookup_timeout_ms=10_000), engine_id, 1)
    alive(client)
    answers = []
    for i in range(40):
        client.lookup(PROMPT, f"dup-{i}")
        answers.append(answer(client, f"dup-{i}", timeout=30))
        client.clear_lookup_status(f"dup-{i}")
    assert answers == [FULL] * 40  # every one from the owner: the newcomer holds nothing
    assert _holder_pid(conn, ks) == owner.pid
    # Its bounded wait over, the newcomer exits with the documented code.
    assert newcomer.wait(CLAIM_WAIT_S + 60) == ExitCode.NOT_OWNER
    assert "exiting with code 4" in newcomer.log()
    # The owner dies; the newcomer, restarted, takes over once the owner's lease expired.
    owner.kill9()
    newcomer.start()
    wait_until(lambda: _holder_pid(conn, ks) == newcomer.pid, timeout=60, message="takeover")
    wait_until(lambda: _readyz(port)[0] == 200, timeout=30, message="the newcomer is ready")
    alive(client)
    client.lookup(PROMPT, "after")
    assert answer(client, "after", timeout=30) == 0  # the new owner's engine: a miss
    assert client.stats().outcomes["miss"] == 1
    # The lease record says who took over and as which owner: the second epoch, held by the
    # newcomer. (Its log line names it "took over" or "holds the lease" depending on whether
    # the owner's lease had expired before it first looked: timing, not state.)
    token, identity = _lease_record(conn, ks)
    assert token.split(".", 1)[0] == "2"
    assert f'"pid":{newcomer.pid},' in identity


def test_an_owner_paused_past_its_lease_comes_back_fenced(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    ks = KeySpace(engine_id)
    conn = redis.Redis.from_url(real_server.url)
    prompts = [{"tokens": SLOW, "tier": "disk"}]
    port = free_port()
    # A heartbeat that outlives the pause: the client keeps waiting for the paused rank
    # (no dead-rank 0), so only the fence stands between its late report and the answer.
    timers = {"heartbeat_ttl_ms": 30_000, "owner_lease_ms": 1500}
    old = rank_procs(
        real_server.url,
        engine_id,
        1,
        0,
        prompts,
        load_delay_ms=250,
        options={"metrics-port": port},
        **timers,
    )
    wait_until(lambda: _holder_pid(conn, ks) == old.pid, timeout=90, message="old owner serving")
    new = rank_procs(real_server.url, engine_id, 1, 0, [], options={"claim-timeout": 0}, **timers)
    wait_until(lambda: "already served by" in new.log(), timeout=90, message="new one waiting")
    client = clients(config(real_server.url, lookup_timeout_ms=10_000), engine_id, 1)
    alive(client)
    client.lookup(SLOW, "paused")
    wait_until(lambda: beat(conn, ks.heartbeat(0)).get("running") == 1, timeout=30)
    old.signal(signal.SIGSTOP)  # mid-prefetch: its report is still to come
    try:
        wait_until(lambda: _holder_pid(conn, ks) == new.pid, timeout=60, message="takeover")
    finally:
        old.signal(signal.SIGCONT)
    # Back, the old owner's engine finishes and reports its full hit: fenced by the script.
    wait_until(lambda: _fenced(port) >= 1, timeout=60, message="the old owner's report fenced")
    fields = conn.hgetall(ks.lookup("paused"))
    assert b"r0" not in fields, fields  # nothing of the old owner was recorded
    wait_until(lambda: "lost its lease" in old.log(), timeout=30, message="the old one stops")
    # Never the old owner's 32: the lookup ends at its deadline (the old owner had acked
    # its delivery, so the new one never got it).
    assert answer(client, "paused", timeout=40) == 0
    assert client.stats().outcomes["timeout"] == 1
    assert _holder_pid(conn, ks) == new.pid
    client.lookup(SLOW, "next")
    assert answer(client, "next", timeout=30) == 0  # the new owner's engine holds nothing


def _fenced(port: int) -> float:
    """``broker_lookup_worker_reports_total{result="fenced"}`` of the process on ``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("broker_lookup_worker_reports_total{") and 'result="fenced"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
