"""Every Lua script of the protocol runs on every master of a real cluster.

A script that touched a key outside ``KEYS`` (a hard-coded name, another engine's tag)
would fail there with "non local key" or CROSSSLOT for the engines whose slot lives on
another master; the negative control shows that this check has teeth. The static half
of the check is in ``tests/unit/test_keys_slots.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import Abort, Keep, decode_completions
from broker_lookup.protocol.scripts import (
    CANCEL,
    REPORT,
    SUBMIT,
    BatchItem,
    Call,
    deadline_call,
    keep_call,
    progress_call,
    report_batch_call,
    submit_answers,
    submit_args,
    submit_batches,
)
from broker_lookup.tools.local_cluster import LocalCluster
from broker_lookup.transport.connection import make_factory
from broker_lookup.transport.link import ClientLink
from broker_lookup.transport.script_runner import ScriptSet

from .cluster_ids import slot_of, spread_engine_ids

pytestmark = [pytest.mark.cluster, pytest.mark.real]

GEN = 7


def _protocol_calls(ks: KeySpace, lookup_id: str) -> list[list[Call]]:
    """submit, the reports of ranks 0 and 1, then cancel: as the client and ranks send them."""
    now = int(time.time() * 1000)
    submit = Call(
        SUBMIT,
        (ks.lookup(lookup_id), ks.requests),
        submit_args(
            gen=GEN,
            expected="0,1",
            created_ms=now,
            deadline_ms=now + 5000,
            tokens=64,
            ttl_ms=60000,
            engine_ttl_ms=60_000,
            maxlen=1000,
            lookup_id=lookup_id,
            fields={"type": "lookup", "id": lookup_id, "m": lookup_id.encode()},
        ),
    )
    reports = [
        Call(
            REPORT, (ks.lookup(lookup_id), ks.done), [rank, GEN, 16, 1000, lookup_id, 5000, 60_000]
        )
        for rank in (0, 1)
    ]
    cancel = Call(
        CANCEL,
        (ks.lookup(lookup_id), ks.requests),
        [GEN, 1000, 60_000, "type", "abort", "id", lookup_id],
    )
    return [[submit], reports, [cancel]]


def _partial_calls(ks: KeySpace, lookup_id: str) -> list[list[Call]]:
    """A lookup answered at its deadline: progress, deadline, keep, then cancel."""
    [[submit], [report, _], [cancel]] = _protocol_calls(ks, lookup_id)
    progress = progress_call(ks, lookup_id, rank=1, gen=GEN, tokens=8)
    deadline = deadline_call(
        ks, Abort(lookup_id=lookup_id, gen=GEN), maxlen=1000, ttl_ms=5000, engine_ttl_ms=60_000
    )
    keep = keep_call(
        ks, Keep(lookup_id=lookup_id, gen=GEN, tokens=8), maxlen=1000, engine_ttl_ms=60_000
    )
    return [[submit], [report, progress], [deadline], [keep], [cancel]]


@pytest.fixture
def cluster_client(local_cluster: LocalCluster) -> Iterator[redis.Redis]:
    client = make_factory(LookupConfig(redis_url=local_cluster.url), "bl-test-scripts")()
    yield client
    client.close()


def test_every_script_runs_on_every_master_and_writes_only_its_engines_slot(
    local_cluster: LocalCluster, cluster_client: redis.Redis
) -> None:
    ids = spread_engine_ids(local_cluster, 3)
    assert sorted(local_cluster.owner(slot_of(e)) for e in ids) == [0, 1, 2]
    scripts = ScriptSet()
    for n in range(len(local_cluster.nodes)):
        local_cluster.admin(n).config_resetstat()
    cluster_client.script_flush()  # every primary: the first calls meet NOSCRIPT and reload
    every = len(scripts.sha)
    assert cluster_client.script_exists(*scripts.sha.values()) == [False] * every
    answers = []
    for step in range(3):
        # One pipeline per step across all three engines: a ClusterPipeline over 3 nodes.
        calls = [c for e in ids for c in _protocol_calls(KeySpace(e), "r1")[step]]
        answers.append(scripts.run(ClientLink(cluster_client), cluster_client, calls))
    partial = []
    for step in range(5):
        calls = [c for e in ids for c in _partial_calls(KeySpace(e), "r2")[step]]
        partial.append(scripts.run(ClientLink(cluster_client), cluster_client, calls))
    errors = [a for step in answers + partial for a in step if isinstance(a, Exception)]
    assert errors == []
    assert answers[1] == [b"recorded", b"complete"] * 3
    assert answers[2] == [1, 1, 1]  # the hash of this generation deleted
    assert partial[1] == [b"recorded", b"recorded"] * 3  # rank 0's report, rank 1's progress
    # The deadline answers what both confirmed; rank 1 had not reported.
    assert partial[2] == [[8, b"partial", b"1"]] * 3
    assert partial[3] == [1, 1, 1]  # the keep entry added
    assert partial[4] == [1, 1, 1]
    assert cluster_client.script_exists(*scripts.sha.values()) == [True] * every  # everywhere
    for engine_id in ids:  # the blocking reads of the listener and of a rank
        ks = KeySpace(engine_id)
        done = cluster_client.xread({ks.done: "0"}, count=10, block=10)
        assert isinstance(done, list) and len(done[0][1]) == 1  # RESP2: [[stream, entries]]
        cluster_client.xgroup_create(ks.requests, "rank-0", id="0")
        assert len(cluster_client.xreadgroup("rank-0", "rank-0", {ks.requests: ">"}, 9, 10)) == 1
    # Routed by our key parser: redis-py would have asked COMMAND GETKEYS before each
    # EVALSHA and each XREAD/XREADGROUP (an extra round trip, all on one node).
    for n in range(len(local_cluster.nodes)):
        assert "cmdstat_command|getkeys" not in local_cluster.admin(n).info("commandstats")
    for engine_id in ids:
        _assert_written_only_in_its_slot(local_cluster, engine_id)


def test_the_batched_scripts_run_on_every_master_in_their_engines_slot(
    local_cluster: LocalCluster, cluster_client: redis.Redis
) -> None:
    """A sender's submit batch and each rank's report batch name every key in KEYS."""
    ids = spread_engine_ids(local_cluster, 3)
    scripts = ScriptSet()
    link = ClientLink(cluster_client)
    for engine_id in ids:
        ks = KeySpace(engine_id)
        submits = [_protocol_calls(ks, lookup_id)[0][0] for lookup_id in ("b1", "b2")]
        packed = submit_batches(submits)
        assert [n for _, n in packed] == [2]
        answers = submit_answers(scripts.run(link, cluster_client, [packed[0][0]]), [2])
        assert all(isinstance(a, bytes) and a != b"duplicate" for a in answers)
        items = [BatchItem("b1", GEN, 16), BatchItem("b2", GEN, 8)]
        reports = [
            report_batch_call(ks, items, rank=rank, done_maxlen=1000, engine_ttl_ms=60_000)
            for rank in (0, 1)
        ]
        results = scripts.run(link, cluster_client, reports)
        assert results == [[b"recorded"] * 2, [b"complete"] * 2]
        node = local_cluster.admin(local_cluster.owner(slot_of(engine_id)))
        # One batch entry carries both lookups; rank 1's batch completed both: one done
        # entry carries them.
        assert node.xlen(ks.requests) == 1 and node.xlen(ks.done) == 1
        done: Any = node.xrange(ks.done)
        [(_, entry)] = done
        events = decode_completions(entry).events
        assert [(e.lookup_id, e.result) for e in events] == [("b1", 16), ("b2", 8)]
        cluster_client.delete(ks.requests, ks.done, ks.lookup("b1"), ks.lookup("b2"))


def _assert_written_only_in_its_slot(local_cluster: LocalCluster, engine_id: str) -> None:
    ks = KeySpace(engine_id)
    node = local_cluster.admin(local_cluster.owner(slot_of(engine_id)))
    # r1: submit + abort; r2: submit + keep + abort. Only r1 completed on the done stream.
    assert node.xlen(ks.requests) == 5 and node.xlen(ks.done) == 1
    stray = [
        k
        for n in range(len(local_cluster.nodes))
        for k in local_cluster.admin(n).scan_iter(match=f"*{engine_id}*")
        if key_slot(k) != slot_of(engine_id)
    ]
    assert stray == []


def test_a_script_touching_a_key_outside_KEYS_fails_on_the_cluster(
    local_cluster: LocalCluster, cluster_client: redis.Redis
) -> None:
    """Negative control: the dynamic check above would catch a script with a wrong key."""
    mine, other = spread_engine_ids(local_cluster, 2)
    assert local_cluster.owner(slot_of(mine)) != local_cluster.owner(slot_of(other))
    wrong = KeySpace(other).done  # another engine's key, built outside KEYS
    sha = cluster_client.script_load(f"return redis.call('XLEN', '{wrong}')")
    with pytest.raises(redis.ResponseError, match=r"(?i)non local key|crossslot|slot"):
        cluster_client.evalsha(sha, 1, KeySpace(mine).requests)
