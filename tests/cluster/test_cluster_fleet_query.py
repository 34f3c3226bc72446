"""The fleet query over a real three-master Redis Cluster: every command stays in one
engine's slot, so engines on different masters answer in the same query."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers import wait_until

from broker_lookup import FleetClient
from broker_lookup.tools.local_cluster import LocalCluster

from .cluster_ids import slot_of, spread_engine_ids
from .cluster_stack import TOKENS, Stack

pytestmark = [pytest.mark.cluster, pytest.mark.real]


def test_a_query_over_engines_on_different_masters_answers_each(
    local_cluster: LocalCluster, stack: Callable[..., Stack]
) -> None:
    ids = spread_engine_ids(local_cluster, 2)
    owners = {local_cluster.owner(slot_of(e)) for e in ids}
    assert len(owners) == 2, "the two engines must live on two masters"
    deployment = stack(local_cluster.url)
    # hits are chunks of 4 tokens: 12 and 32 tokens
    units = [deployment.unit(ids[0], hits=12, world_size=2), deployment.unit(ids[1], hits=32)]
    for unit in units:
        unit.wait_ready()
    fleet = FleetClient(deployment.config, deadline_ms=1000)
    try:
        found: dict[str, tuple[int, tuple[int, ...], str | None]] = {}

        def answered() -> bool:
            answer = fleet.query(TOKENS, engines=ids)
            assert answer.problem is None, answer.problem  # no CROSSSLOT, no Redis error
            found.clear()
            found.update({e.engine_id: (e.tokens, e.answered, e.reason) for e in answer.engines})
            return all(reason is None for _, _, reason in found.values())

        wait_until(answered, timeout=20, message="both engines answer the query")
        assert found == {ids[0]: (12, (0, 1), None), ids[1]: (32, (0,), None)}
        # Every engine on the server (found by SCAN over every master) answers the same.
        everyone = {e.engine_id: e.tokens for e in fleet.query(TOKENS).engines}
        assert {e: everyone.get(e) for e in ids} == {ids[0]: 12, ids[1]: 32}
    finally:
        fleet.close()
