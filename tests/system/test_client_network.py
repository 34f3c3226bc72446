"""Network faults between the scheduler's client and Redis, through a TCP fault proxy.

Real server, ranks in this process connected straight to it (a rank process's own link
is faulted in test_rank_network.py); only the client's connections go through the
:class:`FaultProxy`, so each fault lands on the scheduler's side alone: a stalled or
partitioned server (hold without RST), resets, a submit that ran on the server but whose
reply was lost, a completion event lost on its way to the listener, latency. In every
case: no exception reaches the caller, no lookup hangs, no answer is wrong, a full hit is
never answered 0 unless a fault was active during that lookup, and everything recovers
by itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import redis
from faultkit import MakeLookupClient, alive, answer, config, eventually_right, prompt, ready
from helpers import Made, RealServer, wait_until

from broker_lookup.client import RedisAsyncLookupClient
from broker_lookup.client import sender as sender_module
from broker_lookup.config import LookupMetadata
from broker_lookup.protocol.commands import Command
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.stub_engine import StubEngine
from broker_lookup.transport.link import LeanLink
from faultproxy.proxy import FaultProxy
from workers.server import RedisAsyncLookupServer

pytestmark = [pytest.mark.real, pytest.mark.slow]

HOT = prompt(1000)
FULL = len(HOT)  # what every rank answers: a full hit


@pytest.fixture
def cluster(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    made: Made,
    clients: MakeLookupClient,
) -> RedisAsyncLookupClient:
    """Two ranks on the server and a client (world 2) through the proxy."""
    return _two_ranks(real_server, fault_proxy, engine_id, made, clients)


def _ranks(made: Made, url: str, engine_id: str, world_size: int) -> None:
    """Every rank of ``engine_id`` in this process, on ``url``, each answering a full hit.

    In-process ranks start in milliseconds where a rank process takes seconds (torch), and
    nothing here faults a rank: these tests assert what the client does.
    """
    servers = [
        made.keep(
            RedisAsyncLookupServer(
                StubEngine("instant", hits=FULL),
                LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=rank),
                config(url),
            )
        )
        for rank in range(world_size)
    ]
    ready(*servers)


def _two_ranks(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    made: Made,
    clients: MakeLookupClient,
    **overrides: Any,
) -> RedisAsyncLookupClient:
    _ranks(made, real_server.url, engine_id, 2)
    cfg = config(fault_proxy.url, **{"lookup_timeout_ms": 3000, **overrides})
    client = clients(cfg, engine_id, 2)
    alive(client)
    client.lookup(HOT, "warm")
    assert answer(client, "warm", timeout=10) == FULL
    return client


def test_a_stalled_server_opens_the_breaker_then_it_closes_by_itself(
    cluster: RedisAsyncLookupClient, fault_proxy: FaultProxy
) -> None:
    client = cluster
    fault_proxy.hold()  # packets dropped, no RST: what SIGSTOP or a partition looks like
    wait_until(lambda: client.stats().breaker_open, timeout=10, message="breaker opens")
    for i in range(500):
        started = time.monotonic()
        assert client.lookup(HOT, f"held-{i}") == 0  # answered now, not after 3 s
        assert time.monotonic() - started < 1.0
        assert client.lookup_cache(f"held-{i}") == 0
    stats = client.stats()
    assert stats.outcomes["unavailable"] >= 500
    assert stats.queued == 0  # nothing piles up behind the stall
    fault_proxy.release()
    wait_until(lambda: not client.stats().breaker_open, timeout=15, message="it closes")
    assert eventually_right(client, HOT, FULL, timeout=15, tag="after") >= 1
    assert client.stats().breaker_openings >= 1


def test_a_submit_whose_reply_is_lost_still_answers_the_full_hit(
    cluster: RedisAsyncLookupClient,
    fault_proxy: FaultProxy,
    real_server: RealServer,
    engine_id: str,
) -> None:
    client = cluster
    conn = redis.Redis.from_url(real_server.url)
    ks = KeySpace(engine_id)
    before = conn.xlen(ks.requests)
    # The server runs the submit script; the reply never comes back; the connection is
    # reset; the sender (or redis-py) re-sends the batch.
    fault_proxy.lose_reply("EVALSHA", then="reset")
    client.lookup(HOT, "lost-reply")
    assert answer(client, "lost-reply", timeout=10) == FULL
    assert fault_proxy.stats["replies_lost"] == 1
    assert conn.xlen(ks.requests) == before + 1  # the re-send wrote no second entry


def test_a_completion_lost_on_the_way_to_the_listener_is_read_again(
    cluster: RedisAsyncLookupClient, fault_proxy: FaultProxy
) -> None:
    client = cluster
    # The listener's XREAD reply carrying the completion is lost and its connection
    # hangs: its short socket timeout ends the read, and the re-read from the last
    # position still finds the event in the stream.
    fault_proxy.lose_reply("XREAD", then="hold")
    wait_until(lambda: fault_proxy.stats["replies_lost"] == 1, message="a read is lost")
    client.lookup(HOT, "lost-event")  # completes while the listener hangs in that read
    assert answer(client, "lost-event", timeout=15) == FULL
    assert client.stats().redis_errors >= 1  # the hung read ended by its timeout


def test_resets_never_give_a_wrong_answer_and_recovery_is_automatic(
    cluster: RedisAsyncLookupClient, fault_proxy: FaultProxy
) -> None:
    client = cluster
    for i in range(5):
        client.lookup(HOT, f"r{i}")
        fault_proxy.reset()
        assert answer(client, f"r{i}", timeout=10) in (0, FULL)
    assert eventually_right(client, HOT, FULL, timeout=15, tag="after") >= 1


@pytest.mark.long  # a hit that depends on the added latency staying under the timeout
def test_latency_under_the_timeout_costs_no_hit(
    cluster: RedisAsyncLookupClient, fault_proxy: FaultProxy
) -> None:
    client = cluster
    fault_proxy.delay(150)  # each way, on every chunk: far under the 3 s timeout
    for i in range(5):
        client.lookup(HOT, f"slow-{i}")
        assert answer(client, f"slow-{i}", timeout=15) == FULL


def test_close_leaves_no_connection_open(
    real_server: RealServer, engine_id: str, clients: MakeLookupClient
) -> None:
    conn = redis.Redis.from_url(real_server.url)

    def mine() -> int:
        return sum(1 for c in conn.client_list() if engine_id in c.get("name", ""))

    for _ in range(3):
        client = clients(config(real_server.url), engine_id, 1)
        client.lookup(HOT, "r1")
        wait_until(lambda: mine() >= 2, message="the client's connections are open")
        client.close()
        wait_until(lambda: mine() == 0, timeout=5, message="close() closed them all")


def test_the_caller_writes_its_own_submits_on_a_plain_connection(
    cluster: RedisAsyncLookupClient,
) -> None:
    """Once a round trip proved the connection, the caller writes its submits itself.

    Best effort by design: a submit that finds the sender's thread on the wire (reading
    the replies owed, a keep-alive PING) is queued instead of waiting, which a loaded box
    makes happen now and then; so the caller must write five of at most twenty."""
    client = cluster
    before = client.stats().direct_submits
    for i in range(20):
        client.lookup(HOT, f"direct-{i}")
        assert answer(client, f"direct-{i}", timeout=10) == FULL
        if client.stats().direct_submits >= before + 5:
            break
    assert client.stats().direct_submits >= before + 5
    assert client.stats().queued == 0


def test_submit_on_caller_thread_off_sends_every_submit_from_the_sender(
    real_server: RealServer, engine_id: str, made: Made, clients: MakeLookupClient
) -> None:
    _ranks(made, real_server.url, engine_id, 1)
    client = clients(config(real_server.url, submit_on_caller_thread=False), engine_id, 1)
    alive(client)
    for i in range(3):
        client.lookup(HOT, f"queued-{i}")
        assert answer(client, f"queued-{i}", timeout=10) == FULL
    assert client.stats().direct_submits == 0


def test_a_burst_of_submits_takes_the_queue_as_one_batch(cluster: RedisAsyncLookupClient) -> None:
    """Lookups closer than DIRECT_GAP_S to the caller's last write go through the queue."""
    client = cluster
    before = client.stats().direct_submits
    ids = [f"burst-{i}" for i in range(50)]
    for lookup_id in ids:
        client.lookup(HOT, lookup_id)
    for lookup_id in ids:
        assert answer(client, lookup_id, timeout=10) == FULL
    # The first may be written directly; a descheduled caller may write a few more.
    assert client.stats().direct_submits - before <= 25


def test_one_lookup_at_a_time_is_written_directly_however_soon_it_follows(
    cluster: RedisAsyncLookupClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit soon after the last one is a burst only while that one is unanswered.

    Every submit here follows the last within DIRECT_GAP_S; those issued one at a time,
    each after the last was answered, are written by the caller all the same (a fast
    answer once made the caller hand nearly every submit to the sender thread), and a
    burst still takes the queue.
    """
    monkeypatch.setattr(sender_module, "DIRECT_GAP_S", 3600.0)
    client = cluster
    before = client.stats().direct_submits
    for i in range(10):
        client.lookup(HOT, f"one-{i}")
        assert answer(client, f"one-{i}", timeout=10) == FULL
    # The sender thread holds the wire for a moment every few ms while it reads the
    # replies: a submit that meets it takes the queue, so allow one or two of those.
    direct = client.stats().direct_submits - before
    assert direct >= 8
    ids = [f"burst-{i}" for i in range(20)]
    for lookup_id in ids:
        client.lookup(HOT, lookup_id)
    for lookup_id in ids:
        assert answer(client, lookup_id, timeout=10) == FULL
    assert client.stats().direct_submits - before - direct <= 10


def test_a_direct_submit_whose_reply_is_lost_and_hangs_still_answers_and_recovers(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    made: Made,
    clients: MakeLookupClient,
) -> None:
    """The server ran the caller's submit, its reply is lost and the connection hangs:
    the answer comes anyway (it needs no reply), the overdue reply drops the
    connection, and the submit sent again changes nothing."""
    client = _two_ranks(real_server, fault_proxy, engine_id, made, clients, socket_timeout_ms=1500)
    conn = redis.Redis.from_url(real_server.url)
    requests = KeySpace(engine_id).requests
    before = conn.xlen(requests)
    direct = client.stats().direct_submits
    errors = client.stats().redis_errors
    fault_proxy.lose_reply("EVALSHA", then="hold")
    client.lookup(HOT, "lost-direct")
    assert answer(client, "lost-direct", timeout=10) == FULL
    assert client.stats().direct_submits == direct + 1
    wait_until(lambda: client.stats().redis_errors > errors, timeout=10, message="overdue")
    assert conn.xlen(requests) == before + 1  # answered before its re-send: never re-sent
    assert eventually_right(client, HOT, FULL, timeout=15, tag="after") >= 1


def test_a_torn_direct_write_drops_the_connection_and_sends_again(
    cluster: RedisAsyncLookupClient,
    real_server: RealServer,
    engine_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Half a submit on the wire (a full socket buffer): the connection is out of step,
    so the sender drops it and sends the whole submit on a new one."""
    client = cluster

    def torn(link: LeanLink, commands: Sequence[Command]) -> bool | None:
        conn: Any = link._conn
        data = b"".join(link._pack(conn, commands))
        conn._sock.sendall(data[: len(data) // 2])
        return False

    monkeypatch.setattr(LeanLink, "send_nowait", torn)
    conn = redis.Redis.from_url(real_server.url)
    requests = KeySpace(engine_id).requests
    before = conn.xlen(requests)
    errors = client.stats().redis_errors
    for i in range(3):
        client.lookup(HOT, f"torn-{i}")
        assert answer(client, f"torn-{i}", timeout=10) == FULL
    assert client.stats().redis_errors >= errors + 1
    assert conn.xlen(requests) == before + 3  # each submit ran once, whole


def test_close_while_the_caller_writes_submits_never_raises_into_it(
    real_server: RealServer, engine_id: str, made: Made, clients: MakeLookupClient
) -> None:
    """close() on one thread while another keeps calling lookup() (each written on the
    caller's thread): the caller only ever sees answers, and every connection closes."""
    _ranks(made, real_server.url, engine_id, 1)
    client = clients(config(real_server.url), engine_id, 1)
    alive(client)
    errors: list[BaseException] = []
    stop = threading.Event()

    def caller() -> None:
        i = 0
        while not stop.is_set():
            try:
                client.lookup(HOT, f"closing-{i}")
                client.lookup_cache(f"closing-{i}")
            except BaseException as exc:  # the assertion below names it
                errors.append(exc)
                return
            i += 1
            time.sleep(0.001)  # apart, so each one is written directly

    conn = redis.Redis.from_url(real_server.url)

    def mine() -> int:  # the client's connections, not the rank's
        return sum(1 for c in conn.client_list() if c.get("name") == f"bl-client-{engine_id}")

    thread = threading.Thread(target=caller)
    thread.start()
    wait_until(lambda: client.stats().direct_submits >= 20, message="direct writes flow")
    assert mine() >= 2  # the sender's and the listener's
    client.close()
    stop.set()
    thread.join(5)
    assert not thread.is_alive() and errors == []
    wait_until(lambda: mine() == 0, timeout=5, message="close() closed them all")


def test_close_under_a_stalled_server_is_bounded_and_opens_no_connection(
    real_server: RealServer,
    fault_proxy: FaultProxy,
    engine_id: str,
    made: Made,
    clients: MakeLookupClient,
) -> None:
    """A stalled server (held: no RST) at close(): close() returns within its grace, every
    thread of the client ends within a bounded join, and nothing connects again."""
    _ranks(made, real_server.url, engine_id, 2)
    ranks = set(threading.enumerate())  # the ranks' threads live on: not the client's
    # A short socket timeout: the wait for a late reconnect below is twice this one.
    cfg = config(fault_proxy.url, lookup_timeout_ms=3000, socket_timeout_ms=1500)
    client = clients(cfg, engine_id, 2)
    alive(client)
    client.lookup(HOT, "warm")
    assert answer(client, "warm", timeout=10) == FULL
    ours = {
        t for t in threading.enumerate() if t.name.startswith("broker-lookup-") and t not in ranks
    }
    fault_proxy.hold()
    for i in range(50):  # in flight and queued: close() cancels each of them
        client.lookup(HOT, f"stalled-{i}")
    cfg = client.config
    grace = cfg.loop_timeout_s + 2.0  # what close() allows itself
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < grace + 2.0  # its own join bound, plus slack
    connections = fault_proxy.stats["connections"]

    def threads_gone() -> bool:
        return not any(t.is_alive() for t in ours)

    assert ours, "the client's threads were found"
    wait_until(threads_gone, timeout=10, message="every client thread ended")
    # Past every timeout a retry or a reconnect could have waited for: none came.
    wait_until(
        lambda: time.monotonic() - started > 2 * cfg.socket_timeout_ms / 1000,
        timeout=30,
        message="time for a late reconnect to show",
    )
    assert fault_proxy.stats["connections"] == connections, "a connection after close()"
