"""The fleet query, on fakeredis and on a real server, with in-process ranks:

* per engine, the minimum over its ranks of the prefix each holds, exact, best engine
  first; candidates as explicit ids, a configured id's instances, or every engine;
* a probe loads and pins nothing, and never enters the request stream;
* an engine answers 0 with its reason: ``no_ranks``, ``dead_rank`` (a rank closed, or
  never started), ``deadline`` (a live rank that does not answer), ``unavailable`` (an
  engine that cannot answer; Redis gone), ``miss``;
* bad input and Redis failures are answers, never exceptions;
* the answers are collected in pipelined BLPOPs: silent engines share the deadline, and a
  rank new since the client's last query is asked too;
* Redis lost while reserving queries run (fakeredis): no wrong answer, no leaked pin.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from faultkit import CHUNK, alive, config, prompt, ready
from faultkit import answer as answer_of
from helpers import Backend, Made, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from broker_lookup import FleetClient, LookupMetadata, RedisAsyncLookupClient
from broker_lookup.cli import main
from broker_lookup.ops.exporter import ExporterServer
from broker_lookup.ops.inspect import render as render_report
from broker_lookup.ops.inspect import snapshot
from broker_lookup.ops.metrics import ServerCollector
from broker_lookup.ops.query_cli import query_route
from broker_lookup.ops.query_metrics import QueryMetrics
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace, configured_of, instance_engine_id
from broker_lookup.stub_engine import StubEngine
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

TOKENS = prompt(4000, chunks=4)
FULL = len(TOKENS)


class Unprobeable(StubEngine):
    """An engine with neither ``probe_prefix`` nor ``lookup`` (its ranks answer
    ``unsupported``)."""

    probe_prefix = None  # type: ignore[assignment]


class Fleet:
    """Ranks of several engines on the test's backend, and a FleetClient."""

    def __init__(self, backend: Backend, made: Made) -> None:
        self.backend, self.made = backend, made
        self.client = made.keep(FleetClient(config(), connection_factory=backend.factory))
        chunks = list(ChunkedTokenHasher(config()).process_tokens(TOKENS))
        self.hashes = [h for _, _, h in chunks]
        self.offsets = [e - s for s, e, _ in chunks]

    def engine(self, chunks_held: int, disk_dir: Any = None) -> ReferenceEngine:
        """A reference engine holding the first ``chunks_held`` chunks of TOKENS."""
        engine = ReferenceEngine(disk_dir=disk_dir)
        self.made.keep(engine)
        n = chunks_held
        if disk_dir is None:
            engine.store(self.hashes[:n], self.offsets[:n])
        else:
            engine.store(self.hashes[:n], self.offsets[:n], tier="disk")
        return engine

    def rank(
        self, engine_id: str, engine: Any, rank: int = 0, world_size: int = 1
    ) -> RedisAsyncLookupServer:
        meta = LookupMetadata(engine_id=engine_id, world_size=world_size, worker_id=rank)
        server = RedisAsyncLookupServer(
            engine, meta, config(), connection_factory=self.backend.factory
        )
        self.made.keep(server)
        ready(server)
        assert server.prober.reading.wait(5.0)
        return server


@pytest.fixture
def fleet(backend: Backend) -> Iterator[Fleet]:
    with Made() as made:
        yield Fleet(backend, made)


def by_engine(answer: Any) -> dict[str, Any]:
    return {e.engine_id: e for e in answer.engines}


def test_each_engine_answers_the_minimum_over_its_ranks_best_first(
    fleet: Fleet, engine_id: str
) -> None:
    a, b = engine_id + "-a", engine_id + "-b"
    fleet.rank(a, fleet.engine(3), rank=0, world_size=2)
    fleet.rank(a, fleet.engine(4), rank=1, world_size=2)
    fleet.rank(b, fleet.engine(4))
    answer = fleet.client.query(TOKENS, engines=[a, b], deadline_ms=2000)
    assert answer.tokens == FULL and answer.problem is None
    assert [e.engine_id for e in answer.engines] == [b, a]
    got = by_engine(answer)
    assert (got[a].tokens, got[a].expected, got[a].answered) == (3 * CHUNK, (0, 1), (0, 1))
    assert (got[b].tokens, got[b].reason) == (FULL, None)
    assert got[b].age_ms is not None and 0 <= got[b].age_ms <= answer.elapsed_ms
    best = answer.best()
    assert best is not None and best.engine_id == b
    # Chunk hashes give the same answer as the tokens they hash.
    again = fleet.client.query(hashes=fleet.hashes, offsets=fleet.offsets, engines=[a])
    assert again.engines[0].tokens == 3 * CHUNK


def test_a_configured_id_asks_every_instance_and_none_asks_every_engine(
    fleet: Fleet, engine_id: str
) -> None:
    one, two = instance_engine_id(engine_id, "i1"), instance_engine_id(engine_id, "i2")
    other = engine_id + "-other"
    fleet.rank(one, fleet.engine(1))
    fleet.rank(two, fleet.engine(2))
    fleet.rank(other, fleet.engine(4))
    answer = fleet.client.query(TOKENS, configured=engine_id, deadline_ms=2000)
    got = by_engine(answer)
    assert {n: e.tokens for n, e in got.items() if e.reason != "no_ranks"} == {
        one: CHUNK,
        two: 2 * CHUNK,
    }
    everyone = by_engine(fleet.client.query(TOKENS, deadline_ms=2000))
    assert {one, two, other} <= set(everyone)
    assert everyone[other].tokens == FULL


def test_a_probe_loads_and_pins_nothing_and_never_enters_the_lookups_stream(
    fleet: Fleet, engine_id: str, tmp_path: Any
) -> None:
    engine = fleet.engine(4, disk_dir=tmp_path)
    fleet.rank(engine_id, engine)
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000)
    assert answer.engines[0].tokens == FULL  # on disk counts: a lookup would load it
    assert all(engine.get_chunk(h) is None for h in fleet.hashes)
    assert engine.stats().get("pinned_chunks", 0) == 0
    raw = fleet.backend.factory()
    assert raw.xlen(KeySpace(engine_id).requests) == 0
    assert raw.pttl(KeySpace(engine_id).probes) > 0


def test_reasons_for_zero(fleet: Fleet, engine_id: str) -> None:
    dead, silent, stub, empty = (engine_id + s for s in ("-dead", "-silent", "-stub", "-empty"))
    fleet.rank(dead, fleet.engine(4), rank=0, world_size=2)  # rank 1 never started
    fleet.rank(silent, fleet.engine(4)).prober.stop(5.0)
    fleet.rank(stub, Unprobeable())
    fleet.rank(empty, fleet.engine(0))
    answer = fleet.client.query(
        TOKENS, engines=[dead, silent, stub, empty, engine_id + "-none"], deadline_ms=300
    )
    got = {e.engine_id: (e.tokens, e.reason) for e in answer.engines}
    assert got == {
        dead: (0, "dead_rank"),
        silent: (0, "deadline"),
        stub: (0, "unavailable"),
        empty: (0, "miss"),
        engine_id + "-none": (0, "no_ranks"),
    }
    assert answer.best() is None


def test_silent_engines_share_the_deadline_instead_of_each_taking_it(
    fleet: Fleet, engine_id: str
) -> None:
    # The answers are popped by pipelined BLPOPs that Redis serves one after another:
    # three silent engines must not cost three deadlines.
    silent = [f"{engine_id}-silent{k}" for k in range(3)]
    for name in silent:
        fleet.rank(name, fleet.engine(4)).prober.stop(5.0)
    fleet.rank(engine_id, fleet.engine(2))
    answer = fleet.client.query(TOKENS, engines=[*silent, engine_id], deadline_ms=400)
    got = {e.engine_id: (e.tokens, e.reason) for e in answer.engines}
    assert got == {engine_id: (2 * CHUNK, None), **dict.fromkeys(silent, (0, "deadline"))}
    assert answer.elapsed_ms < 2 * 400, answer.elapsed_ms


def test_a_rank_new_since_the_last_query_is_asked_too(fleet: Fleet, engine_id: str) -> None:
    # The client remembers an engine's ranks between queries; a rank that registers
    # later must be found (its heartbeat read, its answer awaited), never left out.
    fleet.rank(engine_id, fleet.engine(4), rank=0, world_size=2)
    first = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000).engines[0]
    assert (first.tokens, first.reason, first.expected) == (0, "dead_rank", (0, 1))
    fleet.rank(engine_id, fleet.engine(1), rank=1, world_size=2)
    later = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000).engines[0]
    assert (later.tokens, later.answered, later.reason) == (CHUNK, (0, 1), None)
    # A new engine, never asked before, answers in its first query.
    other = engine_id + "-new"
    fleet.rank(other, fleet.engine(3))
    both = by_engine(fleet.client.query(TOKENS, engines=[engine_id, other], deadline_ms=2000))
    assert (both[other].tokens, both[engine_id].tokens) == (3 * CHUNK, CHUNK)


def test_a_rank_closed_turns_its_engine_to_dead_rank(fleet: Fleet, engine_id: str) -> None:
    fleet.rank(engine_id, fleet.engine(4), rank=0, world_size=2)
    one = fleet.rank(engine_id, fleet.engine(4), rank=1, world_size=2)
    assert fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000).engines[0].tokens
    one.close()  # releases its lease and heartbeat
    gone = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000).engines[0]
    assert (gone.tokens, gone.reason, gone.expected) == (0, "dead_rank", (0, 1))


@pytest.mark.parametrize(
    "ask",
    [
        {"token_ids": None},
        {"token_ids": TOKENS, "hashes": [1]},
        {"hashes": [1, 2], "offsets": [4]},
        {"hashes": [2**70]},
        {"token_ids": TOKENS, "engines": ["no spaces"]},
        {"token_ids": TOKENS, "configured": "{x}"},
    ],
)
def test_bad_input_is_an_answer_not_an_exception(fleet: Fleet, ask: dict[str, Any]) -> None:
    answer = fleet.client.query(**ask)
    assert answer.problem and answer.engines == [] and answer.best() is None


@pytest.mark.parametrize("backend", ["fake"], indirect=True)  # connection loss: fakeredis
def test_redis_gone_answers_unavailable(fleet: Fleet, engine_id: str) -> None:
    fleet.rank(engine_id, fleet.engine(4))
    fleet.backend.fake.connected = False
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=200)
    assert [(e.tokens, e.reason) for e in answer.engines] == [(0, "unavailable")]
    assert answer.problem and "Redis" in answer.problem
    fleet.backend.fake.connected = True
    back = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000)
    assert back.engines[0].tokens == FULL


def _post(port: int, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/query", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_http_endpoint_answers_json_and_takes_text_with_a_tokenizer(
    fleet: Fleet, backend: Backend, engine_id: str
) -> None:
    fleet.rank(engine_id, fleet.engine(2))
    words = {"w": TOKENS}  # a tokenizer of one word: the test's prompt
    metrics = QueryMetrics(backend.factory)
    route = query_route(fleet.client, lambda text: words[text], metrics)
    server = ExporterServer(metrics, "127.0.0.1", 0, {"/query": route})
    server.start()
    try:
        ask = {"tokens": TOKENS, "engines": [engine_id], "deadline_ms": 2000}
        code, doc = _post(server.port, json.dumps(ask).encode())
        assert code == 200 and doc["tokens"] == FULL
        assert [(e["engine_id"], e["tokens"], e["reason"]) for e in doc["engines"]] == [
            (engine_id, 2 * CHUNK, None)
        ]
        code, doc = _post(server.port, json.dumps({"text": "w", "engines": [engine_id]}).encode())
        assert code == 200 and doc["engines"][0]["tokens"] == 2 * CHUNK
        ask["reserve_ms"] = 300
        code, doc = _post(server.port, json.dumps(ask).encode())
        assert code == 200 and doc["engines"][0]["reserved"] == 2 * CHUNK
        bad_bodies = (b"not json", b"[1]", b'{"tokens": 5}', b'{"tokenz": [1]}', b'{"text": 1}')
        for bad in (*bad_bodies, b'{"tokens": [1], "reserve_ms": -1}'):
            code, doc = _post(server.port, bad)
            assert code == 400 and doc["problem"], bad
        code, doc = _post(server.port, json.dumps({"tokens": TOKENS, "engines": ["gone"]}).encode())
        assert code == 200 and doc["engines"][0]["reason"] == "no_ranks"
        # Its own /metrics count each answer by outcome, per configured engine id.
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as reply:
            samples = _samples(reply.read().decode())
        configured = configured_of(engine_id)
        assert samples[("broker_lookup_query_requests_total", (("result", "ok"),))] == 4
        assert samples[("broker_lookup_query_requests_total", (("result", "bad_request"),))] == 6
        hits = (("engine", configured), ("outcome", "hit"))
        assert samples[("broker_lookup_query_engine_answers_total", hits)] == 3
        gone = (("engine", "gone"), ("outcome", "no_ranks"))
        assert samples[("broker_lookup_query_engine_answers_total", gone)] == 1
        reserved = (("engine", configured), ("outcome", "reserved"))
        assert samples[("broker_lookup_query_reservations_total", reserved)] == 1
        assert samples[("broker_lookup_query_duration_seconds_count", ())] == 4
    finally:
        assert server.stop()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("backend", ["real"], indirect=True)  # a process-free CLI run: a URL
def test_the_cli_prints_the_same_answer(
    fleet: Fleet, backend: Backend, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet.rank(engine_id, fleet.engine(3))
    assert backend.url is not None
    argv = ["query", "--redis-url", backend.url, "--engine", engine_id, "--deadline-ms", "2000"]
    tokens = ",".join(map(str, TOKENS))
    env = {"BROKER_LOOKUP_CHUNK_SIZE": str(CHUNK)}
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        assert main([*argv, "--tokens", tokens, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert [(e["engine_id"], e["tokens"]) for e in doc["engines"]] == [(engine_id, 3 * CHUNK)]
        assert main([*argv, "--tokens", tokens]) == 0
        assert f"{engine_id}" in capsys.readouterr().out
        assert main([*argv, "--tokens", "1,x"]) == 2
        assert "--tokens='1,x'" in capsys.readouterr().err


def _rank_line(fleet: Fleet, engine_id: str) -> str:
    """The header and rank 0's line of ``inspect``'s RANKS table, joined."""
    snap = snapshot(fleet.backend.factory(), KeySpace(engine_id), None, 10)
    lines = render_report(snap, "redis://x", None).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("RANKS"))
    return lines[at + 1].strip() + " | " + lines[at + 2].strip()


def _pinned(engine: ReferenceEngine) -> int:
    return engine.stats().get("pinned_chunks", 0)


def test_reserve_pins_the_best_engines_prefix_until_its_ttl(fleet: Fleet, engine_id: str) -> None:
    best, other = engine_id + "-best", engine_id + "-other"
    kept, spare = fleet.engine(3), fleet.engine(2)
    server = fleet.rank(best, kept)
    fleet.rank(other, spare)
    answer = fleet.client.query(TOKENS, engines=[best, other], deadline_ms=2000, reserve_ms=400)
    top = answer.engines[0]
    assert (top.engine_id, top.tokens, top.reserved, top.reserved_ms) == (
        best,
        3 * CHUNK,
        3 * CHUNK,
        400,
    )
    assert answer.engines[1].reserved == 0
    assert (_pinned(kept), _pinned(spare)) == (3, 0)
    assert len(server.reservations) == 1
    # inspect shows it, from the rank's next heartbeat
    wait_until(lambda: "reserved" in _rank_line(fleet, best) and _rank_line(fleet, best)[-1] == "1")
    wait_until(lambda: _pinned(kept) == 0, timeout=5, message="released at its TTL")
    assert server.reservations.counts == {"reserved": 1, "released_ttl": 1}
    assert len(server.reservations) == 0
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server))
    scraped = generate_latest(registry).decode()
    for line in (
        'broker_lookup_worker_reservations_total{rank="0",result="reserved"} 1.0',
        'broker_lookup_worker_reservations_total{rank="0",result="released_ttl"} 1.0',
        'broker_lookup_worker_reservations{rank="0"} 0.0',
        'broker_lookup_worker_probes_total{rank="0",result="ok"} 2.0',  # the query, the reserve
    ):
        assert line in scraped, line


def test_the_engines_own_lookup_of_the_prompt_takes_the_reservation_over(
    fleet: Fleet, backend: Backend, engine_id: str
) -> None:
    engine = fleet.engine(4)
    server = fleet.rank(engine_id, engine)
    meta = LookupMetadata(engine_id=engine_id, world_size=1)
    scheduler = fleet.made.keep(
        RedisAsyncLookupClient(config(), meta, connection_factory=backend.factory)
    )
    alive(scheduler)
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000, reserve_ms=60_000)
    assert answer.engines[0].reserved == FULL and len(server.reservations) == 1
    other = prompt(9000, chunks=4)  # another prompt's lookup releases nothing
    scheduler.lookup(other, "other")
    assert answer_of(scheduler, "other", timeout=10) == 0
    assert len(server.reservations) == 1
    scheduler.lookup(TOKENS, "routed")
    assert answer_of(scheduler, "routed", timeout=10) == FULL  # what it was promised
    wait_until(lambda: len(server.reservations) == 0, message="handed to the lookup")
    assert server.reservations.counts == {"reserved": 1, "released_lookup": 1}
    scheduler.cancel_lookup("routed")
    wait_until(lambda: _pinned(engine) == 0, message="the lookup's own pins released")


def test_a_rank_stopping_releases_its_reservations(fleet: Fleet, engine_id: str) -> None:
    engine = fleet.engine(4)
    server = fleet.rank(engine_id, engine)
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000, reserve_ms=60_000)
    assert answer.engines[0].reserved == FULL and _pinned(engine) == 4
    server.close()
    assert _pinned(engine) == 0
    assert server.reservations.counts["released_shutdown"] == 1


def test_an_engine_that_cannot_reserve_reserves_nothing(fleet: Fleet, engine_id: str) -> None:
    fleet.rank(engine_id, StubEngine())  # probes answered (probe_prefix), no reserve_prefix
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000, reserve_ms=500)
    assert (answer.engines[0].tokens, answer.engines[0].reserved) == (FULL, 0)


@pytest.mark.parametrize("backend", ["fake"], indirect=True)  # connection loss: fakeredis
def test_a_reservation_ends_at_its_ttl_while_redis_is_gone(
    fleet: Fleet, backend: Backend, engine_id: str
) -> None:
    engine = fleet.engine(4)
    server = fleet.rank(engine_id, engine)
    answer = fleet.client.query(TOKENS, engines=[engine_id], deadline_ms=2000, reserve_ms=300)
    assert answer.engines[0].reserved == FULL
    backend.fake.connected = False
    wait_until(lambda: _pinned(engine) == 0, timeout=5, message="released with Redis gone")
    assert server.reservations.counts["released_ttl"] == 1
    backend.fake.connected = True


@pytest.mark.parametrize("backend", ["fake"], indirect=True)  # connection loss: fakeredis
def test_redis_lost_while_queries_and_reservations_run(
    fleet: Fleet, backend: Backend, engine_id: str
) -> None:
    # The fakeredis twin of the real-process fault tests: Redis goes and comes back under
    # a steady stream of reserving queries on two ranks.
    engines = [fleet.engine(4), fleet.engine(4)]
    for rank, engine in enumerate(engines):
        fleet.rank(engine_id, engine, rank=rank, world_size=2)
    seen: list[tuple[int, str | None, int]] = []
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            e = fleet.client.query(
                TOKENS, engines=[engine_id], deadline_ms=300, reserve_ms=300
            ).engines[0]
            seen.append((e.tokens, e.reason, e.reserved))

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        wait_until(lambda: len(seen) >= 5, timeout=10, message="queries before the loss")
        backend.fake.connected = False
        lost = len(seen)
        wait_until(lambda: len(seen) >= lost + 3, timeout=10, message="queries during the loss")
        backend.fake.connected = True
        back = len(seen)
        wait_until(
            lambda: any(s == (FULL, None, FULL) for s in seen[back + 1 :]),
            timeout=10,
            message="queries and reservations answer in full again",
        )
    finally:
        backend.fake.connected = True
        stop.set()
        asker.join(10)
    assert not asker.is_alive()
    assert {(t, r) for t, r, _ in seen} <= {
        (FULL, None),
        (0, "unavailable"),
        (0, "deadline"),
        (0, "dead_rank"),
    }
    assert (0, "unavailable", 0) in seen[lost:back]
    assert all(reserved in (0, tokens) for tokens, _, reserved in seen)
    wait_until(
        lambda: all(_pinned(e) == 0 for e in engines),
        timeout=10,
        message="every reservation released at its TTL: none leaked by the loss",
    )
