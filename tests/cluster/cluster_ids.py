"""Engine ids chosen by the slot their hash tag lands in, so tests control placement."""

from __future__ import annotations

import itertools
import uuid

from redis.crc import key_slot

from broker_lookup.protocol.keys import KeySpace
from broker_lookup.tools.local_cluster import LocalCluster


def slot_of(engine_id: str) -> int:
    """The one slot of every key of ``engine_id`` (its requests stream's, for instance)."""
    return key_slot(KeySpace(engine_id).requests.encode())


def spread_engine_ids(cluster: LocalCluster, count: int) -> list[str]:
    """``count`` fresh engine ids dealt round-robin over the masters (all covered if count >= N)."""
    masters = len(cluster.nodes)
    prefix = "c" + uuid.uuid4().hex[:8]
    by_node: dict[int, list[str]] = {i: [] for i in range(masters)}
    for n in itertools.count():
        engine_id = f"{prefix}-{n}"
        owner = cluster.owner(slot_of(engine_id))
        if len(by_node[owner]) < -(-count // masters):
            by_node[owner].append(engine_id)
        if sum(len(v) for v in by_node.values()) >= count:
            break
    ids = [e for group in itertools.zip_longest(*by_node.values()) for e in group if e]
    return ids[:count]
