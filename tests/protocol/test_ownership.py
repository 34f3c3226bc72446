"""One owner per role: ``claim.lua`` (claim, renew, conflict, takeover after expiry,
retry after a lost reply, release) and the fencing of ``report.lua`` and
``progress.lua``; on fakeredis and on a real server."""

from __future__ import annotations

import json
import time

import redis
from helpers import Backend, text, wait_until

from broker_lookup.protocol.keys import SCHEDULER_ROLE, KeySpace, rank_role
from broker_lookup.protocol.ownership import ClaimReply, Identity, parse_claim_reply, parse_holder
from broker_lookup.protocol.scripts import (
    SUBMIT,
    Call,
    claim_call,
    progress_call,
    release_call,
    report_call,
    submit_args,
)
from broker_lookup.transport.lease import Lease, run_claim
from broker_lookup.transport.script_runner import ScriptSet

LEASE_MS = 300


def _claim(
    conn: redis.Redis, ks: KeySpace, who: Identity, role: str = "0", lease_ms: int = LEASE_MS
) -> ClaimReply:
    call = claim_call(ks, role, who, lease_ms=lease_ms, epochs_ttl_ms=60_000)
    return parse_claim_reply(ScriptSet().call(conn, call))


def _me(nonce: str) -> Identity:
    return Identity("host-" + nonce, 100, 1_700_000_000_000, nonce)


def test_claim_renew_conflict_and_takeover_after_expiry(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    a, b = _me("aaaa"), _me("bbbb")
    first = _claim(conn, ks, a)
    assert first.status == "claimed" and first.token == "1.aaaa"
    # The record is plain text redis-cli reads: the token, then the identity's JSON.
    value = text(conn.get(ks.owner("0")))
    token, _, ident = value.partition(" ")
    assert token == "1.aaaa" and json.loads(ident)["host"] == "host-aaaa"
    assert 0 < conn.pttl(ks.owner("0")) <= LEASE_MS
    assert 0 < conn.pttl(ks.epochs) <= 60_000
    # The holder renews: the same token. A retry of a claim whose reply was lost lands here.
    assert _claim(conn, ks, a) == ClaimReply("renewed", token="1.aaaa")
    # A second process finds the live holder, changes nothing but its contender key.
    other = _claim(conn, ks, b)
    assert other.status == "held" and other.holder is not None
    assert other.holder.token == "1.aaaa" and other.holder.info["host"] == "host-aaaa"
    assert text(conn.get(ks.owner("0"))) == value
    assert json.loads(text(conn.get(ks.contender("0"))))["nonce"] == "bbbb"
    assert 0 < conn.pttl(ks.contender("0")) <= LEASE_MS
    # Once the holder stops renewing, its lease expires and the newcomer takes over with
    # a larger epoch; its own contender key goes.
    assert wait_until(lambda: _claim(conn, ks, b).status == "claimed", timeout=10)
    assert text(conn.get(ks.owner("0"))).startswith("2.bbbb ")
    assert conn.get(ks.contender("0")) is None
    # The old holder comes back: it is now the one waiting.
    assert _claim(conn, ks, a).status == "held"


def test_roles_are_independent_and_release_frees_at_once(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    a, b = _me("aaaa"), _me("bbbb")
    assert _claim(conn, ks, a, rank_role(0), lease_ms=60_000).status == "claimed"
    assert _claim(conn, ks, b, rank_role(1), lease_ms=60_000).status == "claimed"
    assert _claim(conn, ks, b, SCHEDULER_ROLE, lease_ms=60_000).token == "1.bbbb"
    scripts = ScriptSet()
    # Only the holder's release frees the lease.
    refused = parse_claim_reply(scripts.call(conn, release_call(ks, "0", b, rank=True)))
    assert refused.status == "held" and conn.exists(ks.owner("0"))
    conn.set(ks.heartbeat(0), "{}")
    done = parse_claim_reply(scripts.call(conn, release_call(ks, "0", a, rank=True)))
    assert done.status == "released" and done.token == "1.aaaa"
    assert not conn.exists(ks.owner("0")) and not conn.exists(ks.heartbeat(0))
    again = parse_claim_reply(scripts.call(conn, release_call(ks, "0", a, rank=True)))
    assert again.status == "absent"
    # The next claimant takes over at once, with a larger epoch.
    assert _claim(conn, ks, b, rank_role(0), lease_ms=60_000).token == "2.bbbb"


def test_heartbeat_is_written_by_the_holder_only(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    scripts = ScriptSet()
    a, b = _me("aaaa"), _me("bbbb")

    def claim(who: Identity, body: str) -> str:
        call = claim_call(
            ks, "0", who, lease_ms=60_000, epochs_ttl_ms=60_000, heartbeat=(body, 5000)
        )
        return parse_claim_reply(scripts.call(conn, call)).status

    assert claim(a, '{"pid": 1}') == "claimed"
    assert conn.get(ks.heartbeat(0)) == b'{"pid": 1}'
    assert claim(b, '{"pid": 2}') == "held"
    assert conn.get(ks.heartbeat(0)) == b'{"pid": 1}'  # the newcomer never passes for the rank
    assert 0 < conn.pttl(ks.heartbeat(0)) <= 5000


def _submit(conn: redis.Redis, ks: KeySpace, lookup_id: str, gen: int = 7) -> None:
    args = submit_args(
        gen=gen,
        expected="0",
        created_ms=0,
        deadline_ms=int(time.time() * 1000) + 60_000,
        tokens=64,
        ttl_ms=60_000,
        maxlen=100,
        engine_ttl_ms=60_000,
        lookup_id=lookup_id,
        fields={"type": "lookup"},
    )
    ScriptSet().call(conn, Call(SUBMIT, (ks.lookup(lookup_id), ks.requests), args))


def _report(conn: redis.Redis, ks: KeySpace, lookup_id: str, token: str, hits: int = 32) -> bytes:
    call = report_call(
        ks,
        lookup_id,
        rank=0,
        gen=7,
        hits=hits,
        done_maxlen=100,
        engine_ttl_ms=60_000,
        fence=(ks.owner("0"), token),
    )
    result: bytes = ScriptSet().call(conn, call)
    return result


def test_report_and_progress_of_an_old_owner_are_fenced(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    old = _claim(conn, ks, _me("aaaa"), lease_ms=60_000)
    assert old.token is not None
    # Another process took over while the old owner was paused (its lease expired).
    conn.delete(ks.owner("0"))
    new = _claim(conn, ks, _me("bbbb"), lease_ms=60_000)
    assert new.token is not None and new.token != old.token
    _submit(conn, ks, "f1")
    assert _report(conn, ks, "f1", old.token) == b"fenced"
    progress = progress_call(ks, "f1", rank=0, gen=7, tokens=8, fence=(ks.owner("0"), old.token))
    assert ScriptSet().call(conn, progress) == b"fenced"
    fields = conn.hgetall(ks.lookup("f1"))
    assert b"r0" not in fields and b"p0" not in fields and fields[b"state"] == b"pending"
    assert conn.xlen(ks.done) == 0
    # A prefix of the token is not the token; no lease at all fences everything.
    assert _report(conn, ks, "f1", new.token[:-1]) == b"fenced"
    assert _report(conn, ks, "f1", "") == b"fenced"
    # The owner's report is recorded.
    assert _report(conn, ks, "f1", new.token) == b"complete"
    assert conn.hget(ks.lookup("f1"), "result") == b"32"
    conn.delete(ks.owner("0"))
    _submit(conn, ks, "f2")
    assert _report(conn, ks, "f2", new.token) == b"fenced"  # its lease expired


def test_lease_state_follows_the_replies(backend: Backend, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    conn = backend.factory()
    scripts = ScriptSet()
    now = [100.0]
    a = Lease(ks, "0", "rank 0", LEASE_MS * 10, 60_000, clock=lambda: now[0])
    b = Lease(ks, "0", "rank 0", LEASE_MS * 10, 60_000, clock=lambda: now[0])
    assert not a.held() and a.fence == (ks.owner("0"), "")
    assert a.on_reply(run_claim(scripts, conn, None, a.claim_call()), now[0])
    assert a.held() and a.state().epoch == 1 and a.fence[1].startswith("1.")
    assert not b.on_reply(run_claim(scripts, conn, None, b.claim_call()), now[0])
    assert b.counts["conflicts"] == 1 and b.holder is not None
    assert b.not_serving_reason().startswith(f"rank 0 of engine {engine_id} is held by")
    # Retrying while the same holder lives is one episode, not a new conflict.
    b.on_reply(run_claim(scripts, conn, None, b.claim_call()), now[0])
    assert b.counts["conflicts"] == 1
    now[0] += 2.0
    assert b.unheld_for() == 2.0
    # By its own clock, a holder past its lease stops serving before anyone can take over.
    now[0] += LEASE_MS * 10 / 1000
    assert not a.held() and a.token is not None and a.unheld_for() == 2.0  # since the lapse
    # The lease really expired: b takes over; a's renewal finds b and counts a loss.
    conn.delete(ks.owner("0"))
    assert b.on_reply(run_claim(scripts, conn, None, b.claim_call()), now[0])
    assert not a.on_reply(run_claim(scripts, conn, None, a.claim_call()), now[0])
    assert a.counts["lost"] == 1 and a.token is None and b.state().epoch == 2
    holder = parse_holder(conn.get(ks.owner("0")))
    assert holder is not None and holder.token == b.token
