"""Property: whatever lands in a rank's stream, valid lookups next to it get the right answer.

Hypothesis interleaves valid lookups with random entries: random fields, random bytes
in ``m``, and msgpack that looks like a request but is wrong in random ways. The ranks
run real ReferenceEngines, so "right" is the min of the prefixes they really hold.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from faultkit import CHUNK, MakeClient, MakeServer, alive, prompt, ready
from helpers import Backend, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_lookup.protocol.hashing import ChunkedTokenHasher
from broker_lookup.protocol.keys import KeySpace
from workers.reference.engine import ReferenceEngine

pytestmark = pytest.mark.parametrize("backend", ["fake"], indirect=True)

CHUNKS = 10
#: prompt -> chunks stored on rank 0 and rank 1; the right answer is the min.
STORED = {0: (10, 7), 1: (5, 10), 2: (0, 10), 3: (10, 10)}
PROMPTS = {i: prompt(10_000 * (i + 1), CHUNKS) for i in STORED}
RIGHT = {i: min(s) * CHUNK for i, s in STORED.items()}

_i64 = st.integers(-(2**63), 2**64 - 1)
_small = st.integers(-3, 40)
_junk_id = st.text(max_size=40).map(lambda s: "j" + s)  # never an "ok-" id of a valid lookup


def _now_ms() -> int:
    return int(time.time() * 1000)


_request_like = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["lookup", "abort", "lookups", "", "LOOKUP"]),
        "lookup_id": st.one_of(_junk_id, _i64, st.none()),
        "gen": st.one_of(_i64, st.text(max_size=5), st.floats()),
        "hashes": st.one_of(st.lists(_i64, max_size=20), st.text(max_size=5), st.none()),
        "offsets": st.one_of(st.lists(_small, max_size=20), st.binary(max_size=5)),
        "expected": st.one_of(st.lists(_small, max_size=4), _i64),
        "deadline_ms": st.one_of(_i64, st.builds(lambda: _now_ms() + 60_000)),
        "tokens": st.one_of(_small, st.text(max_size=3)),
        "request_configs": st.one_of(
            st.none(), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
        ),
    },
    optional={"extra": st.binary(max_size=8)},
).map(lambda d: {"m": msgspec.msgpack.encode(d)})

_field_name = st.one_of(st.binary(min_size=1, max_size=8), st.sampled_from([b"m", b"type", b"id"]))
_junk = st.one_of(
    st.dictionaries(_field_name, st.binary(max_size=64), min_size=1, max_size=4),
    st.binary(max_size=200).map(lambda b: {"m": b, "type": "lookup"}),
    _request_like,
)
_ops = st.lists(
    st.one_of(
        _junk.map(lambda j: ("junk", j)), st.sampled_from(list(STORED)).map(lambda p: ("ok", p))
    ),
    min_size=1,
    max_size=12,
)


def _engines(hasher: ChunkedTokenHasher) -> list[ReferenceEngine]:
    engines = [ReferenceEngine(), ReferenceEngine()]
    for i, tokens in PROMPTS.items():
        hashes, offsets = hasher.hashes_and_offsets(tokens)
        for rank, engine in enumerate(engines):
            keep = STORED[i][rank]
            engine.store(hashes[:keep], offsets[:keep])
    return engines


def test_valid_lookups_survive_any_junk(
    make_server: MakeServer, make_client: MakeClient, backend: Backend, engine_id: str
) -> None:
    ks = KeySpace(engine_id)
    client = make_client(world_size=2, lookup_timeout_ms=20_000)
    engines = _engines(client.hasher)
    servers = [make_server(e, rank=r, world_size=2) for r, e in enumerate(engines)]
    ready(*servers)
    alive(client)
    conn = backend.factory()
    serial = iter(range(10**9))

    @settings(
        max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
    )
    @given(ops=_ops)
    def run(ops: list[tuple[str, Any]]) -> None:
        want: dict[str, int] = {}
        for kind, what in ops:
            if kind == "junk":
                conn.xadd(ks.requests, what)
            else:
                lookup_id = f"ok-{next(serial)}"
                client.lookup(PROMPTS[what], lookup_id)
                want[lookup_id] = RIGHT[what]
        wait_until(lambda: all(client.lookup_cache(i) is not None for i in want), timeout=20)
        got = {i: client.lookup_cache(i) for i in want}
        assert got == want
        for lookup_id in want:
            client.clear_lookup_status(lookup_id)
        assert all(s.stats().alive for s in servers)
        wait_until(lambda: all(_caught_up(conn, ks, r) for r in (0, 1)), timeout=10)

    try:
        run()
    finally:
        for engine in engines:
            engine.close()
    letters = sum(s.stats().consumer.dead_letters for s in servers)
    assert letters > 0  # the junk was seen, refused and parked, not silently swallowed
    assert conn.xlen(ks.dead) > 0


def _caught_up(conn: Any, ks: KeySpace, rank: int) -> bool:
    for g in conn.xinfo_groups(ks.requests):
        if g["name"] == ks.group(rank).encode():
            return int(g["pending"]) == 0 and int(g["lag"] or 0) == 0
    return False
