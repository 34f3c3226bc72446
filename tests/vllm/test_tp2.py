"""Tensor parallelism 2 on vLLM-CPU: two worker ranks, one lookup server each, min over ranks.

vLLM-CPU binds each rank's OpenMP threads to a NUMA node and refuses two ranks on a
one-node machine (``AssertionError: Not enough allowed NUMA nodes to bind threads of 2
local CPUWorkers. Allowed NUMA nodes are [0]. Please try to bind threads manually or
decrease DP/TP/PP.``); ``VLLM_CPU_OMP_THREADS_BIND=0|1`` binds rank 0 to CPU 0 and
rank 1 to CPU 1 by hand, which needs two CPUs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import CHUNK, LOGPROB_TOLERANCE, client, max_logprob_diff, ok, scenario

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def tp2_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine with ``tensor_parallel_size=2`` through the hit step."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"tensor parallel 2 on vLLM-CPU needs two CPUs; this process has {cpus}")
    bind = f"{cpus[0]}|{cpus[1]}"
    work = tmp_path_factory.mktemp("tp2")
    return scenario(tiny_model, work, "async", "hit", tp=2, VLLM_CPU_OMP_THREADS_BIND=bind)


def test_two_ranks_answer_and_the_repeat_hits(tp2_report: dict[str, Any]) -> None:
    hit = ok(tp2_report)["steps"]["hit"]
    _, computed, loaded, last = hit["probes"]
    assert [s["rank"] for s in loaded["servers"]] == [0, 1]
    # every lookup reached both ranks; the last report of each completed it (min over ranks)
    for probe in (computed, loaded, last):
        counts = [s["counts"] for s in probe["servers"]]
        assert counts[0]["requests"] == counts[1]["requests"]
        completed = sum(c.get("report_complete", 0) for c in counts)
        assert completed == counts[0]["requests"], counts
    assert client(loaded)["outcomes"]["hit"] == 1 and client(loaded)["hit_tokens"] == CHUNK
    loads = [p["connector"]["to_gpu_chunks"] for p in loaded["processes"] if p["role"] == "worker"]
    assert loads == [1, 1]  # each rank loaded its shard of the chunk
    assert hit["loaded"]["tokens"] == hit["computed"]["tokens"]
    assert max_logprob_diff(hit["computed"], hit["loaded"]) <= LOGPROB_TOLERANCE
