"""A split engine is loud in its scheduler: ranks it misses alive under another namespace
of the same configured id, with no scheduler there and none of the ranks it has, are
logged as a SPLIT naming both namespaces and the likely cause, once that lasted
``confirm_s``; another replica's ranks (its namespace has a scheduler, or our ranks too)
and another data-parallel engine of the launch are not. On fakeredis and a real server,
with in-process ranks and clients."""

from __future__ import annotations

import logging

import pytest
from faultkit import config, ready
from helpers import Backend, Made, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.client.split import split_cause
from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.keys import instance_engine_id, members_key
from broker_lookup.stub_engine import StubEngine
from workers.server import RedisAsyncLookupServer


def _rank(backend: Backend, made: Made, namespace: str, rank: int) -> RedisAsyncLookupServer:
    meta = LookupMetadata(engine_id=namespace, world_size=2, worker_id=rank)
    server = RedisAsyncLookupServer(
        StubEngine(), meta, config(), connection_factory=backend.factory
    )
    return made.keep(server)


def _scheduler(
    backend: Backend, made: Made, namespace: str, confirm_s: float = 0.0
) -> RedisAsyncLookupClient:
    meta = LookupMetadata(engine_id=namespace, world_size=2)
    client = RedisAsyncLookupClient(config(), meta, connection_factory=backend.factory)
    client.split.confirm_s = confirm_s
    return made.keep(client)


def _announced(backend: Backend, namespace: str) -> bool:
    return bool(backend.factory().hexists(members_key(namespace), namespace))


def test_a_split_engine_names_both_namespaces(
    backend: Backend, made: Made, engine_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The headless node's rank 1 landed in another namespace than the scheduler's."""
    ours, theirs = (
        instance_engine_id(engine_id, i) for i in ("1796611254717787091", "1796611254403740308")
    )
    caplog.set_level(logging.ERROR, logger="broker_lookup.client.split")
    _rank(backend, made, ours, 0)
    _rank(backend, made, theirs, 1)
    client = _scheduler(backend, made, ours)
    wait_until(lambda: client.split.found == {theirs: (1,)}, timeout=10, message="the split")
    (record,) = [r for r in caplog.records if "SPLIT" in r.getMessage()]
    message = record.getMessage()
    assert ours in message and theirs in message and "rank(s) 1" in message
    assert "built its own vLLM config" in message  # two vLLM instance ids: the likely cause


def test_another_replicas_ranks_are_not_a_split(
    backend: Backend, made: Made, engine_id: str
) -> None:
    """Replica A lost rank 1; replica B's rank 1 lives, but B has its own scheduler."""
    ours, theirs = (instance_engine_id(engine_id, i) for i in ("a1", "b2"))
    _rank(backend, made, ours, 0)
    _scheduler(backend, made, theirs)
    for rank in (0, 1):
        _rank(backend, made, theirs, rank)
    wait_until(lambda: _announced(backend, theirs), message="replica B announced")
    client = _scheduler(backend, made, ours)
    wait_until(lambda: client.split.checks >= 1, timeout=10, message="a split check")
    assert client.split.found == {}


def test_a_replica_whose_scheduler_has_not_started_is_not_a_split(
    backend: Backend, made: Made, engine_id: str
) -> None:
    """Replica B's ranks are up before its scheduler (vLLM starts the scheduler after its
    workers): B holds rank 0, which we have too, so it is another engine."""
    ours, theirs = (instance_engine_id(engine_id, i) for i in ("a1", "b2"))
    _rank(backend, made, ours, 0)
    for rank in (0, 1):
        _rank(backend, made, theirs, rank)
    wait_until(lambda: _announced(backend, theirs), message="replica B's ranks announced")
    client = _scheduler(backend, made, ours)
    wait_until(lambda: client.split.checks >= 1, timeout=10, message="a split check")
    assert client.split.found == {}


def test_another_data_parallel_engine_is_not_a_split(
    backend: Backend, made: Made, engine_id: str
) -> None:
    """DP engine 1 lost its rank while DP engine 0's scheduler is not up yet."""
    ours, theirs = (instance_engine_id(engine_id, f"1796611254403740308-dp{k}") for k in (1, 0))
    _rank(backend, made, theirs, 0)
    _rank(backend, made, ours, 1)
    wait_until(lambda: _announced(backend, theirs), message="DP engine 0 announced")
    client = _scheduler(backend, made, ours)
    wait_until(lambda: client.split.checks >= 1, timeout=10, message="a split check")
    assert client.split.found == {}


def test_a_split_is_called_only_once_it_lasted(
    backend: Backend, made: Made, engine_id: str
) -> None:
    ours, theirs = (instance_engine_id(engine_id, i) for i in ("x1", "x2"))
    _rank(backend, made, ours, 0)
    _rank(backend, made, theirs, 1)
    wait_until(lambda: _announced(backend, theirs), message="the other half announced")
    client = _scheduler(backend, made, ours, confirm_s=3600)
    wait_until(lambda: client.split.checks >= 1, timeout=10, message="a split check")
    assert client.split.found == {}
    client.split.confirm_s = 0
    wait_until(lambda: client.split.found == {theirs: (1,)}, timeout=10, message="the split")


def test_a_whole_engine_is_no_split(backend: Backend, made: Made, engine_id: str) -> None:
    """Every rank alive: nothing is looked up, nothing found."""
    ours = instance_engine_id(engine_id, "c3")
    ready(*(_rank(backend, made, ours, rank) for rank in (0, 1)))
    client = _scheduler(backend, made, ours)
    wait_until(lambda: not client.stats().dead_ranks, message="every rank alive")
    assert client.split.found == {} and client.split.checks == 0


@pytest.mark.parametrize(
    ("ours", "theirs", "cause"),
    [
        ("e", "e@123", "no vLLM config"),
        ("e@mn-aaa", "e@mn-bbb", "--master-addr"),
        ("e@lws-aaa", "e@lws-bbb", "LWS_LEADER_ADDRESS"),
        ("e@mn-aaa", "e@123", "derive their instance differently"),
        ("e@blue", "e@green", "different instance settings"),
    ],
)
def test_the_likely_cause_follows_the_instance_forms(ours: str, theirs: str, cause: str) -> None:
    assert cause in split_cause(ours, theirs)
