"""The reference router (``python -m router``) in front of two real vLLM-CPU replicas on one
Redis, each with LMCache 0.5.6 and the broker under its own configured engine id.

A prompt first served by replica B, then sent through the router, lands on B and loads
its 256 cached tokens (LMCache's own count, in B's scheduler log); the router says it
found and reserved 256 there. Round robin over the same two replicas, given prompts
each first served by B, hits half the time: the requests it sends to A recompute; the
router, given the same prompts next, hits every time.

The replicas are the session's ``replicas`` (conftest.py: ``a`` is ``bl-ra``, ``b`` is
``bl-serve``, which other tests share), so this module starts only the router.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from scenario import prompt_ids
from vllm_harness import (
    CHUNK,
    ROOT,
    healthy,
    hit_tokens,
    post,
    start,
    tail,
)

from broker_lookup.processes import end_group, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

#: Generous for a loaded 2-core machine: a rank answering late must not turn a hit
#: into the least-loaded fallback.
DEADLINE_MS = 5000


@pytest.fixture(scope="module")
def fleet(
    replicas: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The session's two replicas and ``python -m router`` in front of them."""
    broker_url = replicas["a"]["redis_url"]
    port, log = free_port(), tmp_path_factory.mktemp("router") / "router.log"
    cmd = [sys.executable, "-m", "router", "--redis-url", broker_url]
    cmd += ["--listen", f"127.0.0.1:{port}", "--deadline-ms", str(DEADLINE_MS)]
    cmd += ["--reserve-ms", "30000"]
    for replica in replicas.values():
        cmd += ["--replica", f"{replica['url']}={replica['engine_id']}"]
    # The engines' hashing: the same PYTHONHASHSEED (vLLM's NONE_HASH) and chunk size.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    env["BROKER_LOOKUP_CHUNK_SIZE"] = str(CHUNK)
    router = start(cmd, env, log)
    try:
        deadline = time.monotonic() + 60
        while not healthy(port, "/healthz"):
            assert router.poll() is None, f"the router exited:\n{tail(log)}"
            assert time.monotonic() < deadline, f"the router is not up:\n{tail(log)}"
            time.sleep(0.2)
        vocab = replicas["a"]["vocab"]
        yield {"replicas": replicas, "router": {"port": port, "log": log}, "vocab": vocab}
    finally:
        end_group(router)


def _complete(port: int, prompt: list[int]) -> str:
    """The completion of ``prompt`` (greedy, 4 tokens) from the server on ``port``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    status, reply = post(port, body)
    assert status == 200, reply
    return str(reply["choices"][0]["text"])


def test_a_prompt_served_by_b_goes_to_b_through_the_router_and_hits(
    fleet: dict[str, Any],
) -> None:
    a, b = fleet["replicas"]["a"], fleet["replicas"]["b"]
    prompt = prompt_ids(41, fleet["vocab"])
    seen_a, seen_b = len(hit_tokens(a["log"])), len(hit_tokens(b["log"]))
    first = _complete(b["port"], prompt)
    assert hit_tokens(b["log"])[seen_b:] == [0]  # B computes it and LMCache stores a chunk
    routed = _complete(fleet["router"]["port"], prompt)
    assert hit_tokens(b["log"])[seen_b:] == [0, CHUNK], tail(b["log"])  # B loaded 256
    assert hit_tokens(a["log"])[seen_a:] == []  # A never saw it
    assert routed == first  # the loaded KV gives the computed answer
    said = fleet["router"]["log"].read_text(errors="replace")
    assert f"-> {b['url']} (prefix, {{'found': {CHUNK}, 'reserved': {CHUNK}," in said, said


def test_round_robin_hits_half_the_time_where_the_router_always_hits(
    fleet: dict[str, Any],
) -> None:
    a, b = fleet["replicas"]["a"], fleet["replicas"]["b"]
    prompts = [prompt_ids(50 + i, fleet["vocab"]) for i in range(4)]
    for prompt in prompts:  # each first served by B
        _complete(b["port"], prompt)
    seen_a, seen_b = len(hit_tokens(a["log"])), len(hit_tokens(b["log"]))
    for turn, prompt in enumerate(prompts):  # round robin: A, B, A, B
        _complete((a, b)[turn % 2]["port"], prompt)
    assert hit_tokens(a["log"])[seen_a:] == [0, 0]  # A recomputes what B holds
    assert hit_tokens(b["log"])[seen_b:] == [CHUNK, CHUNK]
    seen_a, seen_b = len(hit_tokens(a["log"])), len(hit_tokens(b["log"]))
    for prompt in prompts:  # the router sends each where it is held (A, too, holds two now)
        _complete(fleet["router"]["port"], prompt)
    routed = hit_tokens(a["log"])[seen_a:] + hit_tokens(b["log"])[seen_b:]
    assert routed == [CHUNK] * 4, routed
