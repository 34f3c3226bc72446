"""A rank's reports go to Redis as one ``report.lua`` batch; a batch whose reply was lost
(the fault proxy runs it on the server, then resets the connection) is sent again and
changes nothing: each report answers ``duplicate`` and each lookup completes once, in the
one done entry of the batch that completed it."""

from __future__ import annotations

import uuid
from typing import Any

import redis
from helpers import RealServer, lookup_request, wait_until

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import decode_completions
from broker_lookup.protocol.scripts import submit_call
from broker_lookup.transport.script_runner import ScriptSet
from faultproxy.proxy import FaultProxy
from workers.pipeline.reporter import Report, Reporter


def test_a_batch_whose_reply_was_lost_is_sent_again_and_changes_nothing(
    fault_proxy: FaultProxy, real_server: RealServer
) -> None:
    ks = KeySpace(f"batch-{uuid.uuid4().hex[:8]}")
    conn = redis.Redis.from_url(real_server.url)
    scripts = ScriptSet()
    scripts.load(conn)  # the batch's first run records: no NOSCRIPT round first
    for lookup_id, expected in (("a", [0, 1]), ("b", [0]), ("c", [0])):
        request = lookup_request(lookup_id, 7, chunks=10, expected=expected)
        call = submit_call(
            ks,
            request,
            expected=",".join(map(str, expected)),
            created_ms=1,
            ttl_ms=60_000,
            maxlen=100,
            engine_ttl_ms=600_000,
        )
        scripts.call(conn, call)
    settled: dict[str, str] = {}
    reporter = Reporter(
        LookupConfig(redis_url=fault_proxy.url),
        ks,
        0,
        lambda: redis.Redis.from_url(fault_proxy.url, socket_timeout=5),
        lambda report, answer: settled.__setitem__(report.lookup_id, answer),
    )
    fault_proxy.lose_reply("EVALSHA", then="reset")
    for report in (Report("a", 7, 8), Report("b", 7, 12), Report("c", 7, 4)):
        reporter.put(report)  # queued before the thread starts: one batch
    reporter.start()
    try:
        wait_until(lambda: len(settled) == 3, message="every report answered")
    finally:
        reporter.stop(5)
    assert fault_proxy.stats["replies_lost"] >= 1
    assert settled == {"a": "duplicate", "b": "duplicate", "c": "duplicate"}
    assert conn.hmget(ks.lookup("a"), "r0", "owed", "state") == [b"8", b"1", b"pending"]
    assert conn.hmget(ks.lookup("b"), "state", "result") == [b"done", b"12"]
    assert conn.hmget(ks.lookup("c"), "state", "result") == [b"done", b"4"]
    done: Any = conn.xrange(ks.done)
    [(_, entry)] = done  # one entry for the batch's two completions, and none again
    events, problem = decode_completions(entry)
    assert problem is None and [(e.lookup_id, e.result) for e in events] == [("b", 12), ("c", 4)]
    conn.delete(*(ks.lookup(i) for i in "abc"), ks.done, ks.requests)
    conn.close()
