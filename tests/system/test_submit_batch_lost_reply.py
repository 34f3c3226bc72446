"""The client's sender sends a burst of submits as one ``submit.lua`` batch; a batch whose
reply was lost (the fault proxy runs it on the server, then resets the connection) is
sent again and changes nothing: each submit answers ``duplicate``, no lookup gets a
second request entry, and a report recorded in between stays."""

from __future__ import annotations

import uuid

import pytest
import redis
from helpers import RealServer, lookup_request

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.scripts import (
    Call,
    report_call,
    submit_answers,
    submit_batches,
    submit_call,
)
from broker_lookup.transport.link import ClientLink
from broker_lookup.transport.script_runner import ScriptSet
from faultproxy.proxy import FaultProxy


def _submits(ks: KeySpace) -> list[Call]:
    calls = []
    for lookup_id in ("a", "b", "c"):
        request = lookup_request(lookup_id, 7, chunks=10, expected=[0, 1])
        calls.append(
            submit_call(
                ks,
                request,
                expected="0,1",
                created_ms=1,
                ttl_ms=60_000,
                maxlen=100,
                engine_ttl_ms=600_000,
            )
        )
    return calls


def test_a_submit_batch_whose_reply_was_lost_changes_nothing_when_sent_again(
    fault_proxy: FaultProxy, real_server: RealServer
) -> None:
    ks = KeySpace(f"sbatch-{uuid.uuid4().hex[:8]}")
    conn = redis.Redis.from_url(real_server.url)
    scripts = ScriptSet()
    scripts.load(conn)
    packed = submit_batches(_submits(ks))
    assert [n for _, n in packed] == [3]
    batch = packed[0][0]
    proxied = redis.Redis.from_url(fault_proxy.url, socket_timeout=5)
    fault_proxy.lose_reply("EVALSHA:" + scripts.sha["submit"][:12], then="reset")
    with pytest.raises(redis.ConnectionError):
        scripts.run(ClientLink(proxied), proxied, [batch])
    assert fault_proxy.stats["replies_lost"] == 1
    assert conn.xlen(ks.requests) == 1  # it ran (one entry for the three): the reply was lost
    rank0 = report_call(ks, "a", rank=0, gen=7, hits=8, done_maxlen=100, engine_ttl_ms=600_000)
    assert scripts.call(conn, rank0) == b"recorded"  # a fast rank, before the retry
    before = {k: conn.hgetall(ks.lookup(k)) for k in "abc"}
    again = submit_answers(scripts.run(ClientLink(proxied), proxied, [batch]), [3])
    assert again == [b"duplicate"] * 3
    assert {k: conn.hgetall(ks.lookup(k)) for k in "abc"} == before
    assert conn.xlen(ks.requests) == 1  # no second entry
    conn.delete(*(ks.lookup(i) for i in "abc"), ks.requests, ks.done)
    proxied.close()
    conn.close()
