"""validate_request's C-level checks (min/max) refuse exactly what per-element checks did."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_lookup.protocol.messages import LookupRequest, validate_request, wire_id_problem

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1
MAX_CHUNKS = 8
MAX_ID = 16


def _reference(msg: LookupRequest) -> str | None:
    """The per-element checks as they were written before the min/max rewrite."""
    reason = wire_id_problem(msg.lookup_id, MAX_ID)
    if reason:
        return reason
    if msg.budget_ms < 0:
        return f"budget_ms={msg.budget_ms} is negative"
    if len(msg.hashes) != len(msg.offsets):
        return f"{len(msg.hashes)} hashes but {len(msg.offsets)} offsets"
    if not 0 < len(msg.hashes) <= MAX_CHUNKS:
        return f"{len(msg.hashes)} chunks is outside 1..{MAX_CHUNKS}"
    if any(o <= 0 for o in msg.offsets):
        return "offsets must be positive token counts"
    if any(h < _INT64_MIN or h > _UINT64_MAX for h in msg.hashes):
        return "a hash is outside the 64-bit range"
    if not msg.expected or any(r < 0 for r in msg.expected):
        return "expected ranks must be a non-empty list of ranks >= 0"
    if msg.tokens != sum(msg.offsets):
        return f"tokens={msg.tokens} does not equal the sum of offsets"
    return None


_edge_hash = st.sampled_from(
    [_INT64_MIN - 1, _INT64_MIN, -1, 0, 1, 2**63 - 1, 2**63, _UINT64_MAX, _UINT64_MAX + 1]
)
_hash = st.one_of(_edge_hash, st.integers(_INT64_MIN - 5, _UINT64_MAX + 5))
_small = st.integers(-3, 300)


@pytest.mark.property
@settings(deadline=None)
@given(
    lookup_id=st.one_of(st.text(max_size=20), st.just("\udc80"), st.just("naïve-日本")),
    budget_ms=st.integers(-2, 5),
    chunks=st.lists(st.tuples(_hash, _small), max_size=10),
    extra_offsets=st.lists(_small, max_size=1),
    expected=st.lists(st.integers(-2, 4), max_size=4),
    tokens_delta=st.sampled_from([0, 0, 0, 1, -1]),
)
def test_same_reason_as_per_element_checks(
    lookup_id: str,
    budget_ms: int,
    chunks: list[tuple[int, int]],
    extra_offsets: list[int],
    expected: list[int],
    tokens_delta: int,
) -> None:
    hashes = [h for h, _ in chunks]
    offsets = [o for _, o in chunks] + extra_offsets
    msg = LookupRequest(
        lookup_id=lookup_id,
        gen=1,
        hashes=hashes,
        offsets=offsets,
        expected=expected,
        deadline_ms=0,
        tokens=sum(offsets) + tokens_delta,
        budget_ms=budget_ms,
    )
    assert validate_request(msg, max_chunks=MAX_CHUNKS, max_id_length=MAX_ID) == _reference(msg)
