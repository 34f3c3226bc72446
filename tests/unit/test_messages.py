"""Wire messages: round-trips, readable fields, tagged decoding, validation, evolution."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from broker_lookup.errors import MalformedMessage
from broker_lookup.protocol.messages import (
    Abort,
    DoneEvent,
    LookupRequest,
    check_lookup_id,
    decode_completions,
    decode_done,
    decode_entry,
    decode_request,
    encode_request,
    request_fields,
    validate_request,
    wire_id_problem,
)

LIMITS = {"max_chunks": 8, "max_id_length": 32}


def request(**overrides: Any) -> LookupRequest:
    values: dict[str, Any] = {
        "lookup_id": "req-1",
        "gen": 7,
        "hashes": [1, -2, 2**63 - 1],
        "offsets": [256, 256, 10],
        "expected": [0, 1],
        "deadline_ms": 1_700_000_000_000,
        "request_configs": {"lmcache.tag.user": "a"},
        "tokens": 522,
    }
    values.update(overrides)
    return LookupRequest(**values)


def entry(msg: LookupRequest | Abort) -> dict[bytes, bytes]:
    """The fields as redis-py returns them from XREAD: bytes keys and values."""
    return {
        k.encode(): v if isinstance(v, bytes) else str(v).encode()
        for k, v in request_fields(msg).items()
    }


# -- round trips and readable fields -----------------------------------------------------


def test_lookup_request_round_trips() -> None:
    msg = request()
    assert decode_request(entry(msg)) == msg
    assert decode_request({b"m": encode_request(msg)}) == msg


def test_requests_do_not_count_towards_the_host_processs_collections() -> None:
    """A request lives as long as its lookup (the client's table, a rank's job): were it
    tracked, each would count towards the collections of vLLM's process, as built and as
    decoded from the wire."""
    import gc

    built = [request(lookup_id=f"req-{i}") for i in range(50)]
    decoded = [decode_request({b"m": encode_request(msg)}) for msg in built]
    assert decoded == built
    assert not any(gc.is_tracked(msg) for msg in built + decoded)


def test_abort_round_trips() -> None:
    msg = Abort(lookup_id="req-1", gen=3)
    assert decode_request(entry(msg)) == msg


def test_readable_fields_of_a_lookup() -> None:
    fields = request_fields(request())
    assert {k: v for k, v in fields.items() if k != "m"} == {
        "type": "lookup",
        "id": "req-1",
        "gen": 7,
        "deadline_ms": 1_700_000_000_000,
        "chunks": 3,
    }
    assert isinstance(fields["m"], bytes)


def test_readable_fields_of_an_abort() -> None:
    fields = request_fields(Abort(lookup_id="x", gen=1))
    assert {k: v for k, v in fields.items() if k != "m"} == {"type": "abort", "id": "x", "gen": 1}


def test_tagged_union_carries_the_tag_and_decodes_to_the_right_class() -> None:
    raw = msgspec.msgpack.decode(encode_request(Abort(lookup_id="x", gen=1)))
    assert raw == {"type": "abort", "lookup_id": "x", "gen": 1}
    raw = msgspec.msgpack.decode(encode_request(request()))
    assert raw["type"] == "lookup"
    assert isinstance(decode_request({b"m": encode_request(request())}), LookupRequest)
    assert isinstance(decode_request({b"m": encode_request(Abort(lookup_id="x", gen=1))}), Abort)


@pytest.mark.parametrize(
    "configs",
    [
        None,
        {},
        {"lmcache.tag.user": "a"},
        {"lmcache.tag.prio": 3, "lmcache.skip": True, "lmcache.w": 0.5},  # LMCache D13
        {"lmcache.nested": {"a": [1, "b", None]}, "lmcache.none": None},
    ],
)
def test_request_configs_with_any_json_values_round_trip(configs: dict[str, Any] | None) -> None:
    msg = request(request_configs=configs)
    decoded = decode_request(entry(msg))
    assert isinstance(decoded, LookupRequest)
    assert decoded.request_configs == configs


@pytest.mark.parametrize(
    "hashes",
    [[0], [2**64 - 1], [-(2**63)], [2**63, -1, 2**63 - 1], [-(2**63), 2**64 - 1]],
    ids=["zero", "uint64-max", "int64-min", "mixed", "both-extremes"],
)
def test_uint64_and_negative_int64_hashes_round_trip(hashes: list[int]) -> None:
    msg = request(hashes=hashes, offsets=[1] * len(hashes), tokens=len(hashes))
    decoded = decode_request(entry(msg))
    assert isinstance(decoded, LookupRequest)
    assert decoded.hashes == hashes


def test_done_event_decodes_the_report_script_fields() -> None:
    fields = {b"id": b"req-1", b"gen": b"7", b"result": b"512"}
    assert decode_done(fields) == DoneEvent(lookup_id="req-1", gen=7, result=512)


def _multi(*completions: dict[bytes, bytes], n: bytes | None = None) -> dict[bytes, bytes]:
    """A multi-completion done entry: ``n``, the first's fields, then the others' by index."""
    fields = {b"n": n if n is not None else str(len(completions)).encode()}
    for index, parts in enumerate(completions):
        suffix = b"" if not index else b".%d" % index
        fields |= {name + suffix: value for name, value in parts.items()}
    return fields


def _done(lookup_id: str, result: int) -> dict[bytes, bytes]:
    return {b"id": lookup_id.encode(), b"gen": b"7", b"result": str(result).encode()}


def test_a_multi_completion_entry_decodes_every_completion_in_order() -> None:
    timed = _done("b", 4) | {b"last": b"1", b"ranks": b"0,1", b"hits": b"8,4", b"lat": b",90"}
    events, problem = decode_completions(_multi(_done("a", 8), timed, _done("c", 0)))
    assert problem is None
    assert events == [
        DoneEvent(lookup_id="a", gen=7, result=8),
        DoneEvent(
            lookup_id="b", gen=7, result=4, last=1, ranks=(0, 1), hits=(8, 4), latency_us=(None, 90)
        ),
        DoneEvent(lookup_id="c", gen=7, result=0),
    ]
    # A lone completion (no n) is the entry of old.
    assert decode_completions(_done("s", 3)) == ([DoneEvent(lookup_id="s", gen=7, result=3)], None)


def test_a_malformed_multi_entry_completes_what_it_can_and_says_why() -> None:
    broken = {b"id": b"b", b"gen": b"7", b"result": b"many"}
    events, problem = decode_completions(_multi(_done("a", 8), broken, _done("c", 1)))
    assert [e.lookup_id for e in events] == ["a", "c"]
    assert problem is not None and "completion 1 of 3" in problem
    # Insight fields that do not parse drop the insights, not the completion.
    garbled = _done("b", 4) | {b"last": b"1", b"ranks": b"0", b"hits": b"x,y", b"lat": b""}
    events, problem = decode_completions(_multi(_done("a", 8), garbled))
    assert problem is None and events[1] == DoneEvent(lookup_id="b", gen=7, result=4)
    # A missing completion is named; the ones there still complete.
    fields = _multi(_done("a", 8), _done("b", 4), _done("c", 1))
    del fields[b"id.1"]
    events, problem = decode_completions(fields)
    assert [e.lookup_id for e in events] == ["a", "c"] and "completion 1 of 3" in str(problem)
    # A count that is not a number, or more than the entry can hold, reads what is there.
    for n in (b"x", b"-1", b"0", b"999999999"):
        events, problem = decode_completions(_multi(_done("a", 8), _done("b", 4), n=n))
        assert [e.lookup_id for e in events] == ["a", "b"], n
        assert problem is not None and "bad count" in problem, n
    # Nothing that decodes at all: no events, and why, never an exception.
    assert decode_completions({b"n": b"2", b"junk": b"1"}).events == []
    events, problem = decode_completions({b"id": b"x"})
    assert events == [] and problem is not None and "bad completion entry" in problem


# -- malformed payloads ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        None,
        {},
        {b"type": b"lookup", b"id": b"r"},
        {b"m": b""},
        {b"m": b"\xc1garbage"},
        {b"m": msgspec.msgpack.encode({"type": "unknown", "lookup_id": "r", "gen": 1})},
        {b"m": msgspec.msgpack.encode({"lookup_id": "r", "gen": 1})},  # no tag
        {b"m": msgspec.msgpack.encode({"type": "abort", "lookup_id": "r"})},  # no gen
        {b"m": msgspec.msgpack.encode({"type": "abort", "lookup_id": 5, "gen": 1})},
        {b"m": msgspec.msgpack.encode([1, 2, 3])},
    ],
    ids=[
        "nil",
        "empty",
        "no-m",
        "empty-m",
        "garbage",
        "unknown-tag",
        "untagged",
        "missing-field",
        "wrong-type",
        "array",
    ],
)
def test_malformed_requests_raise_malformed_message(fields: dict[bytes, bytes] | None) -> None:
    with pytest.raises(MalformedMessage) as err:
        decode_request(fields)
    assert err.value.reason


def test_malformed_message_keeps_the_payload() -> None:
    with pytest.raises(MalformedMessage) as err:
        decode_request({b"m": b"\xc1"})
    assert err.value.payload == b"\xc1"


def test_bad_lookup_hashes_are_malformed() -> None:
    raw = msgspec.msgpack.encode(
        {
            "type": "lookup",
            "lookup_id": "r",
            "gen": 1,
            "hashes": ["a"],
            "offsets": [1],
            "expected": [0],
            "deadline_ms": 1,
        }
    )
    with pytest.raises(MalformedMessage, match="undecodable"):
        decode_request({b"m": raw})


@pytest.mark.parametrize(
    "fields",
    [
        {b"gen": b"1", b"result": b"2"},
        {b"id": b"r", b"gen": b"x", b"result": b"2"},
        {b"id": b"r", b"gen": b"1"},
        {b"id": b"\xff", b"gen": b"1", b"result": b"2"},
    ],
    ids=["no-id", "bad-gen", "no-result", "bad-utf8"],
)
def test_malformed_done_events_raise(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedMessage, match="bad completion entry"):
        decode_done(fields)


# -- semantic validation --------------------------------------------------------------------


def test_a_valid_request_has_no_reason() -> None:
    assert validate_request(request(), **LIMITS) is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"lookup_id": ""}, "length 0"),
        ({"lookup_id": "x" * 33}, "length 33"),
        ({"offsets": [256, 256]}, "3 hashes but 2 offsets"),
        ({"hashes": [], "offsets": [], "tokens": 0}, "0 chunks"),
        ({"hashes": [1] * 9, "offsets": [1] * 9, "tokens": 9}, "9 chunks"),
        ({"offsets": [256, 0, 266], "tokens": 522}, "positive"),
        ({"hashes": [1, 2**64, 3]}, "64-bit"),
        ({"hashes": [1, -(2**63) - 1, 3]}, "64-bit"),
        ({"expected": []}, "expected ranks"),
        ({"expected": [0, -1]}, "expected ranks"),
        ({"tokens": 521}, "tokens=521"),
    ],
)
def test_validate_request_reasons(overrides: dict[str, Any], reason: str) -> None:
    found = validate_request(request(**overrides), **LIMITS)
    assert found is not None and reason in found


@pytest.mark.parametrize(
    ("lookup_id", "reason"),
    [
        ("req-1", None),
        ("cmpl-9f3e#0:a/b", None),
        ("x" * 16, None),
        ("x" * 17, "length 17"),
        ("", "length 0"),
        ("a b", "printable ASCII"),
        ("tab\t", "printable ASCII"),
        ("naïve", "printable ASCII"),
        ("nl\n", "printable ASCII"),
        (5, "must be a str, got int"),
        (None, "must be a str, got NoneType"),
        (b"bytes", "must be a str, got bytes"),
    ],
)
def test_check_lookup_id(lookup_id: object, reason: str | None) -> None:
    found = check_lookup_id(lookup_id, max_length=16)
    assert found is None if reason is None else (found is not None and reason in found)


@pytest.mark.parametrize("lookup_id", ["a b", "tab\t", "naïve", "日本", "nl\n", "{x}", "x" * 16])
def test_the_wire_takes_any_encodable_id(lookup_id: str) -> None:
    # vLLM builds request ids from a client's X-Request-Id header: any of these arrives.
    assert wire_id_problem(lookup_id, max_length=16) is None
    assert validate_request(request(lookup_id=lookup_id), **LIMITS) is None


@pytest.mark.parametrize(
    ("lookup_id", "reason"),
    [("", "length 0"), ("x" * 17, "length 17"), ("\udc80", "UTF-8"), (None, "must be a str")],
)
def test_the_wire_refuses_what_cannot_be_encoded(lookup_id: object, reason: str) -> None:
    found = wire_id_problem(lookup_id, max_length=16)
    assert found is not None and reason in found


# -- schema evolution ------------------------------------------------------------------------


def test_an_unknown_extra_field_is_ignored_when_decoding() -> None:
    newer = {**msgspec.to_builtins(request()), "num_computed_tokens": 256, "future": [1]}
    assert decode_request({b"m": msgspec.msgpack.encode(newer)}) == request()
    abort = {"type": "abort", "lookup_id": "r", "gen": 2, "reason": "timeout"}
    assert decode_request({b"m": msgspec.msgpack.encode(abort)}) == Abort(lookup_id="r", gen=2)


def test_fields_with_defaults_may_be_absent() -> None:
    older = msgspec.to_builtins(request())
    del older["request_configs"], older["tokens"]
    decoded = decode_request({b"m": msgspec.msgpack.encode(older)})
    assert isinstance(decoded, LookupRequest)
    assert decoded.request_configs is None and decoded.tokens == 0


def test_decode_entry_splits_a_batch_entry_and_names_each_bad_part() -> None:
    first, second = request(), msgspec.structs.replace(request(), lookup_id="other", gen=9)
    assert decode_entry(entry(first)) == [first]  # a plain entry: its one request
    batch = {b"type": b"batch", b"n": b"3", b"m0": encode_request(first)}
    batch |= {b"m2": encode_request(second)}
    parts = decode_entry(batch)
    assert parts[0] == first and parts[2] == second
    assert isinstance(parts[1], MalformedMessage) and "no 'm1' field" in parts[1].reason
    [whole] = decode_entry({b"type": b"batch", b"n": b"4", b"m0": encode_request(first)})
    assert isinstance(whole, MalformedMessage) and "outside 1..3" in whole.reason
    [trimmed] = decode_entry(None)
    assert isinstance(trimmed, MalformedMessage) and "trimmed" in trimmed.reason
