"""Rank insights through real rank processes (``python -m workers``) on a real server.

Rank 1 holds the prompt on its disk tier with a load delay, rank 0 in memory: every
lookup waits for rank 1, so the client's per-rank figures must say so. No timing is
asserted beyond the order the server's own clock gives the two reports.
"""

from __future__ import annotations

from typing import Any

import pytest
from faultkit import MakeLookupClient, StartRank, alive, answer, config, prompt
from helpers import RealServer, wait_until

from broker_lookup.protocol.stats import InsightsStats

pytestmark = [pytest.mark.real, pytest.mark.slow]

LOOKUPS = 3
#: One prompt per lookup: a disk load may leave its chunks in rank 1's memory tier.
PROMPTS = [prompt(3000 + 100 * i) for i in range(LOOKUPS)]


def test_real_ranks_give_every_rank_a_latency_and_name_the_straggler(
    real_server: RealServer, engine_id: str, rank_procs: StartRank, clients: MakeLookupClient
) -> None:
    memory: list[dict[str, Any]] = [{"tokens": p} for p in PROMPTS]
    disk: list[dict[str, Any]] = [{"tokens": p, "tier": "disk"} for p in PROMPTS]
    rank_procs(real_server.url, engine_id, 2, 0, memory)
    rank_procs(real_server.url, engine_id, 2, 1, disk, load_delay_ms=40)
    every = config(real_server.url, lookup_timeout_ms=10_000, rank_insights_max_per_s=0)
    client = clients(every, engine_id, 2)
    alive(client)
    for i, tokens in enumerate(PROMPTS):
        assert client.lookup(tokens, f"real{i}") is None
        assert answer(client, f"real{i}", timeout=15) == len(tokens)
        client.clear_lookup_status(f"real{i}")
    wait_until(lambda: (client.stats().rank_insights or InsightsStats()).recorded == LOOKUPS)
    ins = client.stats().rank_insights
    assert ins is not None
    for rank in (0, 1):
        assert sum(ins.ranks[rank].report_counts) == LOOKUPS, rank
        assert ins.ranks[rank].excess_lookups == 0  # both hold the whole prompt
    assert ins.ranks[1].last == LOOKUPS and ins.ranks[0].last == 0
    assert ins.ranks[1].report_sum > ins.ranks[0].report_sum
