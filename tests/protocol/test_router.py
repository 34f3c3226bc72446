"""The reference router (``router/``) with reference-engine ranks and stand-in replicas, on
fakeredis and on a real server: a request goes to the replica holding its prompt's
prefix, which its own lookup then finds (the reservation handed over to it); a prompt
held nowhere goes to the least loaded replica, in turn; text is tokenized by the first
replica's ``/tokenize``; a replica that does not answer is a 502, not a hang.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from fake_replica import FakeReplica
from faultkit import alive, config, prompt, ready
from helpers import Backend, Made, wait_until

from broker_lookup import FleetClient, LookupMetadata, RedisAsyncLookupClient
from broker_lookup.ops.exporter import ExporterServer, FleetCollector
from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import instance_engine_id
from router.app import Replica, Router
from workers.reference.engine import ReferenceEngine
from workers.server import RedisAsyncLookupServer

HOT = prompt(5000, chunks=8)
COLD = prompt(6000, chunks=8)
FULL = len(HOT)
WORDS = {"the hot prompt": HOT}


class Rig:
    """Two replicas (a, b), each an engine with one rank, a scheduler client and a
    stand-in OpenAI server; a router in front of them on the exporter's HTTP server."""

    def __init__(self, backend: Backend, made: Made, engine_id: str) -> None:
        self.servers: dict[str, RedisAsyncLookupServer] = {}
        self.engines: dict[str, ReferenceEngine] = {}
        self.replicas: dict[str, FakeReplica] = {}
        chunks = list(ChunkedTokenHasher(config()).process_tokens(HOT))
        self.hashes = [h for _, _, h in chunks]
        self.offsets = [e - s for s, e, _ in chunks]
        listed = []
        for name in ("a", "b"):
            configured = f"{engine_id}-{name}"
            namespace = instance_engine_id(configured, "i1")
            engine = made.keep(ReferenceEngine())
            meta = LookupMetadata(engine_id=namespace, world_size=1)
            server = RedisAsyncLookupServer(
                engine, meta, config(), connection_factory=backend.factory
            )
            made.keep(server)
            ready(server)
            client = made.keep(
                RedisAsyncLookupClient(config(), meta, connection_factory=backend.factory)
            )
            alive(client)
            replica = made.keep(FakeReplica(name, client, WORDS))
            self.engines[name], self.servers[name], self.replicas[name] = engine, server, replica
            listed.append(Replica(replica.url, configured))
        fleet = made.keep(FleetClient(config(), connection_factory=backend.factory))
        self.router = Router(listed, fleet, deadline_ms=2000, reserve_ms=30_000)
        self.http = ExporterServer(
            FleetCollector(backend.factory), "127.0.0.1", 0, self.router.routes()
        )
        self.http.start()
        made.keep(self)

    def close(self) -> None:
        assert self.http.stop()

    def cache(self, name: str) -> None:
        self.engines[name].store(self.hashes, self.offsets)

    def complete(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())


@pytest.fixture
def rig(backend: Backend, engine_id: str) -> Iterator[Rig]:
    with Made() as made:
        yield Rig(backend, made, engine_id)


def cached(doc: dict[str, Any]) -> int:
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_prompt_goes_where_its_prefix_is_and_finds_it(rig: Rig, engine_id: str) -> None:
    rig.cache("b")
    for _ in range(3):
        code, doc = rig.complete({"model": "m", "prompt": HOT, "max_tokens": 1})
        assert (code, doc["replica"], cached(doc)) == (200, "b", FULL)
    assert rig.router.routed == {(f"{engine_id}-b", "prefix"): 3}
    assert rig.router.last_receipt is not None
    assert rig.router.last_receipt["reserved"] == FULL
    reservations = rig.servers["b"].reservations
    wait_until(lambda: len(reservations) == 0, message="each handed to the replica's lookup")
    assert reservations.counts == {"reserved": 3, "released_lookup": 3}


def test_a_prompt_held_nowhere_goes_to_the_least_loaded_in_turn(rig: Rig, engine_id: str) -> None:
    rig.cache("a")
    seen = [rig.complete({"model": "m", "prompt": COLD})[1]["replica"] for _ in range(4)]
    assert sorted(seen) == ["a", "a", "b", "b"]
    assert all(cached(rig.complete({"model": "m", "prompt": COLD})[1]) == 0 for _ in range(2))
    assert rig.router.routed[(f"{engine_id}-a", "least_loaded")] >= 2


def test_text_is_tokenized_by_a_replica(rig: Rig) -> None:
    rig.cache("a")
    code, doc = rig.complete({"model": "m", "prompt": "the hot prompt"})
    assert (code, doc["replica"], cached(doc)) == (200, "a", FULL)


def test_a_replica_that_does_not_answer_is_a_502(rig: Rig) -> None:
    rig.cache("b")
    rig.replicas["b"].close()
    code, doc = rig.complete({"model": "m", "prompt": HOT})
    assert code == 502 and "did not answer" in doc["error"]["message"]
