"""One vLLM engine on the tiny model, driven through a scripted sequence; prints a JSON report.

Run by the tests in a child process (``python scenario.py --model DIR --mode async
--out report.json --steps hit,corrupt,abort,outage``), so the test process never
imports vLLM. The caller sets the environment (see ``conftest.engine_env``); this
script starts its own embedded Valkey (so it can stop and restart it mid-serving),
points ``BROKER_LOOKUP_REDIS_URL`` at it and runs vLLM with LMCache's connector.
Each step records what our client and servers counted (``probe``), the generated
tokens and their logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import probe

PROMPT_TOKENS = 360
CHUNK = 256


def prompt_ids(seed: int, vocab: int) -> list[int]:
    """A deterministic prompt of ``PROMPT_TOKENS`` token ids (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(PROMPT_TOKENS)]


class Run:
    """The engine, the broker server and the probe: what every step needs."""

    def __init__(self, args: argparse.Namespace, server: Any, probe_dir: Path) -> None:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.args = args
        self.server = server
        self.probe_dir = probe_dir
        self._seq = 0
        self.probe_s: list[float] = []
        self.vocab = json.loads((Path(args.model) / "tiny-llama.json").read_text())["vocab"]
        started = time.monotonic()
        self.llm = LLM(
            model=args.model,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=2048,
            block_size=128,
            enable_prefix_caching=False,  # every repeat must come from LMCache, not vLLM
            tensor_parallel_size=args.tp,
            seed=0,
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMCacheConnectorV1",
                kv_role="kv_both",
                engine_id=args.engine_id,
            ),
        )
        self.start_s = time.monotonic() - started

    def probe(self) -> dict[str, Any]:
        """Stats of our client (EngineCore) and every rank's server (workers), now."""
        self._seq += 1
        t0 = time.monotonic()
        found = probe.request(self.probe_dir, self._seq, want=1 + self.args.tp)
        self.probe_s.append(time.monotonic() - t0)
        clients = [c for p in found for c in p["clients"]]
        servers = [s for p in found for s in p["servers"]]
        return {
            "client": clients[0] if clients else None,
            "servers": sorted(servers, key=lambda s: s["rank"]),
            "processes": [
                {
                    "role": "worker" if p["servers"] else "scheduler",
                    **{k: p[k] for k in ("pid", "connector", "thread_cpu_s", "process_cpu_s")},
                }
                for p in found
            ],
        }

    def generate(self, ids: list[int], max_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation with top-5 logprobs; wall time included."""
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5, seed=0)
        t0 = time.monotonic()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds = time.monotonic() - t0
        completion = out[0].outputs[0]
        logprobs = [
            {str(tok): lp.logprob for tok, lp in step.items()} for step in completion.logprobs
        ]
        return {"tokens": list(completion.token_ids), "logprobs": logprobs, "seconds": seconds}


def step_hit(run: Run) -> dict[str, Any]:
    """Prompt 1 computed then loaded through our lookup; prompt 2 computed then loaded
    with noise added to the KV (a chunk is loaded at most once: LMCache 0.5.6 frees a
    chunk's memory object after its first async load, see README)."""
    first, second = prompt_ids(1, run.vocab), prompt_ids(2, run.vocab)
    probes = [run.probe()]
    computed = run.generate(first)
    probes.append(run.probe())
    loaded = run.generate(first)
    probes.append(run.probe())
    computed_2 = run.generate(second)
    (run.probe_dir / "noise").write_text(os.environ.get("BL_SCN_NOISE", "2.0"))
    try:
        corrupted = run.generate(second)
    finally:
        (run.probe_dir / "noise").unlink()
    probes.append(run.probe())
    return {
        "probes": probes,
        "computed": computed,
        "loaded": loaded,
        "computed_2": computed_2,
        "corrupted": corrupted,
    }


def step_abort(run: Run) -> dict[str, Any]:
    """Abort a request while its lookup is in flight (the worker's engine call is delayed)."""
    from vllm import SamplingParams, TokensPrompt

    ids = prompt_ids(3, run.vocab)
    run.generate(ids, max_tokens=2)  # stored: the aborted lookup will pin a real chunk
    before = run.probe()
    engine = run.llm.llm_engine
    (run.probe_dir / "delay_ms").write_text("1500")
    try:
        engine.add_request(
            "abort-me", TokensPrompt(prompt_token_ids=ids), SamplingParams(max_tokens=4)
        )
        time.sleep(0.5)  # the scheduler has sent the lookup; the worker is "busy"
        engine.abort_request(["abort-me"])  # the caller's id, as vLLM's API server aborts
        time.sleep(2.5)  # the delayed engine call returns, the abort is read, pins released
    finally:
        (run.probe_dir / "delay_ms").unlink()
    while engine.has_unfinished_requests():
        engine.step()
    after = run.probe()
    follow_up = run.generate(prompt_ids(4, run.vocab), max_tokens=2)  # the engine still serves
    return {"probes": [before, after, run.probe()], "follow_up": follow_up}


def step_outage(run: Run) -> dict[str, Any]:
    """Stop the broker mid-serving, keep serving, start it again on the same port."""
    before = run.probe()
    run.server.stop()
    down = [run.generate(prompt_ids(100 + i, run.vocab), max_tokens=2) for i in range(3)]
    during = run.probe()
    run.server.start()
    t0 = time.monotonic()
    recovered_after = None
    attempts = []
    while time.monotonic() - t0 < 30:
        hits_before = run.probe()["client"]["hit_tokens"]
        # stored while the broker was down; loaded (once) as soon as lookups work again
        result = run.generate(prompt_ids(100, run.vocab), max_tokens=2)
        hits = run.probe()["client"]["hit_tokens"] - hits_before
        attempts.append({"seconds": result["seconds"], "hit_tokens": hits})
        if hits > 0:
            recovered_after = time.monotonic() - t0
            break
        time.sleep(0.5)
    return {
        "probes": [before, during, run.probe()],
        "down_seconds": [d["seconds"] for d in down],
        "recovered_after_s": recovered_after,
        "attempts": attempts,
    }


STEPS = {"hit": step_hit, "abort": step_abort, "outage": step_outage}


def _lmcache_config(path: Path, mode: str) -> None:
    path.write_text(
        "\n".join(
            [
                f"chunk_size: {CHUNK}",
                "local_cpu: true",
                "max_local_cpu_size: 1",
                f"enable_async_loading: {'true' if mode == 'async' else 'false'}",
                "lookup_timeout_ms: 3000",
                "",
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["async", "sync"], default="async")
    parser.add_argument("--steps", default="hit")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--engine-id", default="bl-vllm-test")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from broker_lookup.tools.embedded import EmbeddedServer

    work = Path(tempfile.mkdtemp(prefix="bl-vllm-"))
    probe_dir = Path(os.environ["BL_TEST_PROBE_DIR"])
    _lmcache_config(work / "lmcache.yaml", args.mode)
    os.environ["LMCACHE_CONFIG_FILE"] = str(work / "lmcache.yaml")
    server = EmbeddedServer().start()
    os.environ["BROKER_LOOKUP_REDIS_URL"] = server.url
    report: dict[str, Any] = {"mode": args.mode, "tp": args.tp, "steps": {}}
    run: Run | None = None
    try:
        run = Run(args, server, probe_dir)
        report["engine_start_s"] = run.start_s
        for name in args.steps.split(","):
            t0 = time.monotonic()
            report["steps"][name] = STEPS[name](run)
            report["steps"][name]["wall_s"] = time.monotonic() - t0
        report["final"] = run.probe()
        report["probe_s"] = run.probe_s
    except BaseException:
        report["error"] = traceback.format_exc()
        raise
    finally:
        Path(args.out).write_text(json.dumps(report))
        if run is not None:  # engine first: its worker must not outlive the broker retrying
            run.llm.llm_engine.engine_core.shutdown()
        server.stop()
    return 0


if __name__ == "__main__":  # vLLM-CPU spawns its processes: the guard is required
    sys.exit(main())
