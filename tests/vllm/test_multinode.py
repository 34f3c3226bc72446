"""One vLLM engine over two "nodes" on one machine: tensor parallel 2 with vLLM's own
multi-node launcher (multiprocessing), node 0 serving the API with ``--nnodes 2
--node-rank 0`` and node 1 ``--node-rank 1 --headless``. Each node builds its own vLLM
config (its own ``instance_id``), so before the broker keyed multi-node engines on their
rendezvous, node 1's rank registered under another namespace and every lookup missed.

The same prompt three times must hit 0, 256, 256 tokens (LMCache's own log line in the
scheduler), and every process of the engine must be in one namespace. It is also the
vLLM leg's tensor-parallel engine: every lookup reaches both ranks and is completed by
their reports (min over ranks), each rank loads its shard of every hit, and the loaded
KV gives the computed logprobs.

vLLM-CPU binds each node's OpenMP threads to its own CPU (``VLLM_CPU_OMP_THREADS_BIND``),
so this needs two CPUs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from probe import request as probe_request
from scenario import prompt_ids
from vllm_harness import (
    CHUNK,
    HERE,
    LOGPROB_TOLERANCE,
    end_all,
    engine_env,
    healthy,
    max_logprob_diff,
    post,
    start,
    tail,
)

from broker_lookup.processes import free_port
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE_ID = "bl-mn"
START_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def two_nodes(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The engine's two nodes, healthy; the broker they share."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"two vLLM-CPU nodes need two CPUs; this process has {cpus}")
    work = tmp_path_factory.mktemp("multinode")
    broker = EmbeddedServer().start()
    config = work / "lmcache.yaml"
    config.write_text(
        "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\nenable_async_loading: false\n"
    )
    port, master = free_port(), free_port()
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "engine_id": ENGINE_ID}
    model = ["--model", str(tiny_model), "--dtype", "bfloat16", "--enforce-eager"]
    model += ["--max-model-len", "2048", "--block-size", "128", "--no-enable-prefix-caching"]
    model += ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1"]
    model += ["--master-port", str(master), "--kv-transfer-config", json.dumps(kv)]
    procs: list[subprocess.Popen[bytes]] = []
    logs = {"node0": work / "node0.log", "node1": work / "node1.log"}
    try:
        for node, cpu in enumerate(cpus[:2]):
            probe_dir = work / f"probe{node}"
            probe_dir.mkdir()
            env = engine_env(
                probe_dir,
                BROKER_LOOKUP_REDIS_URL=broker.url,
                LMCACHE_CONFIG_FILE=str(config),
                VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            )
            if node == 0:
                cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *model]
                cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
                cmd += ["--node-rank", "0"]
            else:
                cmd = [sys.executable, str(HERE / "headless_node.py"), *model]
                cmd += ["--node-rank", "1", "--headless"]
            procs.append(start(cmd, env, logs[f"node{node}"]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(port):
            for proc, log in zip(procs, logs.values(), strict=True):
                assert proc.poll() is None, f"{log.name} exited:\n{tail(log)}"
            assert time.monotonic() < deadline, f"not healthy:\n{tail(logs['node0'])}"
            time.sleep(1)
        vocab = json.loads((tiny_model / "tiny-llama.json").read_text())["vocab"]
        probes = [work / "probe0", work / "probe1"]
        yield {
            "port": port,
            "logs": logs,
            "vocab": vocab,
            "broker": broker,
            "procs": procs,
            "probes": probes,
        }
    finally:
        end_all(procs)
        broker.stop()


@pytest.fixture(scope="module")
def repeated(two_nodes: dict[str, Any]) -> list[dict[str, Any]]:
    """The choice vLLM answered for each of 3 requests of one prompt (top-5 logprobs)."""
    body = {"model": "tiny", "prompt": prompt_ids(11, two_nodes["vocab"]), "max_tokens": 4}
    body.update(temperature=0, logprobs=5)
    choices = []
    for _ in range(3):
        status, reply = post(two_nodes["port"], body)
        assert status == 200, reply
        choices.append(reply["choices"][0])
    return choices


def test_one_engine_over_two_nodes_hits_in_one_namespace(
    two_nodes: dict[str, Any], repeated: list[dict[str, Any]]
) -> None:
    logs = two_nodes["logs"]
    node0 = logs["node0"].read_text(errors="replace")
    hits = [int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", node0)]
    assert hits == [0, 256, 256], f"{hits}\n{node0[-4000:]}"
    assert repeated[0]["text"] == repeated[1]["text"] == repeated[2]["text"]
    computed, loaded = ({"logprobs": c["logprobs"]["top_logprobs"]} for c in repeated[:2])
    assert max_logprob_diff(computed, loaded) <= LOGPROB_TOLERANCE
    conn = redis.Redis.from_url(two_nodes["broker"].url, decode_responses=True)
    try:
        beats = sorted(conn.scan_iter(match=f"bl:{{{ENGINE_ID}*}}:hb:*"))
    finally:
        conn.close()
    namespaces = {key[len("bl:{") : key.index("}:")] for key in beats}
    assert len(namespaces) == 1, beats
    (namespace,) = namespaces
    assert namespace.startswith(f"{ENGINE_ID}@mn-")
    assert [key.rsplit(":", 1)[1] for key in beats] == ["0", "1"]  # both ranks, one per node
    node1 = logs["node1"].read_text(errors="replace")
    for log in (node0, node1):
        assert f"joins engine {namespace}" in log
        assert "is SPLIT" not in log
    assert all(proc.poll() is None for proc in two_nodes["procs"])


def test_every_lookup_reaches_both_ranks_and_each_loads_its_shard(
    two_nodes: dict[str, Any], repeated: list[dict[str, Any]]
) -> None:
    node0, node1 = two_nodes["probes"]
    # After the 3 requests (0, 256, 256 hit tokens). Node 0 runs vLLM's EngineCore (our
    # client) and rank 0's worker, node 1 rank 1's worker.
    found = [*probe_request(node0, 1, want=2), *probe_request(node1, 1, want=1)]
    (client,) = [c for p in found for c in p["clients"]]
    servers = sorted((s for p in found for s in p["servers"]), key=lambda s: s["rank"])
    assert [s["rank"] for s in servers] == [0, 1]
    counts = [s["counts"] for s in servers]
    assert counts[0]["requests"] == counts[1]["requests"] >= 3, counts
    completed = sum(c.get("report_complete", 0) for c in counts)
    assert completed == counts[0]["requests"], counts  # the last report completes each
    assert client["outcomes"]["hit"] == 2 and client["hit_tokens"] == 2 * CHUNK, client
    loads = [p["connector"]["to_gpu_chunks"] for p in found if p["servers"]]
    assert loads == [2, 2]  # each rank loaded its shard of the chunk, twice
