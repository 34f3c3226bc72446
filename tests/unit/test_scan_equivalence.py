"""The rank's C batch read (``workers/pipeline/_scan.c``) against the Python path.

For any XREADGROUP reply, ``_scan.scan`` either hands the batch back (None) or gives what
``Reader.parse`` gives without it: the same lookups with the same remaining ms, the same
ids to ack, no dead letters. And it does answer for the common batch (valid lookups of a
current client), so the fast path is not vacuous. Without the extension built these skip,
except under ``CI``, which must build it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any
from unittest import mock

import msgspec
import pytest
from helpers import optional_extension
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_lookup.config import LookupConfig
from broker_lookup.protocol.keys import KeySpace
from broker_lookup.protocol.messages import (
    Abort,
    Keep,
    LookupRequest,
    decode_request_payload,
    encode_request,
)
from workers.pipeline import reader as reader_module
from workers.pipeline.clock import ServerClock
from workers.pipeline.reader import Batch, Reader

MAX_CHUNKS = 6
MAX_ID = 12
WORLD = 3
NOW_MS = 1_700_000_000_000.25
_U64 = 2**64 - 1
_I64 = 2**63


class FixedClock(ServerClock):
    """The server's clock stopped at ``now`` (None: never sampled), so both paths agree."""

    def __init__(self, now: float | None) -> None:
        super().__init__()
        self._now = now

    def now_ms(self) -> float | None:
        return self._now


@pytest.fixture(scope="module")
def native() -> ModuleType:
    return optional_extension("workers.pipeline._scan")


def _reader(now: float | None, world: int | None) -> Reader:
    config = LookupConfig(max_chunks_per_request=MAX_CHUNKS, max_lookup_id_length=MAX_ID)
    reader = Reader(config, KeySpace("e"), 0, FixedClock(now), world)
    reader._replaying = reader._sent_replaying = False  # reading new entries (">")
    return reader


def _reply(entries: list[list[Any]], resp3: bool = False) -> Any:
    """An XREADGROUP reply as hiredis gives it: RESP2's list, or RESP3's map."""
    stream = b"bl:{e}:requests"
    return {stream: entries} if resp3 else [[stream, entries]]


def _entry(entry_id: bytes, msg: object, extra: list[bytes] | None = None) -> list[Any]:
    m = msg if isinstance(msg, bytes) else encode_request(msg)  # type: ignore[arg-type]
    return [entry_id, [b"type", b"lookup", *(extra or []), b"m", m]]


# -- what a producer may write ---------------------------------------------------------

_ids = st.one_of(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=MAX_ID),
    st.text(min_size=0, max_size=MAX_ID + 3),  # non-ASCII, empty, too long
)
_small = st.integers(1, 300)
# msgpack carries ints from -2**63 to 2**64 - 1: nothing beyond reaches a rank.
_int = st.one_of(_small, st.integers(-_I64, _U64), st.sampled_from([0, -1, _U64, -_I64]))
_hash = st.one_of(
    st.integers(-_I64, _I64 - 1), st.sampled_from([-_I64, _U64, _I64, _I64 - 1, _U64 - 1])
)


_ascii_ids = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=MAX_ID
)


@st.composite
def valid_lookups(draw: st.DrawFn) -> LookupRequest:
    """A lookup a current client sends, which every rank of a world of WORLD serves."""
    chunks = draw(st.integers(1, MAX_CHUNKS))
    offsets = draw(st.lists(_small, min_size=chunks, max_size=chunks))
    return LookupRequest(
        lookup_id=draw(_ascii_ids),
        gen=draw(st.integers(0, 2**63 - 1)),
        hashes=draw(st.lists(st.integers(-_I64, _U64), min_size=chunks, max_size=chunks)),
        offsets=offsets,
        expected=draw(st.lists(st.integers(0, WORLD - 1), min_size=1, max_size=WORLD)),
        deadline_ms=draw(st.integers(0, 2**53)),
        tokens=sum(offsets),
        budget_ms=draw(st.integers(1, 10_000)),
    )


#: One defect each (or an edge that is still valid): a field and what it becomes.
_DEFECTS: dict[str, st.SearchStrategy[Any]] = {
    "lookup_id": st.one_of(_ids, st.sampled_from(["", "x" * (MAX_ID + 1), "é", "a b"])),
    "gen": st.sampled_from([-1, -_I64, _U64, 2**63]),
    "budget_ms": st.one_of(st.sampled_from([0, -1, -_I64, _I64 - 1, _U64]), _int),
    "offsets": st.one_of(
        st.lists(_int, min_size=1, max_size=MAX_CHUNKS),
        st.sampled_from([[0], [-1], [_I64 - 1, 1], [_I64], [_U64]]),
    ),
    "hashes": st.one_of(
        st.lists(_hash, min_size=0, max_size=MAX_CHUNKS + 1),
        st.sampled_from([[-_I64], [_U64], [_I64]]),
    ),
    "expected": st.one_of(st.lists(st.integers(-1, WORLD + 1), max_size=WORLD), st.just([])),
    "tokens": _int,
    "request_configs": st.sampled_from([{}, {"tag": "x"}, {"k": [1, 2]}]),
    "chunks": st.sampled_from([0, MAX_CHUNKS + 1]),
}


@st.composite
def lookups(draw: st.DrawFn) -> LookupRequest:
    """A valid lookup, or one with a single defect (or a still-valid edge) in one field."""
    msg = draw(valid_lookups())
    field = draw(st.sampled_from([None, *_DEFECTS]))
    if field is None:
        return msg
    value = draw(_DEFECTS[field])
    if field == "chunks":  # both lists that long, every count still adding up
        offsets = [1] * value
        return msgspec.structs.replace(msg, hashes=[7] * value, offsets=offsets, tokens=value)
    if field == "offsets":
        chunks = len(value)
        total = sum(value)
        tokens = total if -_I64 <= total <= _U64 else 0  # past msgpack's range: can't be sent
        hashes = [1] * chunks
        return msgspec.structs.replace(msg, offsets=value, hashes=hashes, tokens=tokens)
    if field == "hashes" and len(value) == len(msg.offsets) + 1:
        value = value[:-1] or value
    return msgspec.structs.replace(msg, **{field: value})


_stamps = st.integers(1_699_999_990_000, 1_700_000_010_000)
_good_ids = st.builds(lambda ms, seq: f"{ms}-{seq}".encode(), _stamps, st.integers(0, 99))
_entry_ids = st.one_of(
    _good_ids,
    st.sampled_from([b"abc-1", b"-1", b"12", b"99999999999999999999999-0", b"1e3-0"]),
)
_others = st.one_of(
    st.builds(Abort, lookup_id=_ids, gen=st.integers(0, 9)),
    st.builds(Keep, lookup_id=_ids, gen=st.integers(0, 9), tokens=st.integers(-2, 9)),
    st.sampled_from([b"", b"\xc1", b"not msgpack", msgspec.msgpack.encode({"x": 1})]),
)


@st.composite
def entries(draw: st.DrawFn) -> list[Any]:
    entry_id = draw(_entry_ids)
    kind = draw(st.sampled_from(["lookup"] * 6 + ["other", "trimmed", "no m", "odd"]))
    if kind == "trimmed":
        return [entry_id, None]
    if kind == "no m":
        return [entry_id, [b"type", b"lookup"]]
    if kind == "odd":
        return [entry_id, [b"m"]]
    msg = draw(lookups()) if kind == "lookup" else draw(_others)
    return _entry(entry_id, msg, draw(st.sampled_from([None, [b"m", b"\xc1"], [b"mm", b"x"]])))


# -- the properties ---------------------------------------------------------------------


def _parse(reply: Any, now: float | None, world: int | None) -> Batch | tuple[type, str]:
    """``Reader.parse``'s batch, or what it raised for a reply it cannot read at all.

    The wall clock is stopped too: an older client's entry (no budget) is judged by it.
    """
    try:
        with mock.patch("workers.pipeline.clock.time.time", return_value=NOW_MS / 1000 - 5):
            return _reader(now, world).parse(reply)
    except Exception as exc:  # an odd field list: the loop's guard takes it, on both paths
        return type(exc), str(exc)


def _python(reply: Any, now: float | None, world: int | None) -> Batch | tuple[type, str]:
    with mock.patch.object(reader_module, "_scan", None):
        return _parse(reply, now, world)


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    batch=st.lists(entries(), min_size=1, max_size=4),
    now=st.sampled_from([NOW_MS, None]),
    world=st.sampled_from([WORLD, None]),
    resp3=st.booleans(),
)
def test_scan_gives_the_python_paths_batch_or_hands_it_back(
    native: ModuleType, batch: list[Any], now: float | None, world: int | None, resp3: bool
) -> None:
    reply = _reply(batch, resp3)
    assert _parse(reply, now, world) == _python(reply, now, world)  # via _scan where it answers


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(st.tuples(_good_ids, valid_lookups()), min_size=1, max_size=5),
    now=st.sampled_from([NOW_MS, None]),
    resp3=st.booleans(),
)
def test_scan_answers_for_a_batch_of_valid_lookups(
    native: ModuleType, batch: list[tuple[bytes, LookupRequest]], now: float | None, resp3: bool
) -> None:
    reply = _reply([_entry(entry_id, msg) for entry_id, msg in batch], resp3)
    limits = (MAX_CHUNKS, MAX_ID, WORLD)
    found = native.scan(reply, decode_request_payload, LookupRequest, now, *limits)
    assert found is not None
    messages, ack_ids = found
    assert ack_ids == [entry_id for entry_id, _ in batch]
    expected = _python(reply, now, WORLD)
    assert isinstance(expected, Batch) and not expected.dead
    assert messages == expected.messages


@pytest.mark.parametrize(
    "reply",
    [
        None,
        [],
        [[b"s", []]],  # no entries
        [[b"s", [[b"1-0", [b"m", b"x"]]]], [b"t", []]],  # two streams
        {b"s": [[b"1-0", [b"m", b"x"]]], b"t": []},  # two streams, RESP3
        {b"s": []},
        [[b"s", [(b"1-0", {b"m": b"x"})]]],  # redis-py's parsed shape (Redis Cluster)
    ],
)
def test_scan_hands_back_replies_of_other_shapes(native: ModuleType, reply: Any) -> None:
    limits = (MAX_CHUNKS, MAX_ID, WORLD)
    assert native.scan(reply, decode_request_payload, LookupRequest, NOW_MS, *limits) is None


def test_the_reader_counts_a_scanned_batch_as_the_python_path_does(
    native: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    msg = LookupRequest(
        lookup_id="a",
        gen=1,
        hashes=[5],
        offsets=[256],
        expected=[0],
        deadline_ms=0,
        tokens=256,
        budget_ms=900,
    )
    reply = _reply([_entry(b"1700000000000-0", msg), _entry(b"1700000000001-0", msg)])
    monkeypatch.setattr(reader_module, "_scan", None)
    slow = _reader(NOW_MS, WORLD)
    slow_batch = slow.parse(reply)
    monkeypatch.setattr(reader_module, "_scan", native)
    fast = _reader(NOW_MS, WORLD)
    assert fast.parse(reply) == slow_batch
    assert fast.stats == slow.stats
    assert slow_batch.messages[0][1] == 1_700_000_000_000 + 900 - NOW_MS


_BASE = LookupRequest(
    lookup_id="req-1",
    gen=3,
    hashes=[11, -12],
    offsets=[256, 100],
    expected=[0, 2],
    deadline_ms=1_700_000_001_000,
    tokens=356,
    budget_ms=800,
)
#: Each rule's edge: (field changes, whether the Python path serves it).
_EDGES: list[tuple[dict[str, Any], bool]] = [
    ({}, True),
    ({"budget_ms": 0}, True),  # an older client: judged by its wall-clock deadline
    ({"budget_ms": -1}, False),
    ({"budget_ms": _I64 - 1}, True),  # its end is past 64 bits
    ({"expected": [0, WORLD]}, False),
    ({"expected": [WORLD - 1]}, True),
    ({"expected": []}, False),
    ({"expected": [-1, 0]}, False),
    ({"request_configs": {}}, True),
    ({"request_configs": {"tag": "x" * 9000}}, False),  # over max_request_configs_bytes
    ({"lookup_id": "é-ü"}, True),
    ({"lookup_id": ""}, False),
    ({"lookup_id": "x" * (MAX_ID + 1)}, False),
    ({"lookup_id": "x" * MAX_ID}, True),
    ({"hashes": [11]}, False),
    ({"hashes": [-_I64, _U64]}, True),
    ({"offsets": [256, 0], "tokens": 256}, False),
    ({"offsets": [_I64 - 1, 1], "tokens": _I64}, True),  # the sum is past int64
    ({"offsets": [_I64 - 1, _I64 - 1, 2], "hashes": [1, 2, 3], "tokens": 0}, False),  # wraps to 0
    ({"tokens": 355}, False),
    ({"hashes": [1] * (MAX_CHUNKS + 1), "offsets": [1] * (MAX_CHUNKS + 1), "tokens": 7}, False),
    ({"hashes": [1] * MAX_CHUNKS, "offsets": [1] * MAX_CHUNKS, "tokens": MAX_CHUNKS}, True),
    ({"gen": _U64}, True),
]


@pytest.mark.parametrize("now", [NOW_MS, None])
@pytest.mark.parametrize(("changes", "served"), _EDGES, ids=[str(c) for c, _ in _EDGES])
@pytest.mark.parametrize("entry_id", [b"1700000000000-5", b"-5", b"12", b"9" * 20 + b"-0"])
@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
def test_scan_at_each_rules_edge(
    native: ModuleType,
    changes: dict[str, Any],
    served: bool,
    now: float | None,
    entry_id: bytes,
    resp3: bool,
) -> None:
    msg = msgspec.structs.replace(_BASE, **changes)
    reply = _reply([_entry(entry_id, msg)], resp3)
    python = _python(reply, now, WORLD)
    assert isinstance(python, Batch) and bool(python.messages) is served  # the table is right
    assert _parse(reply, now, WORLD) == python
