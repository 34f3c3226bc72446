"""Lookups over a real three-master Redis Cluster: engines spread over shards, slot moves."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from helpers import wait_until

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.local_cluster import LocalCluster

from .cluster_ids import slot_of, spread_engine_ids
from .cluster_stack import Stack, Traffic, Unit, run_batch, verdicts

pytestmark = [pytest.mark.cluster, pytest.mark.real]


def test_eight_engines_spread_over_three_masters_all_answer_right(
    local_cluster: LocalCluster, stack: Callable[..., Stack]
) -> None:
    ids = spread_engine_ids(local_cluster, 8)
    owners = [local_cluster.owner(slot_of(e)) for e in ids]
    assert sorted(set(owners)) == [0, 1, 2], owners
    deployment = stack(local_cluster.url)
    units = [deployment.unit(e, hits=4 * (k + 1), world_size=2) for k, e in enumerate(ids)]
    for unit in units:
        unit.wait_ready()

    results: dict[str, list[int]] = {}
    go = threading.Barrier(len(units))

    def drive(unit: Unit) -> None:
        go.wait()
        results[unit.engine_id] = run_batch(unit, "r", 40)

    threads = [threading.Thread(target=drive, args=(u,)) for u in units]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for unit in units:
        assert results[unit.engine_id] == [unit.expected] * 40, unit.engine_id
    # Each engine's keys really live on the master that owns its hash tag's slot.
    for unit, owner in zip(units, owners, strict=True):
        ks = KeySpace(unit.engine_id)
        assert local_cluster.admin(owner).exists(ks.requests, ks.done, ks.heartbeat(1)) == 3


def test_moved_slot_is_followed_without_wrong_or_lost_lookups(
    local_cluster: LocalCluster, stack: Callable[..., Stack]
) -> None:
    moving, steady = spread_engine_ids(local_cluster, 2)
    deployment = stack(local_cluster.url)
    unit = deployment.unit(moving, hits=12, world_size=2)
    control = deployment.unit(steady, hits=20, world_size=2)
    unit.wait_ready()
    control.wait_ready()
    slot = slot_of(moving)
    source = local_cluster.owner(slot)
    dest = (source + 1) % len(local_cluster.nodes)

    with Traffic(unit, "m") as traffic, Traffic(control, "s") as steady_traffic:
        wait_until(lambda: len(traffic.started) >= 40, timeout=10)
        # Key by key with pauses: lookups also meet the half-moved slot (ASK, TRYAGAIN).
        move_began = time.monotonic()
        moved = local_cluster.migrate_slot(slot, dest, batch=1, pause_s=0.01)
        move_ended = time.monotonic()
        at_move = len(traffic.started)
        wait_until(lambda: len(traffic.started) >= at_move + 80, timeout=10)

    assert local_cluster.owner(slot) == dest
    assert moved >= 4  # requests, done, heartbeats, lookup hashes
    ks = KeySpace(moving)
    assert local_cluster.admin(dest).exists(ks.requests, ks.done) == 2
    outcomes = traffic.outcomes()
    counts = verdicts(outcomes, unit.expected)
    assert counts["wrong"] == 0, counts
    # A 0 only for a lookup the move could have touched: one alive while keys moved, or
    # started before the engine's leases, heartbeats and deadlines recovered from it.
    cfg = unit.client.config
    recovery_s = (cfg.longest_timeout_ms + cfg.heartbeat_ttl_ms + cfg.lease_ms) / 1000 + 1.0
    window = (move_began - cfg.longest_timeout_ms / 1000, move_ended + recovery_s)
    outside = [o for o in outcomes if o.result == 0 and not window[0] <= o.started <= window[1]]
    assert outside == [] and counts["right"] > 0, (counts, window, outside[:5])
    assert verdicts(steady_traffic.outcomes(), control.expected) == {
        "right": len(steady_traffic.started)
    }
    # New lookups after the move: every one answered by the engine, on the new master.
    assert run_batch(unit, "after", 30) == [unit.expected] * 30
    by_outcome = {k: v for k, v in unit.client.stats().outcomes.items() if v}
    print(
        f"\nslot {slot} moved {source}->{dest} ({moved} keys) under traffic: {dict(counts)}; "
        f"client outcomes {by_outcome}"
    )
