"""Failover under traffic: clients and ranks on ``redis+sentinel://`` follow the new master.

One master, one replica, three sentinels (quorum 2, down-after 1000 ms, failover-timeout
3000 ms) on loopback. The master is SIGKILLed while an engine serves a steady stream of
lookups. In-flight lookups may end as 0, never with a wrong answer; every lookup ends
(nothing hangs); lookups succeed again within a bounded time, which the test prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from helpers import wait_until

from .cluster_stack import Stack, Traffic, run_batch, verdicts
from .sentinel_local import LocalSentinel

pytestmark = [pytest.mark.cluster, pytest.mark.real]

#: Sentinel needs down-after (1 s) + election + promotion; the clients then reconnect.
RECOVERY_BOUND_S = 10.0


def test_master_killed_mid_traffic_clients_and_ranks_follow_the_new_master(
    local_sentinel: LocalSentinel, stack: Callable[..., Stack]
) -> None:
    deployment = stack(local_sentinel.url)
    unit = deployment.unit("sentinel-e", hits=24, world_size=2)
    unit.wait_ready()
    assert run_batch(unit, "before", 10) == [unit.expected] * 10
    old_master = local_sentinel.master.port

    with Traffic(unit, "t", interval_s=0.01) as traffic:
        wait_until(lambda: len(traffic.started) >= 30, timeout=10)
        killed_at, promoted_s, settle = _kill_master_and_wait(local_sentinel, traffic)

    outcomes = traffic.outcomes(timeout=5.0)  # every lookup ended: nothing hangs
    counts = verdicts(outcomes, unit.expected)
    assert counts["wrong"] == 0, counts
    recovered_s = _first_success_after(traffic, unit.expected, killed_at)
    assert recovered_s is not None and recovered_s < RECOVERY_BOUND_S
    # Once one lookup succeeded, every later one does.
    late = [o for o in outcomes if o.started >= settle]
    assert late and all(o.result == unit.expected for o in late), verdicts(late, unit.expected)
    assert run_batch(unit, "after", 20) == [unit.expected] * 20
    promoted = local_sentinel.master_port()
    assert local_sentinel.replica is not None
    assert promoted == local_sentinel.replica.port
    closed_in = deployment.close()
    assert closed_in < 10.0
    print(
        f"\nsentinel failover: master killed; replica promoted after {promoted_s:.2f}s "
        f"(port {old_master} -> {promoted}); first lookup answered right "
        f"{recovered_s:.2f}s after the kill; traffic {dict(counts)}; closed in {closed_in:.2f}s"
    )


def _kill_master_and_wait(
    local_sentinel: LocalSentinel, traffic: Traffic
) -> tuple[float, float, float]:
    """Kill the master; wait for a promotion and for one lookup started after it to succeed.

    Returns when it was killed, seconds until the sentinels named a new master, and when
    the first success was seen; then waits for 30 more lookups to start.
    """
    old_master = local_sentinel.master.port
    killed_at = time.monotonic()
    local_sentinel.master.kill()
    wait_until(
        lambda: local_sentinel.master_port() not in (None, old_master),
        timeout=RECOVERY_BOUND_S,
        message="sentinels to promote the replica",
    )
    promoted_s = time.monotonic() - killed_at
    wait_until(
        lambda: _first_success_after(traffic, traffic.unit.expected, killed_at) is not None,
        timeout=RECOVERY_BOUND_S,
        interval=0.05,
        message="a lookup started after the kill to succeed",
    )
    settle = time.monotonic()
    wait_until(lambda: _count_after(traffic, settle) >= 30, timeout=5)
    return killed_at, promoted_s, settle


def _first_success_after(traffic: Traffic, expected: int, t0: float) -> float | None:
    """Seconds from ``t0`` to the start of the first lookup after it that got ``expected``."""
    client = traffic.unit.client
    for lookup_id, started in list(traffic.started):
        if started > t0 and client.lookup_cache(lookup_id) == expected:
            return started - t0
    return None


def _count_after(traffic: Traffic, t0: float) -> int:
    return sum(1 for _, started in list(traffic.started) if started >= t0)
