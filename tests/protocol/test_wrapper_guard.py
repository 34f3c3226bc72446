"""The wrappers and the bypass client never raise into the scheduler either.

vLLM calls whichever client the factory built inside ``Scheduler.schedule()``: a wrapped
client, or the bypass client, answers any bad call as the bare Redis client answers it
(0 or -1), and counts and logs it once. On fakeredis and a real server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from faultkit import MakeClient, config, prompt

from broker_lookup import (
    BypassLookupClient,
    ChunkStatisticsLookupClient,
    HitLimitLookupClient,
    LookupClientInterface,
    LookupMetadata,
)

TOKENS = prompt(0, chunks=10)
LIMITS: dict[str, Any] = {"max_chunks_per_request": 16, "max_request_configs_bytes": 64}
META = LookupMetadata(engine_id="e", world_size=1)
GUARD_LOGGER = "broker_lookup.client.guard"

Wrap = Callable[[LookupClientInterface], LookupClientInterface]
WRAPS: dict[str, Wrap] = {
    "hit_limit": lambda c: HitLimitLookupClient(c, config(hit_miss_ratio=0.5, **LIMITS)),
    "chunk_statistics": lambda c: ChunkStatisticsLookupClient(c, config(**LIMITS), META),
    "nested": lambda c: ChunkStatisticsLookupClient(
        HitLimitLookupClient(c, config(hit_miss_ratio=0.5, **LIMITS)), config(**LIMITS), META
    ),
}

#: Contract calls carrying what a scheduler may pass: ids that are no str, unhashable,
#: huge or empty; bad request_configs; tokens that are no ints.
BAD_CALLS: list[tuple[str, tuple[Any, ...]]] = [
    ("lookup", (TOKENS, 42, None)),
    ("lookup", (TOKENS, ["a", "list"], None)),
    ("lookup", (TOKENS, "x" * 10_000, None)),
    ("lookup", (TOKENS, "", None)),
    ("lookup", (TOKENS, "r", {1: "int key"})),
    ("lookup", (TOKENS, "r", ["not", "a", "dict"])),
    ("lookup", (TOKENS, "r", {"k": object()})),
    ("lookup", (TOKENS, "r", {"lmcache.tag.user": "x" * 100})),
    ("lookup", (None, "r", None)),
    ("lookup", ("a prompt", "r", None)),
    ("lookup", ([1.5] * 8, "r", None)),
    ("lookup", (["a"] * 8, "r", None)),
    ("lookup", (torch.rand(40), "r", None)),
    ("lookup", (object(), ["a"], None)),
    ("lookup_cache", (["a", "list"],)),
    ("clear_lookup_status", ({"a": 1},)),
    ("cancel_lookup", (["x"],)),
]
IDS = [f"{method}-{i}" for i, (method, _) in enumerate(BAD_CALLS)]


class SyncEngine:
    """A bypass engine that records every lookup it is asked."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def lookup(
        self,
        hashes: list[int],
        offsets: list[int],
        lookup_id: str | None = None,
        pin: bool = False,
        request_configs: dict[str, Any] | None = None,
    ) -> int:
        self.asked.append(lookup_id)
        return 0


def _guard_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == GUARD_LOGGER]


@pytest.mark.parametrize("kind", sorted(WRAPS))
@pytest.mark.parametrize(("method", "args"), BAD_CALLS, ids=IDS)
def test_a_wrapped_client_answers_a_bad_call_as_the_bare_one(
    make_client: MakeClient,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    method: str,
    args: tuple[Any, ...],
) -> None:
    bare = make_client(**LIMITS)
    wrapped = WRAPS[kind](make_client(**LIMITS))
    for client in (bare, wrapped):
        client.lookup(TOKENS, "r0")  # a non-empty table: an empty dict hashes no key
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for _ in range(3):
            assert getattr(wrapped, method)(*args) == getattr(bare, method)(*args)
    counts = bare.stats().rejected
    assert sum(counts.values()) == 3, "the bare client counts each call once"
    assert wrapped.stats().rejected == counts  # type: ignore[attr-defined]
    assert len(_guard_logs(caplog)) == 2, "logged once by each client"


@pytest.mark.parametrize(("method", "args"), BAD_CALLS, ids=IDS)
def test_the_bypass_client_answers_a_bad_call_as_the_redis_client(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, method: str, args: tuple[Any, ...]
) -> None:
    bare = make_client(**LIMITS)
    engine = SyncEngine()
    bypass = BypassLookupClient(config(**LIMITS), META, engine)
    for client in (bare, bypass):
        client.lookup(TOKENS, "r0")  # a non-empty table: an empty dict hashes no key
    with caplog.at_level(logging.WARNING, logger="broker_lookup"):
        for _ in range(3):
            assert getattr(bypass, method)(*args) == getattr(bare, method)(*args)
    assert bypass.stats().rejected == bare.stats().rejected
    assert sum(bypass.stats().rejected.values()) == 3
    assert len(_guard_logs(caplog)) == 2, "logged once by each client"
    assert engine.asked == ["r0"], "nothing the Redis client refuses reaches the engine"
